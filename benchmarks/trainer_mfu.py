"""Trainer tokens/s and MFU on the Qwen3-0.6B shape (``--shape 4b``: the 4B one; random init, vocab 151936),
packed rows, one GPU.

Runs the real trainer step (Fabric, FSDP2 on one GPU, bf16-mixed, RL loss over packed micro-batches)
on random samples packed into rows of each ``--row-lens``, for each attention implementation, each
configuration in a fresh process. Prints a table and writes JSON.

    python benchmarks/trainer_mfu.py --row-lens 8192 16384 --attn varlen sdpa --out $OUT/trainer_mfu.json
"""

from __future__ import annotations

import argparse
import gzip
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import rounds, stamped, write_results

SHAPES = {"0.6b": ["model=qwen3_0.6b_shape"], "4b": ["model=qwen3_4b_shape"]}
# --smoke: the same code on CPU with a micro shape, to check the script without a GPU
SMOKE_MODEL = [
    "model=qwen3_0.6b_shape",
    "model.init.hidden_size=64",
    "model.init.num_hidden_layers=2",
    "model.init.intermediate_size=128",
    "model.init.num_attention_heads=4",
    "model.init.num_key_value_heads=2",
    "model.init.head_dim=16",
    "model.init.vocab_size=1000",
    # vocab_size ids: Qwen3's 151,669 would make the CPU smoke's logprob head its cost
    "model.init.tokenizer=byte_bpe",
]
DEVICE = [
    "trainer.fabric.accelerator=cuda",
    "trainer.fabric.strategy=fsdp2",
    "trainer.fabric.precision=bf16-mixed",
    "trainer.fabric.num_threads=0",
]
SMOKE_DEVICE = [
    "trainer.fabric.accelerator=cpu",
    "trainer.fabric.strategy=fsdp2",
    "trainer.fabric.precision=32-true",
    "trainer.fabric.num_threads=2",
]


def build_model(path: Path, smoke: bool, shape: str) -> None:
    from asyncrl.config.compose import compose_config
    from asyncrl.models.hf import build_tiny_model

    build_tiny_model(compose_config(SMOKE_MODEL if smoke else SHAPES[shape]).model.init, path, seed=0)


def one(
    model_dir: str,
    row_len: int,
    attn: str,
    ac: str,
    steps: int,
    warmup: int,
    rows: int,
    smoke: bool,
    profile: str | None = None,
    extra: list[str] | None = None,
    compiled: bool = False,
    mb_rows: int = 1,
    step_variant: str = "current",
    shape: str = "0.6b",
    sample_len: int = 0,
) -> dict:
    import numpy as np
    import torch

    from asyncrl.config.compose import compose_config
    from asyncrl.rollouts.packing import Sample, pack_samples
    from asyncrl.trainer.forward import batch_to_torch
    from asyncrl.trainer.loss import LossInputs, rl_loss
    from asyncrl.trainer.perf import mfu_at, peak_flops, prime_rl_flops_per_token
    from asyncrl.trainer.state import build_train_state
    from asyncrl.trainer.step import step_over_micro_batches

    if step_variant == "unfused":
        use_unfused_step()
    if step_variant == "dynamic-head":
        use_dynamic_head()
    if step_variant == "early-syncs":
        use_early_syncs()
    cfg = compose_config(
        [
            *(SMOKE_MODEL if smoke else SHAPES[shape]),
            f"model.name={model_dir}",
            f"model.attn_implementation={attn}",
            f"seq_len={row_len}",
            *(SMOKE_DEVICE if smoke else DEVICE),
            *ac_overrides(ac),
            f"trainer.fabric.compile={str(compiled).lower()}",
            *(["numerics=fast"] if compiled else []),
            f"orchestrator.max_tokens={min(1024, row_len // 2)}",
            *(extra or []),
        ]
    )
    fabric, raw, _, state = build_train_state(cfg, cfg.trainer.optim, cfg.trainer.scheduler, 10**6)
    rng = np.random.default_rng(0)
    vocab = raw.config.vocab_size

    def batch():
        samples, total = [], 0
        while total < rows * row_len * 0.97:  # FFD fills rows nearly completely at these lengths
            p, c = (
                int(rng.integers(64, 512)) % (row_len // 4) + 1,
                int(rng.integers(128, 1536)) % (row_len // 2) + 1,
            )
            if sample_len:  # samples of one length, as long generations give (a 64-token prompt)
                p = min(64, sample_len // 2)
                c = sample_len - p
            lengths.append(p + c)
            samples.append(
                Sample(
                    rng.integers(0, vocab, p).tolist(),
                    rng.integers(0, vocab, c).tolist(),
                    (-rng.random(c)).tolist(),
                    float(rng.normal()),
                )
            )
            total += p + c
        mbs = pack_samples(samples, row_len, 0, rows_per_micro_batch=mb_rows, pad_multiple=128)
        return batch_to_torch(mbs), sum(int((mb["loss_mask"]).sum()) for mb in mbs)

    times, tokens, lengths = [], [], []
    sync = torch.cuda.synchronize if not smoke else (lambda: None)
    if not smoke:
        torch.cuda.reset_peak_memory_stats()
    phases: dict[str, float] = {}
    for i in range(warmup + steps + bool(profile)):
        mbs, loss_tokens = batch()
        profiling = i == warmup + steps  # one more step, profiled, after the timed ones

        def lf(lp, mb, loss_tokens=loss_tokens):
            inputs = LossInputs(
                lp,
                mb["inference_logprobs"][:, 1:],
                mb["advantages"][:, 1:],
                mb["loss_mask"][:, 1:],
                loss_tokens,
            )
            # the trainer leaves the metrics on the device; the unfused variant reads them per micro-batch
            return rl_loss(inputs, cfg.trainer.loss, read_metrics=step_variant == "unfused")

        sync()
        if profiling:
            phases = profiled_step(
                profile,
                f"row{row_len}_{attn}_ac{ac}_c{int(compiled)}_rows{rows}x{mb_rows}_{step_variant}".replace(":", "-"),
                smoke,
                sync,
                lambda mbs=mbs, lf=lf: step_over_micro_batches(
                    fabric, state.model, state.optimizer, state.scheduler, mbs, lf, max_grad_norm=1.0
                ),
            )
            continue
        t = time.perf_counter()
        step_over_micro_batches(fabric, state.model, state.optimizer, state.scheduler, mbs, lf, max_grad_norm=1.0)
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - t)
            tokens.append(sum(int(mb["input_ids"].numel()) for mb in mbs))
    rates = [n / t for n, t in zip(tokens, times, strict=True)]
    tok_s = statistics.median(rates)
    device = "NVIDIA H100 (smoke test on CPU)" if smoke else torch.cuda.get_device_name()
    return {
        "row_len": row_len,
        "attn": attn,
        "activation_checkpointing": ac,
        "compile": compiled,
        "rows_per_step": rows,
        "rows_per_micro_batch": mb_rows,
        "step_variant": step_variant,
        "step_s": statistics.median(times),
        "tokens_per_s": tok_s,
        "tokens_per_s_range": [min(rates), max(rates)],  # the spread over the timed steps
        "device": device,
        **mfu_at(raw.config, lengths, tok_s, device),  # mfu_6n and mfu_attn
        "mfu_prime_rl": tok_s * prime_rl_flops_per_token(raw.config, row_len) / peak_flops(device),
        "sample_len": sample_len or "mixed",
        "peak_mem_gib": 0.0 if smoke else torch.cuda.max_memory_allocated() / 2**30,
        **({"extra": extra} if extra else {}),
        **({"profile_phases_s": phases} if phases else {}),
    }


def use_unfused_step() -> None:
    """``--step-variant unfused``: the step with three costs put back, for an A/B in one run. Fabric's own
    bf16-mixed plugin (the whole logits cast to fp32 and back every micro-batch, under ``strategy=auto``);
    each micro-batch copied from pageable memory as its turn comes (after the previous one's backward is
    queued, which the copy then waits for) with its attention boundaries computed on the GPU (no
    ``PACKED_KWARGS``); and the loss metrics read per micro-batch (``read_metrics=True`` in ``one``)."""
    from lightning_fabric.plugins.precision import MixedPrecision

    from asyncrl.trainer import parallel, step

    parallel.mixed_precision_keeping_outputs = lambda device: MixedPrecision("bf16-mixed", device)
    step.micro_batches_to_device = lambda mbs, device: ({k: v.to(device) for k, v in mb.items()} for mb in mbs)


def use_dynamic_head() -> None:
    """``--step-variant dynamic-head``: the fused logprob head compiled with ``dynamic=True`` (the vocabulary
    a symbolic size too), the rest of the step as it is."""
    from asyncrl.trainer import state

    orig = state.compiled_logprobs
    state.compiled_logprobs = lambda: orig(dynamic=True)


def use_early_syncs() -> None:
    """``--step-variant early-syncs``: two host syncs, one before the clip (the losses read: the host waits
    for the last backward) and before the optimizer step (the gradient norm read), so the GPU idles while the
    host launches each; the trainer's step has one sync after both."""
    import torch

    from asyncrl.trainer import step

    orig = step.clip_gradients

    def clip_gradients(parameters, max_norm):
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # an early read of the losses
        norm = orig(parameters, max_norm)
        if norm is not None:
            float(norm)
        return norm

    step.clip_gradients = clip_gradients


def profiled_step(out_dir: str, tag: str, smoke: bool, sync, step) -> dict[str, float]:
    """Run ``step`` under torch's profiler; write the op tables (by GPU time, by CPU time) and a Chrome trace
    to ``out_dir``; return the wall time of the step and of each ``asyncrl.*`` phase (see
    step_over_micro_batches)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([] if smoke else [ProfilerActivity.CUDA])
    with profile(activities=activities, record_shapes=False) as prof:
        t = time.perf_counter()
        step()
        sync()
        wall = time.perf_counter() - t
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    events = prof.key_averages()
    sort = "cpu_time_total" if smoke else "self_cuda_time_total"
    (out / f"{tag}_ops.txt").write_text(
        events.table(sort_by=sort, row_limit=30) + "\n\n" + events.table(sort_by="cpu_time_total", row_limit=30)
    )
    trace = out / f"{tag}_trace.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    phases = {"step_wall": wall}
    for e in events:
        if e.key.startswith("asyncrl."):
            phases[e.key + "_cpu"] = e.cpu_time_total / 1e6
            phases[e.key + "_gpu"] = getattr(e, "device_time_total", 0.0) / 1e6
    phases["gpu_busy"] = kernel_time_s(events)
    return phases


def kernel_time_s(events) -> float:
    """Seconds of GPU kernels (and copies) among a profile's ``key_averages()``, as the table's "Self CUDA
    time total" counts them: the device's own events, not the CPU ops (whose self device time is that of the
    kernels they launched, already counted) nor ``record_function`` ranges shown on the GPU's timeline."""
    from torch.autograd import DeviceType

    return (
        sum(
            e.self_device_time_total
            for e in events
            if e.device_type != DeviceType.CPU and not getattr(e, "is_user_annotation", False)
        )
        / 1e6
    )


def ac_overrides(ac: str) -> list[str]:
    """The config overrides of an ``--ac`` value: ``0``, ``k`` or ``k:SAVES``."""
    every, _, saves = str(ac).partition(":")
    if int(every) == 0:
        return ["trainer.fabric.activation_checkpointing=false"]
    return [
        "trainer.fabric.activation_checkpointing=true",
        f"trainer.fabric.activation_checkpointing_every={int(every)}",
        *([f"trainer.fabric.activation_checkpointing_saves={saves}"] if saves else []),
    ]


def fmt_phases(phases: dict[str, float]) -> str:
    return " ".join(f"{k.removeprefix('asyncrl.')}={v:.3f}" for k, v in phases.items())


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--row-lens", type=int, nargs="+", default=[8192, 16384])
    ap.add_argument("--attn", nargs="+", default=["varlen", "sdpa"])
    ap.add_argument(
        "--ac",
        nargs="+",
        default=["0"],
        help="activation checkpointing: 0 off, k recomputes one layer in k, k:SAVES also keeps what "
        "trainer.fabric.activation_checkpointing_saves names (2:matmuls, 1:matmuls_and_attention)",
    )
    ap.add_argument("--compile", type=int, nargs="+", default=[0], help="trainer.fabric.compile off (0) / on (1)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rows", type=int, nargs="+", default=[4], help="packed rows (micro-batches) per optimizer step")
    ap.add_argument("--mb-rows", type=int, nargs="+", default=[1], help="packed rows per forward (micro-batch)")
    ap.add_argument(
        "--step-variant",
        nargs="+",
        default=["current"],
        choices=("current", "unfused", "dynamic-head", "early-syncs"),
        help="the trainer step as it is, unfused (use_unfused_step), with a dynamic-shape logprob head "
        "(use_dynamic_head) or with early host syncs (use_early_syncs), side by side",
    )
    ap.add_argument("--repeats", type=int, default=1, help="rounds, each configuration once per round, order rotating")
    ap.add_argument("--profile", help="also profile one step of each configuration (first round); tables go here")
    ap.add_argument("--extra", nargs="*", default=[], help="config overrides for every configuration")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.6b")
    ap.add_argument("--sample-len", type=int, default=0, help="samples of this many tokens (0: mixed, 194-2,048)")
    ap.add_argument("--out", default="benchmarks/results/trainer_mfu.json")
    ap.add_argument("--smoke", action="store_true", help="run on CPU with a micro shape (checks the script only)")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration in this process
    return ap.parse_args()


def run_config(spec: dict, label: str, repeat: int) -> dict:
    """One configuration in a fresh process: its result, or the spec with the process's error."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--one", json.dumps(spec)], capture_output=True, text=True)
    wall_s = time.perf_counter() - t0  # the process whole: loading, compiling, warm-up and the timed steps
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        print(f"{label}: FAILED\n{proc.stderr[-1500:]}", flush=True)
        return {**spec, "label": label, "repeat": repeat, "error": proc.stderr[-1500:]}
    r = {**json.loads(lines[-1][7:]), "label": label, "repeat": repeat, "wall_s": wall_s}
    print(
        f"{label}: {r['tokens_per_s']:>9.0f} tok/s  "
        f"MFU {100 * r['mfu_6n']:.1f}% (6N) / {100 * r['mfu_attn']:.1f}% (6N + causal "
        f"attention) / {100 * r['mfu_prime_rl']:.1f}% (PRIME-RL)  "
        f"step {r['step_s']:.2f}s  peak {r['peak_mem_gib']:.1f} GiB  run {wall_s:.0f}s"
        + (f"  phases {fmt_phases(r['profile_phases_s'])}" if "profile_phases_s" in r else ""),
        flush=True,
    )
    return r


def summarize(results: list[dict]) -> list[dict]:
    """Per configuration, over its rounds: the median and the range of tokens/s and of MFU both ways."""
    out = []
    for label in dict.fromkeys(r["label"] for r in results):
        runs = [r for r in results if r["label"] == label and "error" not in r]
        if not runs:
            continue
        m = {"label": label, "runs": len(runs), "peak_mem_gib": max(r["peak_mem_gib"] for r in runs)}
        for key in ("tokens_per_s", "mfu_6n", "mfu_attn"):
            values = [r[key] for r in runs]
            m.update({key: statistics.median(values), f"{key}_range": [min(values), max(values)]})
        out.append(m)
    return out


def main() -> int:
    args = parse_args()
    if args.one:
        print("RESULT " + json.dumps(one(**json.loads(args.one))), flush=True)
        return 0
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        t0 = time.perf_counter()
        build_model(model_dir, args.smoke, args.shape)
        print(f"model {args.shape} built in {time.perf_counter() - t0:.0f}s", flush=True)
        grid = list(
            itertools.product(
                args.row_lens, args.attn, args.ac, args.rows, args.compile, args.mb_rows, args.step_variant
            )
        )
        keys = ("row_len", "attn", "ac", "rows", "compiled", "mb_rows", "step_variant")
        common = {
            "model_dir": str(model_dir),
            "steps": args.steps,
            "warmup": args.warmup,
            "smoke": args.smoke,
            "extra": args.extra,
            "shape": args.shape,
            "sample_len": args.sample_len,
        }
        for repeat, values in rounds(grid, args.repeats):
            spec = {
                **common,
                **dict(zip(keys, values, strict=True)),
                "profile": args.profile if not repeat else None,
            }
            spec["compiled"] = bool(spec["compiled"])
            row, attn, ac, rows, compiled, mb_rows, variant = values
            label = f"row {row:>6} attn {attn:<7} ac {ac} rows {rows}/{mb_rows} compile {compiled} step {variant}"
            results.append(run_config(spec, label, repeat))
            # after every run: a call cut short by its time limit keeps the runs it finished
            write_results(args.out, stamped("trainer_mfu", results=results, summary=summarize(results)))
    for m in summarize(results):
        (lo, hi), (alo, ahi) = m["mfu_6n_range"], m["mfu_attn_range"]
        print(
            f"{m['label']}: median of {m['runs']}: {m['tokens_per_s']:.0f} tok/s, MFU "
            f"{100 * m['mfu_6n']:.1f}% ({100 * lo:.1f}-{100 * hi:.1f}) by 6N, {100 * m['mfu_attn']:.1f}% "
            f"({100 * alo:.1f}-{100 * ahi:.1f}) "
            "counting causal attention"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
