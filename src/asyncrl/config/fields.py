"""Typed, documented, bounded config fields, and the validator that checks them.

Every schema field is declared with :func:`F`, which stores a one-line doc and optional bounds in the
dataclass field's metadata. :func:`validate` walks a config object and reports each violation with its
full dotted key (``trainer.optim.lr``), so a bad override fails with a message naming the key, the
value and what is allowed. Hydra/OmegaConf already reject unknown keys and wrong types; this adds
ranges and closed option sets, which OmegaConf does not check.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Sequence
from functools import partial
from typing import Any, Iterator


def F(
    default: Any = dataclasses.MISSING,
    doc: str = "",
    *,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    choices: tuple | None = None,
) -> Any:
    """A dataclass field with a doc line and optional bounds (``ge``/``gt``/``le``/``lt``, ``choices``)."""
    meta = {"doc": doc, "ge": ge, "gt": gt, "le": le, "lt": lt, "choices": choices}
    if dataclasses.is_dataclass(default) or isinstance(default, (list, dict)):
        proto: Any = default
        # a fresh copy per instance (dataclasses refuse mutable defaults); copy.copy keeps nested fields
        # shared, as dataclasses.replace did
        factory = partial(copy.copy, proto)
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class ConfigError(ValueError):
    """A user mistake in the configuration; the message names every offending key."""


def unknown_key(section: str, name: str, allowed: Sequence[str], key: str | None = None) -> str:
    """The message for ``name``, not a key of ``section`` (dotted; ``""`` for the root): the closest allowed
    keys and all of them. ``key`` is the full key given, when it goes on below ``name``."""
    prefix = f"{section}." if section else ""
    close = difflib.get_close_matches(name, list(allowed), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(prefix + c for c in close)}?" if close else ""
    return (
        f"{key or prefix + name} is not a config key: {section or 'the config'} has no key {name!r}{hint} "
        f"(allowed: {', '.join(allowed) or 'none'})"
    )


def _check(key: str, value: Any, meta: dict) -> str | None:
    if value is None:
        return None
    if meta.get("choices") is not None and value not in meta["choices"]:
        allowed = ", ".join(repr(c) for c in meta["choices"])
        return f"{key}={value!r} is not allowed; allowed values: {allowed}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    for op, bound, ok in (
        ("ge", meta.get("ge"), lambda v, b: v >= b),
        ("gt", meta.get("gt"), lambda v, b: v > b),
        ("le", meta.get("le"), lambda v, b: v <= b),
        ("lt", meta.get("lt"), lambda v, b: v < b),
    ):
        if bound is not None and not ok(value, bound):
            sym = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}[op]
            return f"{key}={value!r} is out of range; it must be {sym} {bound}"
    return None


def iter_fields(obj: Any, prefix: str = "") -> Iterator[tuple[str, Any, dict]]:
    """Yield ``(dotted_key, value, metadata)`` for every leaf and nested dataclass field of ``obj``."""
    for f in dataclasses.fields(obj):
        key = f"{prefix}{f.name}"
        value = getattr(obj, f.name)
        yield key, value, dict(f.metadata)
        if dataclasses.is_dataclass(value):
            yield from iter_fields(value, key + ".")
        elif isinstance(value, dict):
            for name, item in value.items():
                if dataclasses.is_dataclass(item):
                    yield from iter_fields(item, f"{key}.{name}.")


def validate(obj: Any) -> None:
    """Check bounds and choices on every field; raise :class:`ConfigError` listing all violations."""
    errors = [msg for key, value, meta in iter_fields(obj) if (msg := _check(key, value, meta))]
    if errors:
        raise ConfigError("invalid config:\n  " + "\n  ".join(errors))


def describe(obj: Any) -> list[tuple[str, Any, str]]:
    """``(key, value, doc)`` rows for ``--help``: the documentation lives next to each field."""
    return [(k, v, m.get("doc", "")) for k, v, m in iter_fields(obj) if not dataclasses.is_dataclass(v)]
