"""What ``numerics=reproducible`` costs against ``numerics=fast``, side by side in one run, on this CPU.

Three workloads of the reverse_text experiment (the embedded default), each run in both modes, alternating
the modes for ``--repeats`` rounds so machine noise hits both alike:
- SFT: ``asyncrl sft``, steps per second (median gap between consecutive steps after 5 warm-up steps);
- RL: ``asyncrl rl`` (8 prompts x 8 samples), seconds per step, and its generate and train medians;
- sidecar: ``asyncrl serve`` alone, completion tokens per second for 8 concurrent chat requests of 8
  samples x 24 tokens (the orchestrator's own client), after one warm-up round.
Prints a table and writes JSON. Needs the models `make run` builds (``--tiny``, ``--sft``).

    python benchmarks/numerics.py --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import median_gap, read_jsonl, write_results

MODES = ("reproducible", "fast")
BASE = ["experiment=reverse_text"]


def asyncrl(command: str, *overrides: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "asyncrl", command, *BASE, *overrides], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"asyncrl {command} {' '.join(overrides)} failed:\n{proc.stderr[-3000:]}")


def sft(mode: str, model: str, steps: int, tmp: Path) -> dict:
    run = tmp / f"sft_{mode}_{time.monotonic_ns()}"
    asyncrl("sft", f"numerics={mode}", f"model.name={model}", f"sft.run_dir={run}", f"sft.max_steps={steps}")
    rows = read_jsonl(run / "metrics" / "sft.jsonl")[5:]
    return {"sft_steps_per_s": 1 / median_gap([r["time"] for r in rows])}


def rl(mode: str, model: str, steps: int, tmp: Path) -> dict:
    run = tmp / f"rl_{mode}_{time.monotonic_ns()}"
    asyncrl(
        "rl",
        f"numerics={mode}",
        f"model.name={model}",
        f"run_dir={run}",
        f"max_steps={steps}",
        "launcher.progress=false",
    )
    train, orch = (read_jsonl(run / "metrics" / f"{p}.jsonl")[5:] for p in ("trainer", "orchestrator"))
    return {
        "rl_s_per_step": median_gap([r["time"] for r in train]),
        "rl_generate_s": statistics.median(r["time/generate_s"] for r in orch),
        "rl_train_s": statistics.median(r["time/train_s"] for r in train),
    }


def sidecar(mode: str, model: str, rounds: int, tmp: Path) -> dict:
    from asyncrl.config.compose import compose_config
    from asyncrl.envs import build_envs
    from asyncrl.rollouts.client import InferencePool
    from asyncrl.utils.children import spawn, stop, wait_healthy
    from asyncrl.utils.process import free_port

    cfg = compose_config([*BASE, f"model.name={model}"])
    env = next(iter(build_envs(cfg.env, cfg.data_dir).values()))
    prompts = [env.prompt(x) for x in env.load("eval")[:8]]
    port = free_port()
    proc = spawn(
        "sidecar",
        [
            sys.executable,
            "-m",
            "asyncrl",
            "serve",
            *BASE,
            f"numerics={mode}",
            f"model.name={model}",
            f"inference.port={port}",
        ],
        tmp / f"sidecar_{mode}.log",
    )
    url = f"http://127.0.0.1:{port}"

    async def measure() -> float:
        pool = InferencePool([url], model, 600, 64)
        rates = []
        try:
            for r in range(rounds + 1):
                t = time.perf_counter()
                outs = await asyncio.gather(
                    *(pool.chat(p, 8, 1.0, 1.0, 24, seed=1000 * r + i) for i, p in enumerate(prompts))
                )
                dt = time.perf_counter() - t
                if r:  # round 0 warms up
                    rates.append(sum(len(c.token_ids) for o in outs for c in o.choices) / dt)
        finally:
            await pool.close()
        return statistics.median(rates)

    try:
        wait_healthy(proc, url, timeout_s=180)
        return {"sidecar_tok_per_s": asyncio.run(measure())}
    finally:
        stop([proc], 10)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", default="outputs/models/tiny", help="the random-init model SFT starts from")
    ap.add_argument("--sft", default="outputs/reverse_text/sft/model", help="the SFT model RL and the sidecar use")
    ap.add_argument("--sft-steps", type=int, default=40)
    ap.add_argument("--rl-steps", type=int, default=30)
    ap.add_argument("--sidecar-rounds", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/numerics_cpu.json")
    args = ap.parse_args()
    for path in (args.tiny, args.sft):
        if not (Path(path) / "config.json").exists():
            sys.exit(f"error: no model at {path}; run `make run` first (it builds both)")
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for r in range(args.repeats):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                runs[mode].append(
                    {
                        **sft(mode, args.tiny, args.sft_steps, tmp),
                        **rl(mode, args.sft, args.rl_steps, tmp),
                        **sidecar(mode, args.sft, args.sidecar_rounds, tmp),
                    }
                )
                print(f"round {r} {mode}: {runs[mode][-1]}", flush=True)
    summary = {m: {k: statistics.median(run[k] for run in rs) for k in rs[0]} for m, rs in runs.items()}
    rep, fast = summary["reproducible"], summary["fast"]
    # cost = how many times longer reproducible takes (>1 is slower)
    cost = {
        "sft": fast["sft_steps_per_s"] / rep["sft_steps_per_s"],
        "rl": rep["rl_s_per_step"] / fast["rl_s_per_step"],
        "sidecar": fast["sidecar_tok_per_s"] / rep["sidecar_tok_per_s"],
    }
    print(f"numerics=reproducible vs fast, reverse_text, {args.repeats} interleaved repeats (medians)")
    print(
        f"{'mode':>13} {'SFT steps/s':>12} {'RL s/step':>10} {'RL gen s':>9} {'RL train s':>11} {'sidecar tok/s':>14}"
    )
    for m in MODES:
        s = summary[m]
        print(
            f"{m:>13} {s['sft_steps_per_s']:>12.2f} {s['rl_s_per_step']:>10.3f} {s['rl_generate_s']:>9.3f} "
            f"{s['rl_train_s']:>11.3f} {s['sidecar_tok_per_s']:>14.0f}"
        )
    print("cost of reproducible (time ratio): " + ", ".join(f"{k} {v:.2f}x" for k, v in cost.items()))
    from asyncrl.numerics import cpu_info

    cpu = cpu_info()
    out = {
        "benchmark": "numerics",
        "command": " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%d"),
        "machine": {
            "cpu": cpu["model"],
            "vendor": cpu["vendor"],
            "isa": [f for f in ("avx2", "avx512f", "amx_tile") if f in cpu["flags"]],
            "cpus": __import__("os").cpu_count(),
            "platform": platform.platform(),
        },
        "repeats": args.repeats,
        "summary": summary,
        "cost_reproducible_over_fast": cost,
        "runs": runs,
    }
    write_results(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
