"""What the question-and-answer environments share (``reasoning_gym``, ``math``, ``code``): the prompt (a
question as the user message), seeds for the libraries that generate their data, the held-out split, and
reading records from a file or a hub dataset."""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path
from typing import Any

from asyncrl.envs.base import Environment


def seed_for(seed: int, *parts: str) -> int:
    """A 31-bit seed for a library that takes an int, derived from the run's seed and names."""
    return zlib.crc32(":".join([str(seed), *parts]).encode()) & 0x7FFFFFFF


def split_rows(rows: list[dict[str, Any]], num_eval: int, seed: int, name: str, key: str) -> dict[str, list]:
    """Held-out eval rows first (a seeded shuffle), then train rows whose ``key`` is not among them."""
    order = list(range(len(rows)))
    random.Random(f"{seed}:{name}:split").shuffle(order)
    held = [rows[i] for i in order[:num_eval]]
    seen = {r[key] for r in held}
    train = [rows[i] for i in order[num_eval:] if rows[i][key] not in seen]
    return {"eval": held, "train": train}


class Prompted(Environment):
    """The shared part: a question as the user message (after an optional system message), an answer as
    SFT."""

    def prompt(self, example: dict[str, Any]) -> list[dict[str, str]]:
        system = self.args.system_prompt
        return ([{"role": "system", "content": system}] if system else []) + [
            {"role": "user", "content": example["question"]}
        ]


def load_records(source: str, source_args: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of ``file:<path>`` (JSONL, or a JSON list) or ``hub:<dataset>`` (the ``datasets`` library,
    with ``source_args`` as ``load_dataset``'s keywords: ``{name: main, split: train}`` for GSM8K)."""
    kind, _, where = source.partition(":")
    if kind == "file":
        text = Path(where).read_text()
        if where.endswith(".json"):
            return list(json.loads(text))
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    if kind == "hub":
        try:
            import datasets  # optional (the `hub` extra): not installed offline
        except ImportError:
            raise ValueError(
                f"source={source!r} needs the `datasets` library: pip install 'asyncrl[hub]'"
            ) from None
        return [dict(row) for row in datasets.load_dataset(where, **source_args)]
    raise ValueError(f"source={source!r}: expected reasoning_gym:<task>, file:<path> or hub:<dataset>")
