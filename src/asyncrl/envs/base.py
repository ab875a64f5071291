"""The environment interface: a dataset, the chat prompt of an example, and a reward.

To add a task, subclass :class:`Environment` (with an ``Args`` dataclass for its arguments), decorate it
with ``@register_env("name")`` (:mod:`asyncrl.envs.registry`) or refer to it as
``env.<name>.type=package.module:Class``; no core code changes. ``asyncrl prepare`` calls
:meth:`Environment.generate` once per split and writes JSONL; training, SFT and eval read it back with
:meth:`Environment.load`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, ClassVar

from asyncrl.config.fields import ConfigError, unknown_key, validate
from asyncrl.paths import data_file
from asyncrl.rollouts.context import RolloutContext
from asyncrl.rollouts.trajectory import Branch, Rollout


class Environment(ABC):
    """One task. Subclasses define ``Args`` (a dataclass of ``F`` fields) and the four methods below."""

    @dataclasses.dataclass
    class Args:
        pass

    splits: ClassVar[tuple[str, ...]] = ("train", "eval")
    # defined by an environment whose episodes run in an env worker (agent, vf_env): see remote_episode
    episode: Callable[..., Awaitable[Rollout]]

    def __init__(self, name: str, data_dir: str | Path, args: dict[str, Any] | None = None):
        self.name = name
        self.data_dir = Path(data_dir)
        self.args = self._parse_args(args or {})

    def _parse_args(self, raw: dict[str, Any]):
        known = [f.name for f in dataclasses.fields(self.Args)]
        if unknown := sorted(set(raw) - set(known)):
            section = f"env.{self.name}.args"
            raise ConfigError(
                "invalid config:\n  " + "\n  ".join(unknown_key(section, k, known) for k in unknown)
            )
        args = self.Args(**raw)
        try:
            validate(args)
        except ConfigError as e:  # re-prefix the keys with where they live in the config tree
            raise ConfigError(str(e).replace("\n  ", f"\n  env.{self.name}.args.")) from None
        if problems := self.check_args(args):
            raise ConfigError(
                "invalid config:\n  " + "\n  ".join(f"env.{self.name}.args.{p}" for p in problems)
            )
        return args

    def check_args(self, args) -> list[str]:
        """Constraints between arguments (``["min_len=9 > max_len=3 ..."]``), checked when the environment is
        built, so every command refuses them before it starts; single-field bounds belong in ``Args``."""
        return []

    # -- data ---------------------------------------------------------------------------------------
    @abstractmethod
    def generate(self, split: str, seed: int) -> list[dict[str, Any]]:
        """Build the examples of ``split`` (deterministic in ``seed``). Called by ``asyncrl prepare``."""

    def load(self, split: str) -> list[dict[str, Any]]:
        path = data_file(self.data_dir, self.name, split)
        if not path.exists():
            raise FileNotFoundError(
                f"no data for env '{self.name}' split '{split}' at {path}; run `asyncrl prepare` first"
            )
        with path.open() as f:
            return [json.loads(line) for line in f if line.strip()]

    # -- task ---------------------------------------------------------------------------------------
    @abstractmethod
    def prompt(self, example: dict[str, Any]) -> list[dict[str, str]]:
        """The chat messages sent to the policy."""

    @abstractmethod
    def reward(self, example: dict[str, Any], completion: str) -> float:
        """Score a completion in [0, 1]. Model output is untrusted: this must not raise on any string."""

    def scored(self, example: dict[str, Any], completion: str) -> Any:
        """:meth:`reward` and the episode's metrics of how it was reached (none here): ``(reward, metrics)``,
        or a coroutine of it where the reward is ``async def`` (the runner awaits it). An environment whose
        reward knows more (the code sandbox's verdicts) overrides this."""
        value = self.reward(example, completion)
        if inspect.iscoroutine(value):
            return _no_metrics(value)
        return value, {}

    def answer(self, example: dict[str, Any]) -> str | None:
        """A reference completion for SFT, or ``None`` if the task has none."""
        return None

    def demonstration(self, example: dict[str, Any]) -> list[dict[str, str]] | None:
        """A reference episode for SFT: the messages that follow :meth:`prompt`, the model's turns as
        ``assistant`` messages (trained on) and what the environment answered in between (context); ``None``
        if the task has none. Single-turn by default: the one reply :meth:`answer`."""
        answer = self.answer(example)
        return None if answer is None else [{"role": "assistant", "content": answer}]

    def tools(self, example: dict[str, Any]) -> list[dict[str, Any]] | None:
        """The function tools (OpenAI's shape) an episode of ``example`` offers the model, so that SFT
        renders its demonstration as the sidecar renders the episode
        (:func:`asyncrl.models.hf.render_conversation`); none by default."""
        return None

    # -- episodes -----------------------------------------------------------------------------------
    async def rollouts(
        self, ctx: RolloutContext, example: dict[str, Any], n: int, seed: int | None
    ) -> list[Rollout]:
        """``n`` episodes of ``example`` (seeded). Single-turn by default: one request for ``n`` completions
        of :meth:`prompt`, each scored by :meth:`reward` under the orchestrator's guard (a reward that raises
        or hangs scores 0, counted). Multi-turn environments override this (see ``vf_env``)."""
        s = ctx.sampling
        out = await ctx.pool.chat(
            self.prompt(example), n, s.temperature, s.top_p, s.max_tokens, seed, **s.truncation()
        )
        scored = await asyncio.gather(
            *(ctx.scorer.score_with_info(self.scored, example, c.text) for c in out.choices)
        )
        episodes = []
        for c, (r, metrics) in zip(out.choices, scored, strict=True):
            branch = Branch(out.prompt_ids, c.token_ids, c.logprobs, [True] * len(c.token_ids))
            branch.routed_experts = c.routed_experts
            episodes.append(Rollout([branch], r, c.text, c.finish_reason))
            if metrics:
                episodes[-1].info["metrics"] = metrics
        return episodes

    async def remote_episode(
        self, ctx: RolloutContext, example: dict[str, Any], extra: Any, seed: int | None, deadline_s: float
    ) -> Rollout | None:
        """One episode run by ``self.episode(example, url, sampling, model, extra, scoring_timeout_s, seed)``
        in an env worker, on the sidecar with the fewest episodes in flight; ``None`` if it ran past
        ``deadline_s`` or its worker died on every attempt (the scorer counts both)."""
        async with ctx.pool.slot() as url:
            args = (example, url, ctx.sampling, ctx.model, extra, ctx.scorer.timeout_s, seed)
            return await ctx.scorer.episode(self.episode, *args, timeout_s=deadline_s)

    def share(self, parts: int) -> None:
        """This copy of the environment is one of ``parts`` (one per env worker process): what it starts per
        process with a machine-wide budget (the code sandbox's pool) takes a ``1/parts`` share. Nothing
        here."""
        return None

    async def close(self) -> None:
        """Release what :meth:`rollouts` started (servers, sessions); called once when the run ends."""
        return None


async def _no_metrics(reward: Any) -> tuple[Any, dict[str, float]]:
    return await reward, {}
