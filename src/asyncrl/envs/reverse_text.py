"""``reverse_text``: reverse a short text; reward = longest-common-subsequence ratio in [0, 1].

PRIME-RL's reference task, with generated data: random lowercase pseudo-words, so nothing is downloaded.
The LCS is exact and bit-parallel (Hyyrö 2004): scoring stays cheap on the orchestrator's event loop.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

from asyncrl.config.fields import F
from asyncrl.envs.base import Environment


def lcs_length(a: str, b: str) -> int:
    """Length of the longest common subsequence of ``a`` and ``b`` (bit-vector algorithm, O(len(b)) big-int
    ops)."""
    if not a or not b:
        return 0
    masks: dict[str, int] = {}
    for i, ch in enumerate(a):
        masks[ch] = masks.get(ch, 0) | (1 << i)
    full = (1 << len(a)) - 1
    v = full
    for ch in b:
        u = v & masks.get(ch, 0)
        v = ((v + u) | (v - u)) & full
    return len(a) - bin(v).count("1")


def lcs_ratio(prediction: str, target: str) -> float:
    """``2 * LCS / (len(prediction) + len(target))``: 1 for an exact match, 0 when nothing is shared."""
    total = len(prediction) + len(target)
    return 1.0 if total == 0 else 2.0 * lcs_length(prediction, target) / total


class ReverseText(Environment):
    @dataclass
    class Args:
        min_len: int = F(8, "shortest text, in characters", ge=1)
        max_len: int = F(16, "longest text, in characters", ge=1)
        num_train: int = F(20000, "training examples (RL prompts and SFT targets)", ge=1)
        num_eval: int = F(200, "held-out evaluation examples", ge=1)
        max_word_len: int = F(7, "longest pseudo-word", ge=1)
        system_prompt: str | None = F(None, "system message; null = none (a char-level model needs none)")

    def check_args(self, args) -> list[str]:
        if args.min_len > args.max_len:
            return [f"min_len={args.min_len} > max_len={args.max_len}: min_len must not exceed max_len"]
        return []

    def generate(self, split: str, seed: int) -> list[dict[str, Any]]:
        # One stream for both splits so eval texts are disjoint from train texts.
        rng = random.Random(f"{seed}:{self.name}")
        want = {"train": self.args.num_train, "eval": self.args.num_eval}
        seen: set[str] = set()
        out: dict[str, list[dict[str, Any]]] = {"train": [], "eval": []}
        for name in ("eval", "train"):
            attempts = 0
            while len(out[name]) < want[name]:
                attempts += 1
                if attempts > 50 * want[name]:
                    raise ValueError(
                        f"env.{self.name}: cannot draw {want[name]} distinct texts of "
                        f"{self.args.min_len}-{self.args.max_len} characters"
                    )
                text = self._text(rng)
                if text not in seen:
                    seen.add(text)
                    out[name].append({"id": f"{name}-{len(out[name])}", "text": text})
        return out[split]

    def _text(self, rng: random.Random) -> str:
        length = rng.randint(self.args.min_len, self.args.max_len)
        words: list[str] = []
        while sum(map(len, words)) + max(len(words) - 1, 0) < length:
            words.append(
                "".join(
                    rng.choice("abcdefghijklmnopqrstuvwxyz")
                    for _ in range(rng.randint(1, self.args.max_word_len))
                )
            )
        return " ".join(words)[:length].strip().ljust(length, rng.choice("abcdefghijklmnopqrstuvwxyz"))

    def prompt(self, example: dict[str, Any]) -> list[dict[str, str]]:
        messages = (
            [{"role": "system", "content": self.args.system_prompt}] if self.args.system_prompt else []
        )
        return messages + [{"role": "user", "content": example["text"]}]

    def reward(self, example: dict[str, Any], completion: str) -> float:
        return lcs_ratio(completion.strip(), example["text"][::-1])

    def answer(self, example: dict[str, Any]) -> str:
        return example["text"][::-1]
