"""Typed, torch-free configuration: the schema (one module per process, and ``root``), bounds (``fields``),
the invariants across sections (``invariants``), overrides checked against the schema (``overrides``) and
loading (``compose``)."""

from asyncrl.config.fields import ConfigError, describe, validate
from asyncrl.config.invariants import check_config
from asyncrl.config.layout import inference_workers
from asyncrl.config.root import Config, resume_step

__all__ = [
    "Config",
    "ConfigError",
    "check_config",
    "describe",
    "inference_workers",
    "resume_step",
    "validate",
]
