"""Config keys that moved, kept working for one release: an old key given on the command line or found in a
config file (a run directory's ``configs/config.yaml`` written before the move) is read as its new key, with
a warning naming both. The old keys go in the next release."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("asyncrl.config")

# old key -> new key
RENAMED = {
    "weights.nccl_host": "weights.nccl.host",
    "weights.nccl_port": "weights.nccl.port",
    "trainer.loss.dppo_mask_low": "trainer.loss.dppo_kl.mask_low",
    "trainer.loss.dppo_mask_high": "trainer.loss.dppo_kl.mask_high",
    "trainer.loss.clip_low": "trainer.loss.grpo.clip_low",
    "trainer.loss.clip_high": "trainer.loss.grpo.clip_high",
    "trainer.loss.gspo_clip_low": "trainer.loss.gspo.clip_low",
    "trainer.loss.gspo_clip_high": "trainer.loss.gspo.clip_high",
    "trainer.loss.cispo_clip_high": "trainer.loss.cispo.clip_high",
}


def _warn(old: str, new: str) -> None:
    log.warning(f"{old} is deprecated: use {new} (the old key goes in the next release)")


def renamed_overrides(overrides: Sequence[str]) -> list[str]:
    """``overrides`` with every old key (``key=value``, ``+key=...``, ``~key``) written as its new one."""
    out = []
    for text in overrides:
        prefix = text[: len(text) - len(text.lstrip("+~"))]
        key, eq, value = text[len(prefix) :].partition("=")
        if key in RENAMED:
            _warn(key, RENAMED[key])
            text = f"{prefix}{RENAMED[key]}{eq}{value}"
        out.append(text)
    return out


def renamed_node(node: DictConfig) -> DictConfig:
    """A loaded config with every old key moved to its new place (the new key's value wins when both are
    there)."""
    for old, new in RENAMED.items():
        parent, _, leaf = old.rpartition(".")
        section = OmegaConf.select(node, parent)
        if isinstance(section, DictConfig) and leaf in section:
            _warn(old, new)
            value = section.pop(leaf)
            if OmegaConf.select(node, new) is None:
                OmegaConf.update(node, new, value, force_add=True)
    return node
