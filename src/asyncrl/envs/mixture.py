"""A weighted mixture of environments and the seeded prompt sampler the orchestrator checkpoints."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config.fields import ConfigError
from asyncrl.config.orchestrator import EnvSpec
from asyncrl.envs.base import Environment
from asyncrl.envs.registry import env_class

log = logging.getLogger("asyncrl.orchestrator")


def build_envs(specs: dict[str, EnvSpec], data_dir: str | Path) -> dict[str, Environment]:
    envs = {}
    for name, spec in specs.items():
        try:
            cls = env_class(spec.type)
        except ConfigError as e:  # name the key: with several environments the type alone is ambiguous
            raise ConfigError(str(e).replace("\n  ", f"\n  env.{name}.type={spec.type}: ", 1)) from None
        envs[name] = cls(name, data_dir, dict(spec.args))
    return envs


@dataclass
class Draw:
    env: str
    example: dict[str, Any]
    row: int = -1  # the example's position in its environment's split (the curriculum's key); -1: unknown


class PromptSampler:
    """Draws examples: an environment by weight, then the next example of that environment's shuffled split.

    Each environment walks seeded per-epoch permutations, so its state is two integers; the
    environment choice uses one ``random.Random`` whose state is saved too. Resuming from
    ``state_dict()`` continues the exact same sequence of draws.

    Curriculum (``skip_steps > 0``): :meth:`record` keeps each example's latest pass rate (its group's mean
    reward); an example solved (above ``max_reward``) or hopeless (below ``min_reward``) is passed over by
    :meth:`draw` until ``skip_steps`` steps later (``now``, set by the schedule, is the step being made).
    The history is part of ``state_dict()``.
    """

    def __init__(
        self,
        envs: dict[str, Environment],
        weights: dict[str, float],
        split: str,
        seed: int,
        skip_steps: int = 0,
        bounds: tuple[float, float] = (0.0, 1.0),
    ):
        self.envs = envs
        self.names = sorted(envs)
        self.weights = [weights[n] for n in self.names]
        self.seed = seed
        self.data = {n: envs[n].load(split) for n in self.names}
        for n, rows in self.data.items():
            if not rows:
                raise ValueError(f"env '{n}' has no examples in split '{split}'")
        self.rng = random.Random(f"{seed}:mixture")
        self.pos = {n: {"epoch": 0, "cursor": 0} for n in self.names}
        self._perm: dict[str, tuple[int, list[int]]] = {}
        self.skip_steps, self.bounds = skip_steps, bounds
        self.now = 0  # the step being made: examples skipped until a later step are passed over
        # row: (rate, until)
        self.history: dict[str, dict[int, tuple[float, int]]] = {n: {} for n in self.names}
        self.skipped = 0  # draws passed over since take_skipped()
        self._exhausted_warned = False

    def _order(self, name: str) -> list[int]:
        epoch = self.pos[name]["epoch"]
        cached = self._perm.get(name)
        if cached is None or cached[0] != epoch:
            order = list(range(len(self.data[name])))
            random.Random(f"{self.seed}:{name}:{epoch}").shuffle(order)
            self._perm[name] = (epoch, order)
        return self._perm[name][1]

    def _next_row(self, name: str) -> int:
        pos = self.pos[name]
        if pos["cursor"] >= len(self.data[name]):
            pos["epoch"], pos["cursor"] = pos["epoch"] + 1, 0
        row = self._order(name)[pos["cursor"]]
        pos["cursor"] += 1
        return row

    def draw(self) -> Draw:
        name = (
            self.rng.choices(self.names, weights=self.weights)[0] if len(self.names) > 1 else self.names[0]
        )
        history = self.history[name]
        row = self._next_row(name)
        # a whole split's worth of skipped examples in a row: every one is skipped, so take this one anyway
        for _ in range(len(self.data[name])):
            if row not in history or history[row][1] <= self.now:
                break
            self.skipped += 1
            row = self._next_row(name)
        else:
            if not self._exhausted_warned:
                self._exhausted_warned = True
                log.warning(
                    f"curriculum: every example of env '{name}' is skipped at step {self.now} (solved or "
                    "hopeless); drawing them anyway (lower orchestrator.difficulty.skip_steps)"
                )
        return Draw(name, self.data[name][row], row)

    def record(self, draw: Draw, rewards: list[float]) -> None:
        """Keep ``draw``'s pass rate (its group's mean reward) and, past the bounds, skip it for
        ``skip_steps``."""
        if self.skip_steps <= 0 or draw.row < 0 or not rewards:
            return
        rate = sum(rewards) / len(rewards)
        lo, hi = self.bounds
        until = self.now + 1 + self.skip_steps if (rate < lo or rate > hi) else 0
        self.history[draw.env][draw.row] = (rate, until)

    def take_curriculum_counts(self) -> dict[str, float]:
        """``rollout/curriculum_skipped`` (draws passed over since the last call) and ``_skipping`` (examples
        skipped at the current step); empty without a curriculum."""
        if self.skip_steps <= 0:
            return {}
        skipped, self.skipped = self.skipped, 0
        skipping = sum(until > self.now for h in self.history.values() for _, until in h.values())
        return {"rollout/curriculum_skipped": skipped, "rollout/curriculum_skipping": skipping}

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        state = {"rng": [version, list(internal), gauss], "pos": {n: dict(p) for n, p in self.pos.items()}}
        if self.skip_steps > 0:  # JSON keys are strings
            state["history"] = {n: {str(r): list(v) for r, v in h.items()} for n, h in self.history.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.pos = {n: dict(p) for n, p in state["pos"].items()}
        saved = state.get("history", {})
        self.history = {
            n: {int(r): (v[0], int(v[1])) for r, v in saved.get(n, {}).items()} for n in self.names
        }
