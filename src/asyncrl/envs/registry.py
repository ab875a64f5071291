"""Environment types by name: the built-ins (a ``module:Class`` path each, imported on first use) and those
registered with ``@register_env``; or any ``package.module:Class`` path.

The built-ins are named by path rather than imported here: a built-in module imports
:mod:`asyncrl.envs.base`, and the registry must not import what imports it; importing by name also keeps
verifiers, reasoning-gym and the sandbox out of a process that uses none of them.
"""

from __future__ import annotations

from asyncrl.config.fields import ConfigError
from asyncrl.config.variants import import_path
from asyncrl.envs.base import Environment

BUILTIN = {
    "reverse_text": "asyncrl.envs.reverse_text:ReverseText",
    "reasoning_gym": "asyncrl.envs.verifiable:ReasoningGym",
    "math": "asyncrl.envs.verifiable:Math",
    "code": "asyncrl.envs.code:Code",
    "verifiers": "asyncrl.envs.vf_env:VerifiersEnv",
    "agent": "asyncrl.envs.agent:Agent",
}

_REGISTRY: dict[str, type[Environment]] = {}


def register_env(name: str):
    """Make ``env.<x>.type=name`` mean the decorated class (its module must be imported by then)."""

    def deco(cls: type[Environment]) -> type[Environment]:
        _REGISTRY[name] = cls
        return cls

    return deco


def env_class(type_name: str) -> type[Environment]:
    """Resolve a registered or built-in name, or a ``package.module:Class`` path."""
    if ":" in type_name:
        cls = import_path(type_name)
    elif type_name in _REGISTRY:
        cls = _REGISTRY[type_name]
    elif type_name in BUILTIN:
        cls = import_path(BUILTIN[type_name])
    else:
        raise ConfigError(
            f"invalid config:\n  unknown environment type {type_name!r}; registered: "
            f"{sorted({*BUILTIN, *_REGISTRY})} (or give 'package.module:Class')"
        )
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"invalid config:\n  {type_name!r} is not an asyncrl Environment subclass")
    return cls
