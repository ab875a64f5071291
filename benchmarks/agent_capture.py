"""What recording an agent's calls costs on the CPU sidecar, and the orchestrator's event loop with many
agents in flight.

``capture`` (the default): ``asyncrl serve`` on a micro model, then rounds of ``--calls`` sequential chat
calls of one token each, on two arms interleaved within each round: the plain chat route, sent exactly the
body the rollout route turns an agent's call into (served model, token ids, compact logprobs, the same seed),
and a rollout's own route (``/rollouts/KEY/v1/chat/completions``) sent the agent's body. The difference is
what the recording adds: the request's rewrite, the answer's parse, the record. Reports the sidecar server
process's CPU per call (from ``/proc``; the engine runs in a process of its own, the same work on both arms)
and the wall time per call, each arm's median and spread over ``--repeats`` rounds, and the per-round
difference. Goal: < 1 ms of CPU per call.

``in-flight``: ``--agents`` agent episodes at once (two calls each, through the rollout routes) from env
worker processes, as the orchestrator runs them, while a 5 ms timer on the orchestrator's event loop measures
how late it fires. Reports the loop lag p50/p99/max and the episodes' wall time. Goal: p99 < 50 ms at 256
agents.

``sandbox``: what running a command-line agent in the sandbox (``args.sandbox``) adds to an episode: rounds
of ``--episodes`` episodes one after another on two arms interleaved, the same standard-library agent (two
calls) run as a process of the env worker and in a sandbox, whose calls go through the proxy. Reports the
wall time per episode, each arm's median and spread over ``--repeats`` rounds, and the per-round difference.

    python benchmarks/agent_capture.py [--mode capture|in-flight|sandbox] [--calls 300] [--repeats 5]
                                       [--agents 256] [--episodes 40]
                                       [--out benchmarks/results/agent_capture_cpu.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from _results import pct, report

ROOT = Path(__file__).resolve().parents[1]
PROMPT = [{"role": "user", "content": "reverse abc"}]


# -- the agent the in-flight mode runs (env workers import it as agent_capture:...)
# -------------------------------
def tasks(split: str, seed: int) -> list[dict]:
    return [{"prompt": f"reverse {w}"} for w in ("abc", "cab", "bca", "ab")]


async def agent(task: dict, endpoint) -> str:
    async with httpx.AsyncClient(base_url=endpoint.base_url, timeout=300) as client:
        messages = [{"role": "user", "content": task["prompt"]}]
        for _ in range(2):
            r = await client.post("/chat/completions", json={"model": "any", "messages": messages, "max_tokens": 4})
            messages += [r.json()["choices"][0]["message"], {"role": "user", "content": "again"}]
    return messages[-2]["content"]


def reward(task: dict, outcome: str) -> float:
    return float(len(outcome) > 0)


# -- serving
# ---------------------------------------------------------------------------------------------------
def cpu_seconds(pid: int) -> float:
    """The CPU time of ``pid``'s threads, to the nanosecond (``/proc/PID/task/*/schedstat``;
    ``/proc/PID/stat`` counts in 10 ms ticks, coarser than a call)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that ended meanwhile
            continue
    return total / 1e9


def serve(root: Path) -> tuple[subprocess.Popen, str, str]:
    """``asyncrl serve`` on a micro model built in ``root``: (process, url, served model name)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from asyncrl.config.compose import compose_config
    from asyncrl.models.hf import build_tiny_model
    from asyncrl.utils.process import free_port
    from helpers.launch import MICRO_MODEL

    model = root / "model"
    build_tiny_model(compose_config(MICRO_MODEL).model.init, model, seed=0)
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "asyncrl",
        "serve",
        f"model.name={model}",
        f"inference.port={port}",
        *MICRO_MODEL,
    ]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=open(root / "serve.log", "w"))
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url, str(model)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the sidecar did not start: {root / 'serve.log'}")


def capture_round(client: httpx.Client, url: str, pid: int, model: str, calls: int) -> dict[str, dict[str, float]]:
    opened = client.post(f"{url}/rollouts", json={}).json()
    plain = {"model": model, "messages": PROMPT, "max_tokens": 1, "seed": 1, "return_token_ids": True,
             "logprobs": True, "logprobs_encoding": "base64"}  # fmt: skip
    arms = {
        "plain": (f"{url}/v1/chat/completions", plain),
        "rollout": (
            f"{url}{opened['base_url']}/chat/completions",
            {"model": "gpt-4o", "messages": PROMPT, "max_tokens": 1, "seed": 1},
        ),  # fmt: skip
    }
    out: dict[str, dict[str, float]] = {name: {"cpu_s": 0.0, "wall_s": 0.0} for name in arms}
    for i in range(calls):  # interleaved call by call
        for name, (target, body) in arms.items() if i % 2 else reversed(arms.items()):
            cpu, wall = cpu_seconds(pid), time.perf_counter()
            client.post(target, json=body).raise_for_status()
            out[name]["wall_s"] += time.perf_counter() - wall
            out[name]["cpu_s"] += cpu_seconds(pid) - cpu
    recorded = client.delete(f"{url}/rollouts/{opened['id']}").json()["calls"]
    assert len(recorded) == calls, len(recorded)
    return {name: {k: v / calls * 1e3 for k, v in t.items()} for name, t in out.items()}  # ms per call


def capture(args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        proc, url, model = serve(Path(tmp))
        try:
            with httpx.Client(timeout=120) as client:
                capture_round(client, url, proc.pid, model, 20)  # warm-up
                rounds = [capture_round(client, url, proc.pid, model, args.calls) for _ in range(args.repeats)]
        finally:
            proc.terminate()
            proc.wait(30)
    rows = []
    for key in ("cpu_s", "wall_s"):
        plain, rollout = [r["plain"][key] for r in rounds], [r["rollout"][key] for r in rounds]
        diff = [b - a for a, b in zip(plain, rollout, strict=True)]
        rows.append(
            {
                "figure": f"sidecar {key[:-2]} ms/call",
                "plain": spread(plain),
                "rollout": spread(rollout),
                "added": spread(diff),
            }
        )
    report(
        args.out,
        "figure",
        {"plain route": "plain", "rollout route": "rollout", "added by recording": "added"},
        rows,
        mode="capture",
        calls=args.calls,
        repeats=args.repeats,
        rounds=rounds,
    )


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


# -- in flight
# -------------------------------------------------------------------------------------------------
async def in_flight_run(url: str, model: str, agents: int, root: Path) -> dict:
    from asyncrl.config.orchestrator import EnvSpec
    from asyncrl.envs.agent import Agent
    from asyncrl.rollouts.client import InferencePool
    from asyncrl.rollouts.context import RolloutContext, Sampling
    from asyncrl.workers.pool import EnvWorkers
    from asyncrl.workers.scoring import Scorer

    spec = {"agent": "agent_capture:agent", "tasks": "agent_capture:tasks", "reward": "agent_capture:reward"}
    env = Agent("bench", root, spec)
    pool = InferencePool([url], model, 600, agents)
    runner = EnvWorkers({"bench": EnvSpec(type="agent", args=spec)}, root, 2, 2, 4)
    scorer = Scorer(runner, 60)
    ctx = RolloutContext(pool, scorer, Sampling(1.0, 1.0, 4), model, model)
    rows = env.generate("train", 0)
    # workers up, warm
    await asyncio.gather(*(env.rollouts(ctx, rows[i % len(rows)], 1, i) for i in range(8)))
    lateness: list[float] = []
    done = asyncio.Event()

    async def meter() -> None:
        while not done.is_set():
            start = time.monotonic()
            await asyncio.sleep(0.005)
            lateness.append((time.monotonic() - start - 0.005) * 1e3)

    timer = asyncio.create_task(meter())
    start = time.perf_counter()
    episodes = await asyncio.gather(*(env.rollouts(ctx, rows[i % len(rows)], 1, i) for i in range(agents)))
    wall = time.perf_counter() - start
    done.set()
    await timer
    counts = scorer.take_counts()
    await scorer.close()
    await pool.close()
    turns = [r.info.get("turns", 0) for (r,) in episodes]
    return {"lag_p50_ms": pct(lateness, 50), "lag_p99_ms": pct(lateness, 99), "lag_max_ms": max(lateness),
            "wall_s": wall, "calls": sum(turns), "counts": counts}  # fmt: skip


def in_flight(args) -> None:
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")]))
    with tempfile.TemporaryDirectory() as tmp:
        proc, url, model = serve(Path(tmp))
        try:
            runs = [asyncio.run(in_flight_run(url, model, args.agents, Path(tmp))) for _ in range(args.repeats)]
        finally:
            proc.terminate()
            proc.wait(30)
    rows = [
        {"figure": k, "value": spread([r[k] for r in runs])}
        for k in ("lag_p50_ms", "lag_p99_ms", "lag_max_ms", "wall_s")
    ]
    report(args.out, "figure", {f"{args.agents} agents in flight": "value"}, rows, mode="in-flight",
           agents=args.agents, repeats=args.repeats, runs=runs)  # fmt: skip


# -- in a sandbox
# ---------------------------------------------------------------------------------------------
COMMAND_AGENT = """import json, os, urllib.request
base = os.environ["OPENAI_BASE_URL"]
messages = [{"role": "user", "content": json.loads(os.environ["ASYNCRL_TASK"])["prompt"]}]
for _ in range(2):
    body = json.dumps({"model": "any", "messages": messages, "max_tokens": 4}).encode()
    request = urllib.request.Request(base + "/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        messages += [json.load(r)["choices"][0]["message"], {"role": "user", "content": "again"}]
print(messages[-2]["content"])
"""


async def sandbox_round(url: str, model: str, episodes: int, root: Path, script: Path) -> dict[str, float]:
    from asyncrl.envs.agent import Agent
    from asyncrl.rollouts.client import InferencePool
    from asyncrl.rollouts.context import RolloutContext, Sampling
    from asyncrl.workers.scoring import Scorer
    from asyncrl.workers.threads import Threads

    base = {"command": f"python3 {script}", "tasks": "agent_capture:tasks", "reward": "agent_capture:reward"}
    envs = {
        "process": Agent("bench", root, base),
        "sandbox": Agent("bench", root, {**base, "sandbox": True, "sandbox_paths": [str(script.parent)]}),
    }
    pool = InferencePool([url], model, 600, 4)
    scorer = Scorer(Threads(2), 60)
    ctx = RolloutContext(pool, scorer, Sampling(1.0, 1.0, 4), model, model)
    row = envs["process"].generate("train", 0)[0]
    wall = dict.fromkeys(envs, 0.0)
    for i in range(episodes):  # interleaved episode by episode
        for name, env in envs.items() if i % 2 else reversed(envs.items()):
            start = time.perf_counter()
            (episode,) = await env.rollouts(ctx, row, 1, i)
            wall[name] += time.perf_counter() - start
            assert episode.info["stop"] == "done" and episode.info["turns"] == 2, episode.info
    await scorer.close()
    await pool.close()
    return {name: t / episodes * 1e3 for name, t in wall.items()}  # ms per episode


def sandbox(args) -> None:
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "benchmarks"), os.environ.get("PYTHONPATH")]))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    with tempfile.TemporaryDirectory() as tmp:
        shared = Path(tempfile.mkdtemp(prefix="asyncrl-bench-agent-"))  # readable by the sandbox's user
        shared.chmod(0o755)
        script = shared / "agent.py"
        script.write_text(COMMAND_AGENT)
        script.chmod(0o644)
        proc, url, model = serve(Path(tmp))
        try:
            asyncio.run(sandbox_round(url, model, 4, Path(tmp), script))  # warm-up
            rounds = [
                asyncio.run(sandbox_round(url, model, args.episodes, Path(tmp), script)) for _ in range(args.repeats)
            ]
        finally:
            proc.terminate()
            proc.wait(30)
            script.unlink()
            shared.rmdir()
    process, boxed = [r["process"] for r in rounds], [r["sandbox"] for r in rounds]
    diff = [b - a for a, b in zip(process, boxed, strict=True)]
    rows = [{"figure": "episode wall ms (2 calls)", "process": spread(process), "sandbox": spread(boxed),
             "added": spread(diff)}]  # fmt: skip
    report(
        args.out,
        "figure",
        {"in the env worker": "process", "in a sandbox": "sandbox", "added": "added"},
        rows,
        mode="sandbox",
        episodes=args.episodes,
        repeats=args.repeats,
        rounds=rounds,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("capture", "in-flight", "sandbox"), default="capture")
    p.add_argument("--calls", type=int, default=300, help="calls per arm per round (capture)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--agents", type=int, default=256, help="agents at once (in-flight)")
    p.add_argument("--episodes", type=int, default=40, help="episodes per arm per round (sandbox)")
    p.add_argument("--out", default=None, help="JSON results (default benchmarks/results/agent_<mode>_cpu.json)")
    args = p.parse_args()
    args.out = args.out or str(ROOT / "benchmarks" / "results" / f"agent_{args.mode.replace('-', '_')}_cpu.json")
    {"capture": capture, "in-flight": in_flight, "sandbox": sandbox}[args.mode](args)


if __name__ == "__main__":
    main()
