"""Command-line overrides checked against the schema before Hydra sees them.

Hydra's own errors for a mistyped key suggest ``+key=value``, which on a structured config then "works":
the key is added, dropped when the config becomes a dataclass, and the run starts without it. Here every
``key=value``, ``+key=value`` and ``~key`` is looked up in the dataclasses of :mod:`asyncrl.config.root`
(free-form dicts such as ``env.<name>.args`` end the lookup), and every ``group=option`` in the config
groups (``conf/<group>/*.yaml`` and ``--config-dir``): an unknown one is a :class:`ConfigError` naming it,
the closest allowed names and what is allowed.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from asyncrl.config.fields import ConfigError


def _unwrap(t: Any) -> Any:
    """``Optional[X]`` -> ``X``."""
    if typing.get_origin(t) is typing.Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return args[0] if len(args) == 1 else Any
    return t


def key_problem(schema: type, key: str) -> str | None:
    """Why ``key`` (dotted) is not a key of ``schema`` (a dataclass), or ``None`` if it is."""
    cls: Any = schema
    done: list[str] = []
    for part in key.split("."):
        hints = typing.get_type_hints(cls)
        if part not in hints:
            where = ".".join(done) or "the config"
            close = difflib.get_close_matches(part, list(hints), n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join('.'.join([*done, c]) for c in close)}?" if close else ""
            return f"{key} is not a config key: {where} has no key {part!r}{hint} (allowed: {', '.join(hints)})"
        done.append(part)
        t = _unwrap(hints[part])
        if dataclasses.is_dataclass(t):
            cls = t if isinstance(t, type) else type(t)
            continue
        if t is Any or typing.get_origin(t) is dict or t is dict:
            return None  # a free-form mapping: any key below it is the user's
        if len(done) < len(key.split(".")):
            return (
                f"{key} is not a config key: {'.'.join(done)} is a value ({getattr(t, '__name__', t)}), not a section"
            )
    return None


def group_options(group: str, config_dirs: Sequence[str | Path] = ()) -> list[str]:
    from asyncrl.config.compose import CONF_DIR

    found = set()
    for root in (CONF_DIR, *map(Path, config_dirs)):
        found |= {p.stem for p in (root / group).glob("*.yaml")}
    return sorted(found)


def groups(config_dirs: Sequence[str | Path] = ()) -> list[str]:
    from asyncrl.config.compose import CONF_DIR

    return sorted({p.name for root in (CONF_DIR, *map(Path, config_dirs)) for p in root.iterdir() if p.is_dir()})


def check_overrides(overrides: Sequence[str], config_dirs: Sequence[str | Path] = ()) -> None:
    """Raise :class:`ConfigError` for the first override naming an unknown key, group or group option."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    from asyncrl.config.root import Config

    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ConfigError(f"invalid config: {e}") from None
    known_groups = groups(config_dirs)
    problems = []
    for o in parsed:
        key = o.key_or_group
        if key.startswith("hydra.") or key == "hydra":
            continue
        if key in known_groups:
            if o.is_delete():
                continue
            value = o.value()
            chosen = value if isinstance(value, list) else [value]
            options = group_options(key, config_dirs)
            for option in chosen:
                if option is not None and str(option) not in options:
                    problems.append(
                        f"{key}={option}: no such option in config group {key!r}; available: "
                        f"{', '.join(options)} (or your own {key}/*.yaml with --config-dir)"
                    )
            continue
        if problem := key_problem(Config, key):
            problems.append(problem)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
