"""What an episode produces, whatever environment ran it: the one trajectory type of asyncrl.

A :class:`Rollout` is one episode of one prompt: its reward and one or more :class:`Branch` es of token ids.
A single-turn completion is one branch (prompt, completion, every completion token sampled). A multi-turn
episode is the token stream of the whole conversation, where the tokens the environment or a tool wrote
between the model's turns are context (``completion_mask`` False: never trained on). Packing, advantages,
filtering and the trainer see only these, so they do not care which kind of environment produced them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.rollouts.metrics import mean


@dataclass
class Branch:
    """One token stream to train on: ``prompt_ids`` (up to the first sampled token), then the rest."""

    prompt_ids: list[int]
    completion_ids: list[int]
    # the sidecar's logprob of each sampled token; 0 where the mask is False
    completion_logprobs: list[float]
    completion_mask: list[bool]  # True: sampled by the policy (trained); False: written by the environment
    # online distillation: the teacher's logprob of each completion token
    teacher_logprobs: list[float] | None = None
    # a mixture of experts: the experts the sampler routed each token it read to, int16 [tokens, MoE layers,
    # top_k] from the first prompt token (the last token, never read, has none; multi-turn streams carry
    # none)
    routed_experts: np.ndarray | None = None


@dataclass
class Rollout:
    branches: list[Branch]
    reward: float
    text: str  # the model's last reply (samples.jsonl, eval)
    finish_reason: str
    info: dict[str, Any] = field(default_factory=dict)  # turns, errors, metrics...

    @property
    def completion_tokens(self) -> int:
        """Tokens the policy sampled in this episode."""
        return sum(sum(b.completion_mask) for b in self.branches)


def lost_episode() -> Rollout:
    """An episode run elsewhere that never came back (past its deadline, or its worker died on every attempt,
    as the scorer counts): it scores 0 and has nothing to train on."""
    return Rollout([], 0.0, "", "stop", {"turns": 0, "errors": ["the episode was lost"], "metrics": {}})


# what an episode's ``info`` adds to its line in a samples file (when the environment reports it): its model
# turns, why it stopped, its errors, its reward functions' scores, and every message of a multi-turn episode
EPISODE_FIELDS = ("turns", "stop", "errors", "metrics", "transcript")


def episode_fields(rollout: Rollout) -> dict[str, Any]:
    """The :data:`EPISODE_FIELDS` an episode reports (empty ones left out), for samples files and tables."""
    return {k: rollout.info[k] for k in EPISODE_FIELDS if rollout.info.get(k) not in (None, [], {})}


def mean_by_name(records: Iterable[dict[str, float | None]]) -> dict[str, float]:
    """The mean of each named value over the records that have it (``None``: not measured, skipped)."""
    values: dict[str, list[float]] = {}
    for record in records:
        for name, value in record.items():
            if value is not None:
                values.setdefault(name, []).append(float(value))
    return {name: mean(v) for name, v in sorted(values.items())}


def episode_metrics(rollouts: list[Rollout]) -> dict[str, float]:
    """The mean of each per-episode metric (``info["metrics"]``: an environment's reward functions and
    metrics) over the rollouts that report it; empty for environments that report none."""
    means = mean_by_name(r.info.get("metrics", {}) for r in rollouts)
    return {f"{name}_mean": v for name, v in means.items()}


def split_stream(token_ids: list[int], sampled: list[bool], logprobs: list[float]) -> Branch | None:
    """A conversation's token stream as a :class:`Branch`: the prompt is everything before the first sampled
    token. ``None`` if the policy sampled nothing in it."""
    if not (len(token_ids) == len(sampled) == len(logprobs)):
        raise ValueError(
            f"token stream of {len(token_ids)} ids, {len(sampled)} mask entries, {len(logprobs)} logprobs"
        )
    if True not in sampled:
        return None
    start = sampled.index(True)
    return Branch(
        list(token_ids[:start]),
        list(token_ids[start:]),
        [float(x) if m else 0.0 for x, m in zip(logprobs[start:], sampled[start:], strict=True)],
        list(sampled[start:]),
    )
