"""The launcher's child processes: the helpers live in :mod:`asyncrl.utils.children`, below every process that
starts one (the launcher starts all three; ``asyncrl eval`` starts its own sidecar)."""

from __future__ import annotations

from asyncrl.utils.children import Proc, asyncrl_argv, spawn, stop, tail, wait_healthy

__all__ = ["Proc", "asyncrl_argv", "spawn", "stop", "tail", "wait_healthy"]
