"""Evaluation metrics (pure functions)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from math import comb


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021): probability that at least one of k draws from n samples,
    c of which pass, passes."""
    if k > n:
        raise ValueError(f"k={k} > n={n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def ks_for(n: int) -> list[int]:
    """1, 2, 4, ... up to n (and n itself)."""
    ks, k = [], 1
    while k < n:
        ks.append(k)
        k *= 2
    return ks + [n]


def mean(xs: Sequence[float]) -> float:
    """The mean from the correctly rounded sum (``math.fsum``): the same bits in any order and on any Python
    (3.12's ``sum()`` of floats compensates, 3.11's does not)."""
    return math.fsum(xs) / len(xs) if xs else float("nan")
