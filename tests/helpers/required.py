"""Components a test needs that may be missing on a machine: skipped where they may be, a failure under
CI."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncrl.models.qwen_tokenizer import tokenizer_dir


def under_ci() -> bool:
    """Whether this run is CI's (``CI=true``, as CI runners and ../shared/tools/ci-clean-clone.sh set it)."""
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def require(reason: str | None, what: str) -> None:
    """Nothing when ``reason`` is None (``what`` is here); else skip the test, or fail it under CI, where
    every component the suite tests must exist: a CI run that skipped it would pass with ``what``
    untested."""
    if reason is None:
        return
    if under_ci():
        pytest.fail(f"{what} must be testable under CI=true, and is not: {reason}")
    pytest.skip(reason)


def qwen3_tokenizer() -> Path:
    """Where ``python -m asyncrl.models.qwen_tokenizer`` wrote Qwen3's tokenizer (``make install`` runs it),
    or :func:`require`'s skip (a failure under CI)."""
    path = tokenizer_dir()
    missing = None if (path / "tokenizer.json").is_file() else f"no tokenizer at {path}: run make install"
    require(missing, "Qwen3's tokenizer (python -m asyncrl.models.qwen_tokenizer)")
    return path
