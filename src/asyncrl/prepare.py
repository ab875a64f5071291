"""``asyncrl prepare``: write each environment's data splits and build the tiny default model.

Outputs (deterministic in ``seed``): ``<data_dir>/<env>/<split>.jsonl`` and, when ``model.init.build``,
a random-init HF model directory with a character tokenizer at ``model.name``.
"""

from __future__ import annotations

import json
from pathlib import Path

from asyncrl.config import Config
from asyncrl.envs import build_envs
from asyncrl.models.hf import build_tiny_model
from asyncrl.numerics import configure_torch
from asyncrl.paths import data_file
from asyncrl.utils.atomic import write_text_atomic
from asyncrl.utils.process import exit_wrapper, setup_logging


@exit_wrapper("prepare")
def main(cfg: Config, overrides: list[str] | None = None) -> None:
    log = setup_logging("prepare")
    for name, env in build_envs(cfg.env, cfg.data_dir).items():
        for split in env.splits:
            rows = env.generate(split, cfg.seed)
            path = data_file(cfg.data_dir, name, split)
            write_text_atomic(path, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
            log.info(f"env {name}: {len(rows)} {split} examples -> {path}")
    if cfg.model.init.build:
        configure_torch(cfg.numerics, 1)
        out = build_tiny_model(cfg.model.init, Path(cfg.model.name), cfg.seed)
        log.info(f"model: random-init {cfg.model.init.architecture} -> {out}")
