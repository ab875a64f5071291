"""RL seconds per step, side by side: asynchronous against synchronous, the continuous schedule against step,
or LoRA against full fine-tuning.

Runs `asyncrl rl` on the reverse_text experiment from a given (SFT-warmed) model, alternating the two
settings for ``--repeats`` rounds so machine noise hits both alike. Per run it takes the median gap
between consecutive trainer steps (skipping warm-up steps), the generated tokens per second over those steps,
and the median generation and training times from the metrics files. Prints a table and writes JSON.

``--compare async`` (default): async_level 1 against 0. ``--compare schedule``: ``orchestrator.schedule``
continuous against step, at the experiment's async_level; with ``--longtail`` the completions have a
heavy-tailed length (``benchmarks/longtail_env.py``: most short, a fraction near
``orchestrator.max_tokens``). ``--compare lora``: ``model.lora.enabled`` (r 16, q/k/v/o) against full
fine-tuning, with the trainer's peak GPU memory (``train/peak_mem_gib``, CUDA only), its weight export and
the sidecar's weight update. ``--compare numerics``: ``numerics=bitwise`` (trainer on vLLM's batch-invariant
kernels; vLLM batch-invariant with asyncrl's plugin, Triton attention, CUDA graphs without Inductor) against
``fast`` (vLLM with its defaults), with step 0's mismatch_kl.

    python benchmarks/rl_step.py --model outputs/reverse_text/sft/model --steps 40 --repeats 3 python
    benchmarks/rl_step.py --compare schedule --steps 40 --repeats 3 --out
    benchmarks/results/rl_schedule_cpu.json
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import cpu_model, median_gap, read_jsonl, write_results

HERE = Path(__file__).resolve().parent
VARIANTS = {
    "async": {"async_level=0": ["async_level=0"], "async_level=1": ["async_level=1"]},
    "schedule": {"step": ["orchestrator.schedule=step"], "continuous": ["orchestrator.schedule=continuous"]},
    "lora": {"full": [], "lora": ["model.lora.enabled=true"]},
    "numerics": {"fast": ["numerics=fast"], "bitwise": ["numerics=bitwise"]},
}
LONGTAIL = ["env.reverse_text.type=longtail_env:LongTail", "+orchestrator.extra_body.ignore_eos=true"]


def one_run(model: str, steps: int, overrides: list[str], run_dir: Path, extra: list[str]) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "asyncrl",
        "rl",
        "experiment=reverse_text",
        f"model.name={model}",
        f"run_dir={run_dir}",
        f"max_steps={steps}",
        "launcher.progress=false",
        *overrides,
        *extra,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"run failed:\n{proc.stderr[-3000:]}")
    train, orch = (read_jsonl(run_dir / "metrics" / f"{name}.jsonl") for name in ("trainer", "orchestrator"))
    warm = 5  # process start-up and first-step effects
    span = train[-1]["time"] - train[warm - 1]["time"]
    return {
        "s_per_step": median_gap([r["time"] for r in train[warm:]]),
        "s_per_step_mean": span / (len(train) - warm),  # wall clock: what steps per hour are
        # tokens of the batches trained in the measured steps, per second of them
        "gen_tok_s_overall": sum(r["rollout/completion_tokens"] for r in orch[warm:]) / span,
        "generate_s": statistics.median(r["time/generate_s"] for r in orch[warm:]),
        "train_s": statistics.median(r["time/train_s"] for r in train[warm:]),
        "train_tok_s": statistics.median(r["train/tokens_per_s"] for r in train[warm:]),
        "publish_s": statistics.median(r["time/publish_s"] for r in train[warm:]),  # trainer's weight export
        # sidecar reload
        "update_weights_s": statistics.median(r["time/update_weights_s"] for r in orch[warm:]),
        "gen_tok_s": statistics.median(r["rollout/throughput_tok_s"] for r in orch[warm:]),
        "staleness_mean": statistics.mean(r.get("async/staleness_mean", 0.0) for r in orch[warm:]),
        "stale_dropped": sum(r.get("rollout/stale_dropped", 0) for r in orch),  # whole run
        "tokens_per_step": statistics.mean(r["rollout/completion_tokens"] for r in orch[warm:]),
        "reward_last10": statistics.mean(r["rollout/reward_mean"] for r in orch[-10:]),
        "peak_mem_gib": max((r.get("train/peak_mem_gib", 0.0) for r in train), default=0.0),  # 0 off CUDA
        "mismatch_kl_step0": train[0]["train/mismatch_kl"],  # on-policy: trainer vs sidecar numerics alone
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="outputs/reverse_text/sft/model")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compare", choices=sorted(VARIANTS), default="async")
    ap.add_argument("--longtail", action="store_true", help="heavy-tailed completion lengths (longtail_env.py)")
    ap.add_argument("--out", default="benchmarks/results/rl_step_cpu.json")
    ap.add_argument("--run-root", default=None, help="where run directories go (e.g. /dev/shm: weights through tmpfs)")
    ap.add_argument("extra", nargs="*", help="more overrides, e.g. orchestrator.prompts_per_step=8")
    args = ap.parse_args()
    variants = VARIANTS[args.compare]
    extra = (LONGTAIL if args.longtail else []) + args.extra
    results: dict[str, list[dict]] = {label: [] for label in variants}
    with tempfile.TemporaryDirectory(dir=args.run_root) as tmp:
        for r in range(args.repeats):
            # alternate which goes first
            for i, label in enumerate(reversed(variants) if r % 2 else variants):
                run_dir = Path(tmp) / f"{args.compare}{i}_{r}"
                results[label].append(one_run(args.model, args.steps, variants[label], run_dir, extra))
    summary = {k: {m: statistics.median(run[m] for run in runs) for m in runs[0]} for k, runs in results.items()}
    base, new = list(variants)
    ratio = summary[base]["s_per_step"] / summary[new]["s_per_step"]
    wall_ratio = summary[base]["s_per_step_mean"] / summary[new]["s_per_step_mean"]
    tok_ratio = summary[new]["gen_tok_s_overall"] / summary[base]["gen_tok_s_overall"]
    print(f"RL step time, reverse_text, {args.steps} steps x {args.repeats} interleaved repeats (medians)")
    print(
        f"{args.compare:>13} {'s/step':>8} {'gen s':>7} {'train s':>8} {'export s':>9} {'reload s':>9} "
        f"{'train tok/s':>12} {'gen tok/s':>10} {'staleness':>9} {'peak GiB':>9}"
    )
    for label in variants:
        s = summary[label]
        print(
            f"{label:>13} {s['s_per_step']:>8.3f} {s['generate_s']:>7.3f} {s['train_s']:>8.3f} "
            f"{s['publish_s']:>9.3f} {s['update_weights_s']:>9.3f} {s['train_tok_s']:>12.0f} "
            f"{s['gen_tok_s_overall']:>10.0f} {s['staleness_mean']:>9.2f} {s['peak_mem_gib']:>9.2f}"
        )
    print(
        f"{new} over {base}: {ratio:.2f}x steps per hour by the median step, {wall_ratio:.2f}x by wall "
        f"clock, {tok_ratio:.2f}x generated tokens/s"
    )
    out = {
        "benchmark": "rl_step",
        "compare": args.compare,
        "longtail": args.longtail,
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "platform": platform.platform(),
            "processor": cpu_model(),
            "cpus": os.cpu_count(),
        },
        "steps": args.steps,
        "repeats": args.repeats,
        "summary": summary,
        f"speedup_{new}_over_{base}": ratio,
        f"wall_speedup_{new}_over_{base}": wall_ratio,
        f"gen_tok_s_ratio_{new}_over_{base}": tok_ratio,
        "runs": results,
    }
    write_results(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
