"""An arithmetic task where the agent has one tool, ``add``, and the same agent written with each framework:
``with_openai_agents`` (the OpenAI Agents SDK) and ``with_pydantic_ai``. Each module's
``agent(task, endpoint)`` is what ``env.<name>.args.agent`` names; :func:`tasks` and :func:`reward` are
shared (docs/agents.md)."""

from __future__ import annotations

import json
import random
import re

INSTRUCTIONS = "Answer the sum. Call the add tool to compute it, then reply with the number."


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def tasks(split: str, seed: int) -> list[dict]:
    """Sums of two numbers below 100: 2,000 training rows and 50 held-out ones, distinct pairs, none in
    both."""
    return _sums(split, seed, 0, 100)


def five_digit_tasks(split: str, seed: int) -> list[dict]:
    """Sums of two five-digit numbers, split as :func:`tasks`: too long for a small model to add by itself,
    so its reward needs the tool (a 135M model learns two-digit sums without it)."""
    return _sums(split, seed, 10_000, 100_000)


def _sums(split: str, seed: int, low: int, high: int) -> list[dict]:
    width = high - low
    pairs = random.Random(f"{seed}:pairs:{low}:{high}").sample(range(width * width), 2050)
    chosen = pairs[:2000] if split == "train" else pairs[2000:]
    rows = []
    for a, b in ((low + p // width, low + p % width) for p in chosen):
        rows.append({"prompt": f"What is {a} plus {b}?", "a": a, "b": b, "answer": a + b})
    return rows


def demonstration_with(task: dict, tools: list[dict]) -> dict:
    """A reference episode as an agent sends it (``env.<name>.args.demonstration``, for SFT): the
    instructions, the task, a call of ``add``, its result, the answer; ``tools`` as the agent's framework
    offers them."""
    arguments = json.dumps({"a": task["a"], "b": task["b"]}, separators=(",", ":"))
    call = {"id": "call_0", "type": "function", "function": {"name": "add", "arguments": arguments}}
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": task["prompt"]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": str(task["answer"])},
        {"role": "assistant", "content": str(task["answer"])},
    ]
    return {"messages": messages, "tools": tools}


def reward(task: dict, outcome: object) -> float:
    """1 if the agent's final answer's last number is the sum."""
    numbers = re.findall(r"-?\d+", str(outcome))
    return float(bool(numbers) and int(numbers[-1]) == task["answer"])
