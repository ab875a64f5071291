"""One long sample per row, trained on one GPU with activation checkpointing against two GPUs with context
parallelism (``trainer.fabric.context_parallel=2``, torch's ring attention), or any FSDP2 layout with or
without context parallelism and checkpointing (``--arms 8gpu 8gpu_cp2 8gpu_ac``): trained tokens/s, MFU over
the arm's GPUs (6·N per token, N the matmul parameters, and PRIME-RL's count with attention, which dominates
at long rows) and peak memory per GPU.

The trainer alone (``asyncrl train``) on synthetic on-policy rollouts: ``--rows`` samples of ``--length``
tokens per step, each alone in its row, ``--steps`` steps per run (the first left out of the medians); the
arms run one after the other, ``--repeats`` times in a rotating order. The model is the Qwen3-0.6B shape
(``--shape 4b``: the 4B one).

    python benchmarks/context_parallel.py --length 65536 --out $OUT/context_parallel.json python
    benchmarks/context_parallel.py --shape 4b --length 65536 --rows 8 --arms 8gpu_ac 8gpu_cp2 8gpu_cp2_ac \
        --gpus 0,1,2,3,4,5,6,7   # PRIME-RL's trainer setting: Qwen3-4B, 65k rows, 8 GPUs
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from _results import rounds, stamped, write_results  # noqa: E402
from asyncrl.rollouts.packing import Sample, pack_samples  # noqa: E402
from asyncrl.transport.rollouts import write_rollouts  # noqa: E402

SHAPES = {"0.6b": "model=qwen3_0.6b_shape", "4b": "model=qwen3_4b_shape"}
# the arms of earlier results, by their names; any other is NAME = <N>gpu[_cp<C>][_ac[<K>]] (arm_overrides)
ALIASES = {"1gpu_ac": "1gpu_ac", "cp2": "2gpu_cp2", "cp2_ac": "2gpu_cp2_ac"}
ARM = re.compile(r"(\d+)gpu(?:_cp(\d+))?(_ac(\d*))?")


def arm_overrides(name: str) -> tuple[int, list[str]]:
    """An arm's GPU count and trainer overrides: ``<N>gpu`` is FSDP2 over the first N GPUs of ``--gpus``,
    ``_cp<C>`` adds context parallelism C (ring attention over C of them), ``_ac`` activation checkpointing
    of every layer, ``_ac<K>`` of one layer in K (``trainer.fabric.activation_checkpointing_every``)."""
    m = ARM.fullmatch(ALIASES.get(name, name))
    if m is None:
        raise argparse.ArgumentTypeError(
            f"arm {name!r}: <N>gpu[_cp<C>][_ac[<K>]] (e.g. 8gpu_cp2, 4gpu_ac2) or one of {sorted(ALIASES)}"
        )
    gpus, cp, ac, every = int(m[1]), int(m[2] or 1), bool(m[3]), int(m[4] or 1)
    if gpus < 1 or gpus % cp:
        raise argparse.ArgumentTypeError(f"arm {name!r}: context parallelism {cp} must divide its {gpus} GPUs")
    if every < 1:
        raise argparse.ArgumentTypeError(f"arm {name!r}: _ac<K> recomputes one layer in K, K >= 1")
    over = [
        f"trainer.fabric.devices={gpus}",
        "trainer.fabric.gpus='" + ",".join(map(str, range(gpus))) + "'",
    ]
    over += [f"trainer.fabric.context_parallel={cp}"] * (cp > 1)
    over += ["trainer.fabric.activation_checkpointing=true"] * ac
    over += [f"trainer.fabric.activation_checkpointing_every={every}"] * (every > 1)
    return gpus, over


def arm(name: str) -> str:
    """argparse type: a valid arm name."""
    arm_overrides(name)
    return name


def write_long_rollouts(run_dir: Path, steps: int, rows: int, length: int, vocab: int, sample_len: int) -> None:
    """``rows`` rows of ``length`` tokens a step, each holding ``length // sample_len`` samples of
    ``sample_len`` (one a row when they are equal: context parallelism needs that)."""
    rng = np.random.default_rng(0)
    per_row = length // sample_len
    for step in range(steps):
        samples = []
        for _ in range(rows * per_row):
            completion = rng.integers(300, vocab - 300, sample_len - 64).tolist()
            logprobs = (-rng.random(len(completion)) * 3).tolist()
            samples.append(Sample(rng.integers(300, vocab - 300, 64).tolist(), completion, logprobs, 1.0, 1.0))
        mbs = pack_samples(samples, length, 0, one_per_row=per_row == 1)
        meta = {"step": step, "policy_versions": [step], "num_samples": len(samples),
                "loss_tokens": int(sum(m["loss_mask"].sum() for m in mbs))}  # fmt: skip
        write_rollouts(run_dir / "rollouts" / f"step_{step}", mbs, meta)


def run_arm(name: str, common: list[str], root: Path, args, vocab: int) -> dict:
    run = root / f"{name}_{time.monotonic_ns()}"
    write_long_rollouts(run, args.steps, args.rows, args.length, vocab, args.sample_len or args.length)
    profile = [f"trainer.profile_step={args.profile_step}"] if args.profile_step is not None else []
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "train",
        *common,
        f"run_dir={run}",
        *arm_overrides(name)[1],
        *args.extra,
    ]
    cmd += profile
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": args.gpus})
    if proc.returncode:
        shutil.rmtree(run, ignore_errors=True)
        return {"error": proc.stderr[-2000:]}
    rows = [json.loads(x) for x in (run / "metrics" / "trainer.jsonl").read_text().splitlines()][1:]
    timed = [r for r in rows if r["step"] != args.profile_step]  # the profiler slows the step it watches
    res = {
        "tokens_per_s": statistics.median(r["train/tokens_per_s"] for r in timed),
        "peak_mem_gib": max(r.get("train/peak_mem_gib", 0.0) for r in rows),  # none on CPU
        "losses": [r["train/loss"] for r in rows],
    }
    if profile:  # trainer.profile_step's overlap summary per rank, and rank 0's op table beside --out
        res["profile"] = [json.loads(p.read_text()) for p in sorted((run / "profile").glob("step_*_rank*[0-9].json"))]
        ops = run / "profile" / f"step_{args.profile_step}_rank0_ops.txt"
        if ops.exists():
            shutil.copy(ops, Path(args.out).with_name(f"{Path(args.out).stem}_{name}_ops.txt"))
    shutil.rmtree(run)  # a 4B run's final checkpoint is ~50 GB: the next arm's would not fit beside it
    return res


def summarize(results: dict[str, list[dict]], flops_6n: float, flops_attn: float, peak: float) -> dict:
    """Per arm, over its runs: the median tokens/s and its range, MFU over the arm's GPUs both ways
    (``flops_*``: per token, :func:`asyncrl.trainer.perf.step_flops`), the peak memory."""
    summary = {}
    for name, runs in results.items():
        ok = [x for x in runs if "error" not in x]
        if not ok:
            summary[name] = {"error": runs[-1]["error"][-500:]} if runs else {"error": "not run yet"}
            continue
        gpus = arm_overrides(name)[0]
        tok_s = statistics.median(x["tokens_per_s"] for x in ok)
        spread = [min(x["tokens_per_s"] for x in ok), max(x["tokens_per_s"] for x in ok)]
        summary[name] = {"tokens_per_s": tok_s, "tokens_per_s_range": spread, "runs": len(ok),
                         "mfu_6n": tok_s * flops_6n / (peak * gpus),
                         "mfu_attn": tok_s * flops_attn / (peak * gpus),
                         "peak_mem_gib": max(x["peak_mem_gib"] for x in ok)}  # fmt: skip
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    ap.add_argument("--length", type=int, default=65536)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument(
        "--sample-len",
        type=int,
        default=0,
        help="samples of this many tokens, as many a row as fit (0: one of --length a row; context parallel arms)",
    )
    ap.add_argument("--model", help="a directory for the built model, reused when it holds one (saves the build)")
    ap.add_argument("--profile-step", type=int, help="trainer.profile_step of every run (left out of the medians)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument(
        "--arms", nargs="+", type=arm, default=list(ALIASES), help="<N>gpu[_cp<C>][_ac[<K>]], e.g. 8gpu_cp2"
    )
    ap.add_argument(
        "--gpus",
        default="0,1",
        help="the GPUs the arms run on (CUDA_VISIBLE_DEVICES); an arm of N takes the first N",
    )
    ap.add_argument(
        "--extra",
        nargs="*",
        default=[],
        help="config overrides for every arm, after the script's own (trainer.fabric.compile=true)",
    )
    ap.add_argument("--out", default="benchmarks/results/context_parallel.json")
    args = ap.parse_args()
    with_cp = [a for a in args.arms if "trainer.fabric.context_parallel" in " ".join(arm_overrides(a)[1])]
    if args.sample_len and (args.sample_len > args.length or with_cp):
        ap.error("--sample-len: at most --length, and not with context parallel arms (one sample a row)")

    import torch
    from transformers import AutoConfig

    from asyncrl.config.compose import compose_config
    from asyncrl.models.hf import build_tiny_model
    from asyncrl.trainer.perf import matmul_params, peak_flops, step_flops

    root = Path(tempfile.mkdtemp())
    init = compose_config([SHAPES[args.shape]]).model.init
    model: str | Path = args.model or root / "model"
    if not (Path(model) / "config.json").exists():
        model = build_tiny_model(init, model, seed=0)
    hf = AutoConfig.from_pretrained(model)
    n = matmul_params(hf)
    # at long samples causal attention outweighs 6·N: MFU both ways, per token of one sample a row
    sample_len = args.sample_len or args.length
    per_token = {k: v / sample_len for k, v in step_flops(hf, [sample_len]).items()}
    common = [
        SHAPES[args.shape],
        f"model.name={model}",
        f"max_steps={args.steps}",
        "async_level=0",
        "strict_async=false",
        f"seq_len={args.length}",
        "orchestrator.max_tokens=64",
        "model.attn_implementation=sdpa",
        "trainer.fabric.accelerator=cuda",
        "trainer.fabric.strategy=fsdp2",
        "trainer.fabric.precision=bf16-mixed",
        "trainer.fabric.num_threads=0",
        "trainer.micro_batch_rows=1",
    ]
    results: dict[str, list[dict]] = {a: [] for a in args.arms}
    peak = peak_flops(torch.cuda.get_device_name())
    summary: dict = {}  # --repeats 0 runs nothing and prints nothing
    for r, name in rounds(args.arms, args.repeats):
        res = run_arm(name, common, root, args, init.vocab_size)
        results[name].append(res)
        shown = res if "error" in res else {k: res[k] for k in ("tokens_per_s", "peak_mem_gib")}
        print(f"repeat {r} {name}: {shown}", flush=True)
        summary = summarize(results, per_token["6n"], per_token["attn"], peak)
        # after every run: a call cut short by its time limit keeps the runs it finished
        write_results(
            args.out,
            stamped(
                "context_parallel",
                device=torch.cuda.get_device_name(),
                shape=args.shape,
                length=args.length,
                sample_len=sample_len,
                rows=args.rows,
                matmul_params=n,
                summary=summary,
                runs=results,
            ),
        )
    for name, m in summary.items():
        if "error" not in m:
            print(
                f"| {name} | {m['tokens_per_s']:.0f} tok/s | MFU {m['mfu_6n']:.3f} (6N), "
                f"{m['mfu_attn']:.3f} (counting causal attention) | {m['peak_mem_gib']:.1f} GiB |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
