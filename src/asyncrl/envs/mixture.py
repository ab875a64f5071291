"""A weighted mixture of environments and the seeded prompt sampler the orchestrator checkpoints."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from asyncrl.config.fields import ConfigError
from asyncrl.config.sections import EnvSpec
from asyncrl.envs.base import Environment, env_class


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


class PromptSampler:
    """Draws examples: an environment by weight, then the next example of that environment's shuffled split.

    Each environment walks seeded per-epoch permutations, so its state is two integers; the
    environment choice uses one ``random.Random`` whose state is saved too. Resuming from
    ``state_dict()`` continues the exact same sequence of draws.
    """

    def __init__(self, envs: dict[str, Environment], weights: dict[str, float], split: str, seed: int):
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

    def _order(self, name: str) -> list[int]:
        epoch = self.pos[name]["epoch"]
        cached = self._perm.get(name)
        if cached is None or cached[0] != epoch:
            order = list(range(len(self.data[name])))
            random.Random(f"{self.seed}:{name}:{epoch}").shuffle(order)
            self._perm[name] = (epoch, order)
        return self._perm[name][1]

    def draw(self) -> Draw:
        name = self.rng.choices(self.names, weights=self.weights)[0] if len(self.names) > 1 else self.names[0]
        pos = self.pos[name]
        if pos["cursor"] >= len(self.data[name]):
            pos["epoch"], pos["cursor"] = pos["epoch"] + 1, 0
        example = self.data[name][self._order(name)[pos["cursor"]]]
        pos["cursor"] += 1
        return Draw(name, example)

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss = self.rng.getstate()
        return {"rng": [version, list(internal), gauss], "pos": {n: dict(p) for n, p in self.pos.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.pos = {n: dict(p) for n, p in state["pos"].items()}
