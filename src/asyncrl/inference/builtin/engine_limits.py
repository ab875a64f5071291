"""What the CPU engine checks a request against before it is queued, shared by the engine and its process
handle."""

from __future__ import annotations

from typing import Protocol


class GenRequestLike(Protocol):
    """What the limits read of a request (:class:`asyncrl.inference.builtin.engine.GenRequest`)."""

    prompt_ids: list[int]
    max_tokens: int


class EngineLimits:
    """What the server checks a request against before it is queued; shared by :class:`HFEngine` and its
    process handle (:class:`asyncrl.inference.builtin.engine_process.EngineProcess`)."""

    max_model_len: int
    vocab_size: int

    def check(self, req: GenRequestLike) -> str | None:
        """Why ``req`` cannot be served, or ``None``; the server turns a reason into a 400."""
        if not req.prompt_ids:
            return "the prompt is empty"
        bad = [t for t in req.prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            return f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}"
        if len(req.prompt_ids) >= self.max_model_len:  # the routes' default max_tokens would be < 1
            return (
                f"the prompt ({len(req.prompt_ids)} tokens) leaves no room to generate in the model's "
                f"context of {self.max_model_len} tokens"
            )
        if req.max_tokens < 1:
            return f"max_tokens must be >= 1, got {req.max_tokens}"
        if len(req.prompt_ids) + req.max_tokens > self.max_model_len:
            return (
                f"prompt ({len(req.prompt_ids)} tokens) + max_tokens ({req.max_tokens}) exceeds the model's "
                f"context of {self.max_model_len} tokens"
            )
        return None

    def alive(self) -> bool:
        """Whether the engine can still generate (an engine in another process may die)."""
        return True
