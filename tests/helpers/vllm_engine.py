"""A stand-in for vLLM's engine client, for the vLLM backend's routes tested without vLLM."""

from __future__ import annotations

import asyncio


class FakeEngine:
    """vLLM's engine client as the admin routes use it; ``fail``: RPC method -> the exception it raises
    (once)."""

    def __init__(self, problems: list[str] | None = None, fail: dict | None = None, hang: str | None = None):
        self.calls = []
        self.problems = problems or []  # what the workers' dry run reports
        self.fail = dict(fail or {})
        self.hang = hang  # an RPC method that never returns (a broadcast whose sender died half-way)

    async def pause_generation(self, **kw):
        self.calls.append(("pause", kw))

    async def resume_generation(self):
        self.calls.append(("resume", {}))

    async def collective_rpc(self, method, kwargs=None, **kw):
        self.calls.append((method, kwargs))
        if method == self.hang:
            await asyncio.Event().wait()
        if method in self.fail:
            raise self.fail.pop(method)
        return [list(self.problems)] if method == "asyncrl_check_weights" else None

    async def reset_prefix_cache(self, **kw):
        self.calls.append(("reset_prefix_cache", kw))
