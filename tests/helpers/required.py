"""Components a test needs that may be missing on a machine: skipped where they may be, a failure under CI."""

from __future__ import annotations

import os

import pytest


def under_ci() -> bool:
    """Whether this run is CI's (``CI=true``, as CI runners and ../shared/tools/ci-clean-clone.sh set it)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(reason: str | None, what: str) -> None:
    """Nothing when ``reason`` is None (``what`` is here); else skip the test, or fail it under CI, where every
    component the suite tests must exist: a CI run that skipped it would pass with ``what`` untested."""
    if reason is None:
        return
    if under_ci():
        pytest.fail(f"{what} must be testable under CI=true, and is not: {reason}")
    pytest.skip(reason)
