"""reasoning-gym's tasks: generation (seeded, at ``asyncrl prepare``) and its own scorers."""

from __future__ import annotations

import json
import re
from typing import Any

from asyncrl.rewards import killable

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(completion: str) -> str:
    """The last ``<answer>...</answer>`` of a completion (reasoning-gym's format), else the whole reply."""
    found = _ANSWER.findall(completion)
    return (found[-1] if found else completion).strip()


def generate(task: str, config: dict[str, Any], seed: int, size: int) -> list[dict[str, Any]]:
    """``size`` entries of ``task`` (``config``: its dataset config's fields), as JSON-able rows."""
    # lazy: on use: seconds to import, and only `prepare` and the scoring workers need it
    import reasoning_gym

    dataset = reasoning_gym.create_dataset(task, seed=seed, size=size, **config)
    rows = []
    for entry in dataset:
        # tuples -> lists, as they will be read back
        meta = json.loads(json.dumps(entry["metadata"], default=str))
        rows.append(
            {
                "task": meta.get("source_dataset", task),
                "question": entry["question"],
                "answer": entry["answer"],
                "metadata": meta,
            }
        )
    return rows


def score(task: str, completion: str, entry: dict[str, Any]) -> float:
    """reasoning-gym's ``score_answer`` of ``task`` on the completion's answer."""
    from reasoning_gym import get_score_answer_fn  # lazy: on use: runs in a scoring worker (see generate)

    return float(get_score_answer_fn(task)(extract_answer(completion), entry))


def reasoning_gym_reward(task: str, completion: str, entry: dict[str, Any], timeout_s: float = 5.0) -> float:
    """:func:`score` in a worker process, killed past ``timeout_s`` (some scorers evaluate expressions)."""
    return killable.call(score, task, completion, entry, timeout_s=timeout_s)
