"""Errors that more than one layer raises and catches."""

from __future__ import annotations


class ScoringUnavailable(RuntimeError):
    """What a reward runs on failed (a sandbox that cannot start, a scoring service gone), not the completion
    it judges: scoring the sample 0 would train on zeros, so the scorer retries and then stops the run
    (:class:`asyncrl.workers.scoring.Scorer`)."""
