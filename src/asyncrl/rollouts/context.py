"""What an environment runs episodes with (the sidecars, the reward guard, the sampling settings) and the
seed of each request: the orchestrator and ``asyncrl eval`` build both the same way, so an eval samples as
training does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.config import Config


def request_seed(seed: int, step: int, slot: int) -> int:
    """The sampling seed of prompt ``slot`` of ``step`` (non-negative, 63 bits): runs with one seed replay
    the same draws. Eval uses ``step=-1``, a stream no training step uses."""
    return ((seed * 1_000_003 + step) * 10_007 + slot) % (2**63)


@dataclass
class Sampling:
    temperature: float
    top_p: float
    max_tokens: int
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off

    def truncation(self) -> dict[str, int | float]:
        """The vLLM sampling extensions that truncate the distribution, when set (a request without them is
        unchanged)."""
        return {k: v for k, v in (("top_k", self.top_k), ("min_p", self.min_p)) if v > 0}


@dataclass
class RolloutContext:
    """What an environment needs to run episodes: the sidecars, the reward guard, the sampling settings."""

    pool: Any  # asyncrl.rollouts.client.InferencePool
    scorer: Any  # asyncrl.workers.scoring.Scorer
    sampling: Sampling
    model: str  # the served model name
    tokenizer: str  # a local tokenizer directory (verifiers' renderer is built on it)


def rollout_context(cfg: Config, pool, scorer, temperature: float | None = None) -> RolloutContext:
    """What the environments run episodes with: the sidecars, the reward guard, the sampling settings
    (``temperature``: the orchestrator's unless given) and the tokenizer verifiers' renderer is built on."""
    oc = cfg.orchestrator
    temp = oc.temperature if temperature is None else temperature
    sampled = temp > 0  # greedy requests take the argmax of the whole distribution
    sampling = Sampling(
        temp,
        oc.top_p if sampled else 1.0,
        oc.max_tokens,
        oc.top_k if sampled else 0,
        oc.min_p if sampled else 0.0,
    )
    return RolloutContext(pool, scorer, sampling, cfg.model.name, cfg.model.tokenizer or cfg.model.name)
