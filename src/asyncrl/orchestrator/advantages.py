"""Group-relative advantages (pure functions).

PRIME-RL's default (Dr.GRPO style): ``A_i = r_i - mean(r_group)``, optionally divided by the group's
standard deviation. A group whose rewards are all equal carries no signal and may be dropped; with
``orchestrator.difficulty.enabled`` so may a group too hard, too easy or too uniform (:func:`drop_reason`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from asyncrl.config.orchestrator import OrchestratorConfig

# why a group is not trained on; the difficulty filter's reasons are logged as rollout/filtered_<reason>
FILTER_REASONS = ("too_hard", "too_easy", "low_variance")


def compute_advantages(
    rewards: Sequence[float], std_normalize: bool = False, eps: float = 1e-6
) -> list[float]:
    """Advantages of one group of completions of the same prompt."""
    if not rewards:
        return []
    # math.fsum rounds the exact sum once: the same bits in any order and on any Python (3.12's sum() of
    # floats compensates, 3.11's does not, so they can differ in the last bit)
    mean = math.fsum(rewards) / len(rewards)
    adv = [r - mean for r in rewards]
    if std_normalize:
        std = math.sqrt(math.fsum(a * a for a in adv) / len(adv))
        adv = [a / (std + eps) for a in adv]
    return adv


def is_zero_advantage(advantages: Sequence[float], tol: float = 1e-9) -> bool:
    """True when no completion of the group is better or worse than another."""
    return all(abs(a) <= tol for a in advantages)


def drop_reason(rewards: Sequence[float], advantages: Sequence[float], oc: OrchestratorConfig) -> str | None:
    """Why a group is dropped before packing, or None to keep it: ``zero_advantage`` (all rewards equal, with
    ``drop_zero_advantage``), then, with ``difficulty.enabled``, the first of ``too_hard`` (mean reward below
    ``min_reward``), ``too_easy`` (above ``max_reward``) and ``low_variance`` (population variance below
    ``min_reward_variance``)."""
    if oc.drop_zero_advantage and is_zero_advantage(advantages):
        return "zero_advantage"
    d = oc.difficulty
    if not d.enabled or not rewards:
        return None
    mean = math.fsum(rewards) / len(rewards)
    if mean < d.min_reward:
        return "too_hard"
    if mean > d.max_reward:
        return "too_easy"
    if math.fsum((r - mean) ** 2 for r in rewards) / len(rewards) < d.min_reward_variance:
        return "low_variance"
    return None
