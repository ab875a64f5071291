"""How often an agent's eval episodes called a tool: one line per eval dir and mode (greedy, sampled).

    python experiments/tool_use.py outputs/agent_adder/eval_sft outputs/agent_adder/eval_rl

Reads each dir's ``samples.jsonl`` (``asyncrl eval``). An episode called a tool when an assistant message of
its transcript carries ``tool_calls`` (the sidecar read a well-formed call back); ``reward_with_tool`` is the
share of episodes that called one and scored 1, so a model that answers right without the tool is told apart.
For tasks whose numbers the call should copy (the adder agents), the episodes that scored 0 are split by
cause: ``no_call``, ``copy`` (the first call's integer arguments are not the prompt's numbers), ``answer`` (a
right call, then a wrong answer)."""

from __future__ import annotations

import json
import re
import sys
from collections import Counter, defaultdict
from pathlib import Path


def called_tool(sample: dict) -> bool:
    return any(m.get("role") == "assistant" and m.get("tool_calls") for m in sample.get("transcript") or [])


def cause(sample: dict) -> str:
    """Why an episode that scored 0 failed (see the module doc)."""
    calls = [
        m["tool_calls"]
        for m in sample.get("transcript") or []
        if m.get("role") == "assistant" and m.get("tool_calls")
    ]
    if not calls:
        return "no_call"
    arguments = json.loads(calls[0][0]["function"]["arguments"] or "{}")
    numbers = [int(n) for n in re.findall(r"\d+", sample["prompt"])]
    return "answer" if list(arguments.values()) == numbers else "copy"


def summary(eval_dir: Path) -> list[str]:
    by_mode: dict[str, list[dict]] = defaultdict(list)
    with (eval_dir / "samples.jsonl").open() as f:
        for line in f:
            sample = json.loads(line)
            by_mode[sample["mode"]].append(sample)
    lines = []
    for mode, samples in sorted(by_mode.items()):
        n = len(samples)
        called = [called_tool(s) for s in samples]
        reward = sum(s["reward"] for s in samples) / n
        with_tool = sum(s["reward"] >= 1.0 and c for s, c in zip(samples, called, strict=True)) / n
        errors = sum(s.get("stop") != "done" for s in samples)  # the agent raised or timed out
        causes = Counter(cause(s) for s in samples if s["reward"] < 1.0 and s.get("stop") == "done")
        lines.append(
            f"{eval_dir.name} {mode} n {n} reward {reward:.3f} called_tool {sum(called) / n:.3f} "
            f"reward_with_tool {with_tool:.3f} errors {errors} failed_by "
            + " ".join(f"{k} {v}" for k, v in sorted(causes.items()))
        )
    return lines


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    for arg in sys.argv[1:]:
        print("\n".join(summary(Path(arg))))
