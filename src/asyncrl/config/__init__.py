"""Typed, torch-free configuration: the schema (one module per process, and ``root``), bounds (``fields``),
loading (``compose``)."""

from asyncrl.config.fields import ConfigError, describe, validate
from asyncrl.config.root import Config, check_config, resume_step

__all__ = ["Config", "ConfigError", "check_config", "describe", "resume_step", "validate"]
