"""Command-line overrides checked against the schema before Hydra sees them.

Hydra's own errors for a mistyped key suggest ``+key=value``, which on a structured config then "works":
the key is added, dropped when the config becomes a dataclass, and the run starts without it. Here every
``key=value``, ``+key=value`` and ``~key`` is looked up in the dataclasses of :mod:`asyncrl.config.root`,
and every ``group=option`` in the config groups (``conf/<group>/*.yaml`` and ``--config-dir``): an unknown
one is a :class:`ConfigError` naming it, the closest allowed names and what is allowed.

A mapping of sections (``env: Dict[str, EnvSpec]``) has entries named by the user: ``env.<name>.type`` is
looked up in ``EnvSpec``, and ``<name>`` must be an entry of the composed config, which only composition
knows. So an override below an entry (``env.<name>.args.max_len=9``, with or without ``+``) is an
:class:`EntryOverride`, applied after composition once its entry is found. Below a free-form mapping
(``env.<name>.args``) any key is accepted here; the environment's ``Args`` checks it when it is built.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf

from asyncrl.config.fields import ConfigError, unknown_key
from asyncrl.config.root import Config
from asyncrl.paths import CONF_DIR


@dataclasses.dataclass(frozen=True)
class EntryOverride:
    """``key=value`` below the entry ``mapping.name`` of a mapping of sections, applied after composition."""

    key: str
    mapping: str
    name: str
    value: Any


def _unwrap(t: Any) -> Any:
    """``Optional[X]`` -> ``X``."""
    if typing.get_origin(t) is typing.Union:
        args = [a for a in typing.get_args(t) if a is not type(None)]
        return args[0] if len(args) == 1 else Any
    return t


def _section_type(t: Any) -> type | None:
    """The dataclass a field holds, or ``None``."""
    return (t if isinstance(t, type) else type(t)) if dataclasses.is_dataclass(t) else None


def walk_key(schema: type, key: str) -> tuple[str | None, tuple[str, str] | None]:
    """``(why key is not a key of schema or None, (mapping, entry) it passes below or None)``."""
    cls: Any = schema
    parts = key.split(".")
    done: list[str] = []
    entry: tuple[str, str] | None = None
    i = 0
    while i < len(parts):
        part = parts[i]
        hints = typing.get_type_hints(cls)
        if part not in hints:
            return unknown_key(".".join(done), part, list(hints), key), entry
        done.append(part)
        t = _unwrap(hints[part])
        i += 1
        if (sub := _section_type(t)) is not None:
            cls = sub
            continue
        value_type = typing.get_args(t)[1] if typing.get_origin(t) is dict else Any
        if (sub := _section_type(value_type)) is not None and i < len(parts):
            mapping, name = ".".join(done), parts[i]  # a user-named entry, then the entry's own schema
            done.append(name)
            i += 1
            entry = (mapping, name) if i < len(parts) else None
            cls = sub
            continue
        if t is Any or typing.get_origin(t) is dict or t is dict:
            return None, entry  # a free-form mapping: any key below it is the user's
        if i < len(parts):
            return (
                f"{key} is not a config key: {'.'.join(done)} is a value "
                f"({getattr(t, '__name__', t)}), not a section",
                entry,
            )
    return None, entry


def group_options(group: str, config_dirs: Sequence[str | Path] = ()) -> list[str]:
    found = set()
    for root in (CONF_DIR, *map(Path, config_dirs)):
        found |= {p.stem for p in (root / group).glob("*.yaml")}
    return sorted(found)


def groups(config_dirs: Sequence[str | Path] = ()) -> list[str]:
    return sorted(
        {p.name for root in (CONF_DIR, *map(Path, config_dirs)) for p in root.iterdir() if p.is_dir()}
    )


def _group_problems(key: str, value: Any, config_dirs: Sequence[str | Path]) -> list[str]:
    options = group_options(key, config_dirs)
    return [
        f"{key}={option}: no such option in config group {key!r}; available: "
        f"{', '.join(options)} (or your own {key}/*.yaml with --config-dir)"
        for option in (value if isinstance(value, list) else [value])
        if option is not None and str(option) not in options
    ]


def check_overrides(
    overrides: Sequence[str], config_dirs: Sequence[str | Path] = ()
) -> tuple[list[str], list[EntryOverride]]:
    """Raise :class:`ConfigError` listing every override that names an unknown key, group or group option;
    else ``(overrides for Hydra, overrides below a mapping's entry, applied after composition)``."""
    try:
        parsed = OverridesParser.create().parse_overrides(list(overrides))
    except HydraException as e:
        raise ConfigError(f"invalid config: {e}") from None
    known_groups = groups(config_dirs)
    problems: list[str] = []
    hydra: list[str] = []
    entries: list[EntryOverride] = []
    for text, o in zip(overrides, parsed, strict=True):
        key = o.key_or_group
        if key.startswith("hydra.") or key == "hydra" or (key in known_groups and o.is_delete()):
            hydra.append(text)
            continue
        if key in known_groups:
            problems += _group_problems(key, o.value(), config_dirs)
            hydra.append(text)
            continue
        problem, entry = walk_key(Config, key)
        if problem:
            problems.append(problem)
        elif entry is not None and not o.is_delete():
            entries.append(EntryOverride(key, entry[0], entry[1], o.value()))
        else:
            hydra.append(text)
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))
    return hydra, entries


def check_entries(node: DictConfig | ListConfig, entries: Sequence[EntryOverride]) -> None:
    """Raise :class:`ConfigError` for an override below an entry the composed ``node`` does not have (it
    would add an entry of defaults, e.g. a second environment, instead of changing the one meant)."""
    problems = []
    for e in entries:
        present = list(OmegaConf.select(node, e.mapping) or {})
        if e.name not in present:
            problems.append(
                unknown_key(e.mapping, e.name, present, e.key)
                + f"; choose it first (e.g. {e.mapping}=[{','.join([*present, e.name])}])"
            )
    if problems:
        raise ConfigError("invalid config:\n  " + "\n  ".join(problems))


def apply_entries(node: DictConfig, entries: Sequence[EntryOverride]) -> None:
    """Check, then set each override below an entry as Hydra sets an override (merged, added if new)."""
    check_entries(node, entries)
    for e in entries:
        OmegaConf.update(node, e.key, e.value, merge=True, force_add=True)
