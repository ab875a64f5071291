"""Typed, torch-free configuration: schema (``sections``, ``root``), bounds (``fields``), loading (``compose``)."""

from asyncrl.config.fields import ConfigError, describe, validate
from asyncrl.config.root import Config, check_config, resume_step

__all__ = ["Config", "ConfigError", "check_config", "describe", "resume_step", "validate"]
