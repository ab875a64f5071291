"""Group-relative advantages (pure functions).

PRIME-RL's default (Dr.GRPO style): ``A_i = r_i - mean(r_group)``, optionally divided by the group's
standard deviation. A group whose rewards are all equal carries no signal and may be dropped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def compute_advantages(rewards: Sequence[float], std_normalize: bool = False, eps: float = 1e-6) -> list[float]:
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
