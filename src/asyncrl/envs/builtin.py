"""Importing this module registers the built-in environments."""

from asyncrl.envs import reverse_text  # noqa: F401
