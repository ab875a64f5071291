"""The math scorer's latency and throughput: math-verify in-process, and through asyncrl's killable worker
pool (``asyncrl.rewards.math.math_reward``, what ``env=[math]`` runs), with every verdict checked.

Replies of the kinds a policy writes (a bare ``\\boxed{}``, a worked GSM8K-style solution, a LaTeX fraction
against a decimal gold, an expression restated from the question, prose without an answer, garbage), each in
a right and a wrong version where it has one. ``in-process`` calls ``verify_answer`` on one thread (the work
itself, no deadline possible); ``pool`` calls ``math_reward`` from ``--clients`` threads at once, as the
orchestrator's reward threads do (``orchestrator.reward_workers``, default 4). The pool has one worker
process per CPU.

    python benchmarks/math_reward.py [--calls 2000] [--clients 1 4 16] [--out
    benchmarks/results/math_reward_cpu.json]
"""

from __future__ import annotations

import argparse
import itertools
import logging
import sys
import threading
import time
from pathlib import Path

from _results import pct, report, run_clients

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from asyncrl.rewards.math import math_reward, verify_answer  # noqa: E402

WORKED = (
    "Natalia sold {a} clips in April. In May she sold {b} clips more. Altogether she sold "
    "{a} + {a} + {b} = {c} clips in April and May. So the answer is \\boxed{{{c}}}."
)


def case(k: int) -> tuple[str, str, str, float]:
    """The ``k``-th (question, gold, reply, expected score): numbers vary with ``k``, so that no parse is
    served from a cache (math-verify and sympy keep some)."""
    n = 100 + k
    half = repr(n / 2)
    cases = [
        (f"Calculate {n} + 17.", str(n + 17), f"\\boxed{{{n + 17}}}", 1.0),
        (f"Calculate {n} + 17.", str(n + 17), f"\\boxed{{{n + 16}}}", 0.0),
        ("How many clips altogether?", str(3 * n), WORKED.format(a=n, b=n, c=3 * n), 1.0),
        ("How many clips altogether?", str(3 * n), WORKED.format(a=n, b=n, c=3 * n + 2), 0.0),
        (f"What is {n}/2?", half, f"It is $\\frac{{{n}}}{{2}}$, so \\boxed{{\\frac{{{n}}}{{2}}}}", 1.0),
        (f"What is {n}/2?", half, f"\\boxed{{\\frac{{{n}}}{{3}}}}", 0.0),
        (f"Calculate {n} - 58.", str(n - 58), f"{n} - 58 = {n} - 58.", 0.0),  # restated: no answer
        (
            f"Calculate {n} - 58.",
            str(n - 58),
            "Let me think about subtraction and what it means for two numbers.",
            0.0,
        ),
        (f"Calculate {n} - 58.", str(n - 58), f"))((\\frac{{}}{{}}\x00 {n} \\boxed{{\\boxed{{}}}}", 0.0),
    ]
    return cases[k % len(cases)]


_FRESH = itertools.count(0, 100_000)  # every phase draws numbers no earlier phase used


def measure(fn, calls: int, clients: int) -> dict:
    latencies: list[float] = []
    wrong = 0
    lock = threading.Lock()
    first = next(_FRESH)
    counter = iter(range(first, first + calls))

    def client() -> None:
        nonlocal wrong
        for k in counter:
            question, gold, reply, expected = case(k)
            start = time.perf_counter()
            score = fn(gold, reply, question)
            elapsed = time.perf_counter() - start
            with lock:
                latencies.append(elapsed)
                wrong += score != expected

    wall = run_clients(clients, client)
    ms = [x * 1e3 for x in latencies]
    return {
        "clients": clients,
        "calls": len(ms),
        "p50_ms": round(pct(ms, 50), 3),
        "p99_ms": round(pct(ms, 99), 3),
        "scores_per_s": round(len(ms) / wall, 1),
        "wrong_verdicts": wrong,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--out", default="benchmarks/results/math_reward_cpu.json")
    args = ap.parse_args()
    # "timeouts are off": on purpose (rewards/killable.py)
    logging.getLogger("math_verify").setLevel(logging.ERROR)

    def pool(gold: str, reply: str, question: str) -> float:
        return math_reward(gold, reply, 5.0, question)

    rows = []
    measure(verify_answer, 100, 1)  # warm-up: sympy's and math-verify's first calls
    rows.append({"path": "in-process", **measure(verify_answer, args.calls, 1)})
    measure(pool, 200, max(args.clients))  # warm-up: start the worker processes and their imports
    for clients in args.clients:
        rows.append({"path": "pool", **measure(pool, args.calls, clients)})
    columns = {"clients": "clients", "calls": "calls", "p50 ms": "p50_ms", "p99 ms": "p99_ms"}
    columns |= {"scores/s": "scores_per_s", "wrong": "wrong_verdicts"}
    report(args.out, "path", columns, rows)


if __name__ == "__main__":
    main()
