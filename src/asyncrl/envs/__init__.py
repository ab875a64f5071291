"""Environments: the interface (``base``), built-ins (``reverse_text``) and weighted mixtures (``mixture``)."""

from asyncrl.envs.base import Environment, env_class, register_env
from asyncrl.envs.mixture import PromptSampler, build_envs

__all__ = ["Environment", "PromptSampler", "build_envs", "env_class", "register_env"]
