"""The orchestrator at scale: CPU time per rollout and event-loop lag with up to 4,096 groups in flight.

``asyncrl orchestrate`` runs alone (its own process, ``orchestrator.schedule=continuous``) against a stand-in
server (``tests/helpers/standin.py``, in a process of its own) that answers every request at once, so what is
measured is the orchestrator: sending requests, reading answers, scoring, advantages, packing and writing
batches, relaying weights. A stand-in trainer publishes ``weights/step_{n+1}`` as soon as ``rollouts/step_n``
appears (it trains instantly), so the in-flight relay runs too. The orchestrator's own metrics give, per
batch, its CPU seconds (``time/orchestrator_cpu_s``) and its event-loop lag p99 and max (a timer every 10 ms,
``time/loop_lag_*``). Warm-up batches are skipped. The bars: < 1 ms of CPU per rollout and lag p99 < 50 ms at
4,096 groups in flight. Rewards run in the orchestrator's env worker processes; their CPU per rollout is
reported beside the orchestrator's (``time/env_workers_cpu_s``).

``--slow-reward-every N``: one reward call in N blocks for 1 s (``time.sleep`` inside an ``async def``
reward, ``benchmarks/_blocking_env.py``); it must not move the lag p99. ``--env-workers-max 0`` runs the
rewards in the orchestrator's threads instead.

    python benchmarks/orchestrator_scale.py [--inflight 64 512 4096] [--batches 12] [--group-size 8]
                                            [--slow-reward-every N] [--env-workers-max M]
                                            [--out benchmarks/results/orchestrator_scale_cpu.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _results import pct, read_jsonl, report

ROOT = Path(__file__).resolve().parents[1]
STANDIN = """
import sys, uvicorn
sys.path.insert(0, {tests!r})
from helpers.standin import build_standin
uvicorn.run(build_standin(), host="127.0.0.1", port={port}, log_level="warning", backlog=8192)
"""


def asyncrl(*args: str, **kw) -> subprocess.CompletedProcess:
    # benchmarks/ on the path: the blocking environment's module (its env workers take the orchestrator's
    # path)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run([sys.executable, "-m", "asyncrl", *args], capture_output=True, text=True, env=env, **kw)


def stand_in_trainer(run_dir: Path, steps: int, stop: threading.Event) -> None:
    """Publish policy n + 1 as soon as batch n is written (an empty, sealed weights directory: the stand-in
    server takes any path)."""
    from asyncrl.utils.atomic import seal

    n = 0
    while n < steps and not stop.is_set():
        if (run_dir / "rollouts" / f"step_{n}" / "STABLE").exists():
            path = run_dir / "weights" / f"step_{n + 1}"
            path.mkdir(parents=True, exist_ok=True)
            seal(path)
            n += 1
        else:
            time.sleep(0.005)


def one_level(inflight: int, batches: int, group_size: int, url: str, setup: list[str], run_dir: Path) -> dict:
    # a batch is a quarter of what is in flight: the buffer refills while it packs
    per_batch = max(8, inflight // 4)
    stop = threading.Event()
    trainer = threading.Thread(target=stand_in_trainer, args=(run_dir, batches, stop), daemon=True)
    trainer.start()
    proc = asyncrl(
        "orchestrate",
        *setup,
        f"run_dir={run_dir}",
        f"inference.urls=[{url}]",
        "orchestrator.schedule=continuous",
        f"orchestrator.max_inflight={inflight}",
        # the pool's limit: below max_inflight, groups queue in it
        f"orchestrator.max_concurrency={inflight}",
        f"orchestrator.prompts_per_step={per_batch}",
        f"orchestrator.group_size={group_size}",
        "orchestrator.max_tokens=16",
        "orchestrator.drop_zero_advantage=false",  # every group counts: the batches are the same size
        f"max_steps={batches}",
        "async_level=1",
        f"trainer.keep_weights={batches + 2}",
        timeout=1200,
    )
    stop.set()
    if proc.returncode != 0:
        raise RuntimeError(f"orchestrator failed at {inflight} in flight:\n{proc.stderr[-3000:]}")
    rows = read_jsonl(run_dir / "metrics" / "orchestrator.jsonl")[2:]  # start-up, first fill
    rollouts = per_batch * group_size
    cpu_ms = [1e3 * r["time/orchestrator_cpu_s"] / rollouts for r in rows]
    worker_ms = [1e3 * r.get("time/env_workers_cpu_s", 0.0) / rollouts for r in rows]
    p99s = [r["time/loop_lag_p99_ms"] for r in rows]
    gen_s = [r["time/generate_s"] for r in rows]
    return {
        "inflight": inflight,
        "batch_groups": per_batch,
        "cpu_ms_per_rollout": round(statistics.median(cpu_ms), 4),
        "cpu_ms_per_rollout_max": round(max(cpu_ms), 4),
        "env_workers_cpu_ms_per_rollout": round(statistics.median(worker_ms), 4),
        "env_workers": max(r.get("env_workers/workers", 0) for r in rows),
        "lag_p99_ms_median": round(statistics.median(p99s), 2),
        "lag_p99_ms_max": round(max(p99s), 2),
        "lag_max_ms": round(max(r["time/loop_lag_max_ms"] for r in rows), 2),
        "rollouts_per_s": round(rollouts / statistics.median(gen_s), 1),
        "batches_measured": len(rows),
        # a loaded server taken out: none expected
        "failovers": sum(r.get("inference/failovers", 0) for r in rows),
        "retried_requests": sum(r.get("inference/retried_requests", 0) for r in rows),
        "p90_batch_s": round(pct(gen_s, 90), 3),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inflight", type=int, nargs="+", default=[64, 512, 4096])
    ap.add_argument("--batches", type=int, default=12)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--slow-reward-every", type=int, default=0, help="one reward in N blocks 1 s (0: none)")
    ap.add_argument("--env-workers-max", type=int, default=None, help="orchestrator.env_workers.max (0: threads)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "orchestrator_scale_cpu.json"))
    args = ap.parse_args()
    from asyncrl.utils.process import free_port

    port = free_port()
    code = STANDIN.format(tests=str(ROOT / "tests"), port=port)
    server = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.PIPE, text=True)
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            data, model = Path(tmp) / "data", Path(tmp) / "model"
            setup = ["experiment=reverse_text", f"data_dir={data}", f"model.name={model}"]
            prepared = asyncrl("prepare", *setup, timeout=600)
            if prepared.returncode != 0:
                raise RuntimeError(f"prepare failed:\n{prepared.stderr[-3000:]}")
            if args.slow_reward_every:
                setup += [
                    "env.reverse_text.type=_blocking_env:BlockingReverseText",
                    f"+env.reverse_text.args.every={args.slow_reward_every}",
                ]
            if args.env_workers_max is not None:
                setup += [f"orchestrator.env_workers.max={args.env_workers_max}"]
            for inflight in args.inflight:
                rows.append(
                    one_level(
                        inflight,
                        args.batches,
                        args.group_size,
                        f"http://127.0.0.1:{port}",
                        setup,
                        Path(tmp) / f"run_{inflight}",
                    )
                )
                print(rows[-1], flush=True)
    finally:
        server.terminate()
        server.wait(10)
    print(
        f"orchestrator alone against a stand-in server that answers at once; group size {args.group_size}, "
        "16 tokens per completion; medians over batches after 2 warm-up ones"
    )
    report(
        args.out,
        "inflight",
        {
            "CPU ms/rollout": "cpu_ms_per_rollout",
            "workers' CPU ms/rollout": "env_workers_cpu_ms_per_rollout",
            "lag p99 ms": "lag_p99_ms_median",
            "worst p99 ms": "lag_p99_ms_max",
            "lag max ms": "lag_max_ms",
            "rollouts/s": "rollouts_per_s",
        },
        rows,
        group_size=args.group_size,
        slow_reward_every=args.slow_reward_every,
        env_workers_max=args.env_workers_max,
        goal="cpu_ms_per_rollout < 1 and loop lag p99 < 50 ms at 4,096 groups in flight",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
