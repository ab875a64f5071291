"""Variations chosen by name in the config: each variant is one class in one module, found through a
registry.

A registry maps a config key's values to classes: the built-ins by ``module:Class`` path (imported on first
use, so the config checks import no variant's heavy dependencies, and the registry none of the modules that
import it), those a user's module registers with :meth:`Registry.register`, and any ``package.module:Class``
path given as the value itself, which is how a variant from outside asyncrl is named (every process imports
it).

The registries live here, at the bottom of the layers, because the config checks ask a variant for its own
errors; the classes live with the code they drive (:mod:`asyncrl.transport` for ``weights.transport``,
:mod:`asyncrl.losses` for ``trainer.loss.type``).
"""

from __future__ import annotations

import importlib
from typing import Any

from asyncrl.config.fields import ConfigError


def import_path(path: str, key: str | None = None) -> Any:
    """The object a ``package.module:attr`` path names; a :class:`ConfigError` (naming ``key`` if given) when
    it cannot be imported."""
    module, _, attr = path.partition(":")
    where = f"{key}={path!r}: " if key else ""
    try:
        return getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ConfigError(
            f"invalid config:\n  {where}cannot import {module} ({e}); its package must be importable by "
            "every asyncrl process: `pip install -e <your package>` or put it on PYTHONPATH"
        ) from None
    except AttributeError:
        raise ConfigError(f"invalid config:\n  {where}{module} has no {attr!r}") from None


def overrides(cls: type, base: type, name: str) -> bool:
    """Whether ``cls`` defines ``name`` itself or inherits it from a class below ``base``, rather than taking
    ``base``'s (an interface hook that only raises)."""
    mine, theirs = getattr(cls, name), getattr(base, name)
    return getattr(mine, "__func__", mine) is not getattr(theirs, "__func__", theirs)


class Registry:
    """The classes a config ``key`` may name. ``base``: the ``module:Class`` path every variant subclasses;
    ``builtin``: name -> ``module:Class`` path. A base's classmethod ``missing_hooks()`` names the hooks a
    subclass has not given, so that a variant missing one is refused when the config is checked, not at its
    first use."""

    def __init__(self, key: str, base: str, builtin: dict[str, str]):
        self.key, self.base, self.builtin = key, base, dict(builtin)
        self.registered: dict[str, type] = {}

    def register(self, name: str):
        """Make ``<key>=name`` mean the decorated class (its module must be imported by every process by
        then; naming the class by its ``package.module:Class`` path needs no registration)."""

        def deco(cls: type) -> type:
            self.registered[name] = cls
            return cls

        return deco

    @property
    def default(self) -> str:
        """The first built-in: the schema's default value, and the advice where a variant does not fit."""
        return next(iter(self.builtin))

    def names(self) -> list[str]:
        """The built-ins in their order (the default first), then the registered ones."""
        return [*self.builtin, *(n for n in self.registered if n not in self.builtin)]

    def get(self, name: str) -> Any:
        """The class ``name`` means: a registered or built-in name, or a ``package.module:Class`` path."""
        if ":" in name:
            cls = import_path(name, self.key)
        elif name in self.registered:
            cls = self.registered[name]
        elif name in self.builtin:
            cls = import_path(self.builtin[name], self.key)
        else:
            raise ConfigError(
                f"invalid config:\n  {self.key}={name!r} is not allowed; allowed values: "
                f"{', '.join(repr(n) for n in self.names())} (or a 'package.module:Class' path)"
            )
        base = import_path(self.base, self.key)
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(f"invalid config:\n  {self.key}={name!r} is not a subclass of {self.base}")
        missing: list[str] = cls.missing_hooks() if hasattr(cls, "missing_hooks") else []
        if missing:
            raise ConfigError(
                f"invalid config:\n  {self.key}={name!r}: {cls.__module__}.{cls.__qualname__} does not "
                f"define {', '.join(missing)}, which every subclass of {self.base} must (see its docstrings)"
            )
        return cls

    def all(self) -> list[Any]:
        """Every built-in and registered class."""
        return [self.get(name) for name in self.names()]


# weights.transport: how each new policy travels from the trainer to the sidecars (asyncrl/transport/base.py)
TRANSPORTS = Registry(
    "weights.transport",
    "asyncrl.transport.base:Transport",
    {
        "filesystem": "asyncrl.transport.files:Files",
        "nccl": "asyncrl.transport.nccl:NCCL",
        "ipc": "asyncrl.transport.ipc:IPC",
    },
)

# trainer.loss.type: the RL loss's policy-gradient term (asyncrl/losses/base.py)
LOSSES = Registry(
    "trainer.loss.type",
    "asyncrl.losses.base:Loss",
    {
        "dppo_kl": "asyncrl.losses.dppo_kl:DPPOKL",
        "grpo": "asyncrl.losses.grpo:GRPO",
        "gspo": "asyncrl.losses.gspo:GSPO",
        "cispo": "asyncrl.losses.cispo:CISPO",
    },
)
