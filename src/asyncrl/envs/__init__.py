"""Environments: the interface (``base``), the types by name (``registry``), built-ins (``reverse_text``,
``verifiable``, ``code``, ``vf_env``) and weighted mixtures (``mixture``)."""

from asyncrl.envs.base import Environment
from asyncrl.envs.mixture import PromptSampler, build_envs
from asyncrl.envs.registry import env_class, register_env

__all__ = ["Environment", "PromptSampler", "build_envs", "env_class", "register_env"]
