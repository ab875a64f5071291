"""Importing this module registers the built-in environments (``vf_env`` imports verifiers only when used)."""

from asyncrl.envs import reverse_text, verifiable, vf_env  # noqa: F401
