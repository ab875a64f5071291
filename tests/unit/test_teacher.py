"""The teacher client's pure part and the launcher's teacher sidecar plan (online distillation)."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.config.compose import compose_config
from asyncrl.launcher.rl import plan_teacher, sidecar_argv
from asyncrl.orchestrator.teacher import completion_slice


def test_completion_slice_takes_the_completion_tokens_logprobs():
    ids = [4, 8, 15, 16]
    answer = [None, {"8": {"logprob": -0.1}}, {"15": {"logprob": -0.2}}, {"16": {"logprob": -0.3}}]
    assert completion_slice(answer, ids, 2) == [-0.2, -0.3]
    with pytest.raises(ValueError, match="scored 3 tokens of 4"):
        completion_slice(answer[:3], ids, 2)
    with pytest.raises(ValueError, match="no logprob for token 3"):
        completion_slice([*answer[:3], {"99": {"logprob": -1.0}}], ids, 2)


def test_the_launcher_starts_a_teacher_sidecar_on_the_teacher_model():
    cfg = compose_config(["distill.teacher=/models/big", "distill.gpus=1"])
    name, port, gpus = plan_teacher(cfg)
    assert (name, gpus) == ("teacher", "1") and cfg.distill.url == f"http://127.0.0.1:{port}"
    argv = sidecar_argv(cfg, Path("run/config.yaml"), name, port)
    assert (
        "model.name=/models/big" in argv
        and "model.tokenizer=null" in argv
        and f"inference.port={port}" in argv
    )
    assert plan_teacher(compose_config([])) is None  # no teacher
    # a running one
    assert plan_teacher(compose_config(["distill.teacher=x", "distill.url=http://h:1"])) is None
