"""Importing this module registers the built-in environments (``vf_env`` imports verifiers only when used)."""

from asyncrl.envs import code, reverse_text, verifiable, vf_env  # noqa: F401
