"""Config: composition, overrides, and errors that name the key (through the real CLI)."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose_config, load_config_file, to_yaml
from asyncrl.config.renamed import RENAMED
from helpers.launch import asyncrl


def test_default_composes_and_experiment_overrides():
    cfg = compose_config([])
    assert cfg.model.name == "outputs/models/tiny" and "reverse_text" in cfg.env
    exp = compose_config(["experiment=reverse_text", "trainer.optim.lr=3e-6"])
    assert exp.name == "reverse_text" and exp.run_dir == "outputs/reverse_text/rl"
    assert exp.trainer.optim.lr == 3e-6 and exp.env["reverse_text"].args["max_len"] == 20


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).parents[2] / "conf" / "experiment").glob("*.yaml")), ids=str
)
def test_every_shipped_experiment_composes(path):
    """Each `experiment=<name>` the repository ships composes and validates, and its runs write under its
    name."""
    cfg = compose_config([f"experiment={path.stem}"])
    assert cfg.name == path.stem and cfg.run_dir.startswith(f"outputs/{path.stem}/")


@pytest.mark.parametrize(
    "path", sorted((Path(__file__).parents[2] / "conf" / "env").glob("*.yaml")), ids=str
)
def test_every_shipped_environment_option_composes_and_builds(path, tmp_path):
    """Each `env=[<name>]` the repository ships composes, and its environment accepts its args."""
    from asyncrl.envs import build_envs

    cfg = compose_config([f"env=[{path.stem}]"])
    envs = build_envs(cfg.env, tmp_path)
    assert list(envs) == [path.stem]


def test_resolved_file_round_trips(tmp_path):
    cfg = compose_config(["experiment=reverse_text", "seed=7"])
    path = tmp_path / "config.yaml"
    path.write_text(to_yaml(cfg))
    again = load_config_file(path, ["max_steps=3"])
    assert again.seed == 7 and again.max_steps == 3 and again.env == cfg.env


@pytest.mark.parametrize(
    "override, key, what",
    [
        ("trainer.optim.lrr=1", "trainer.optim.lrr", "is not a config key"),
        ("trainer.optim.lr=abc", "trainer.optim.lr", "could not be converted"),
        ("trainer.optim.lr=-1", "trainer.optim.lr", "out of range"),
        ("orchestrator.group_size=0", "orchestrator.group_size", "out of range"),
        ("trainer.loss.type=ppo", "trainer.loss.type", "allowed values: 'dppo_kl', 'grpo'"),
        ("model=nope", "model", "available: gpu_small"),
        ("ckpt.resume=yesterday", "ckpt.resume", "allowed values"),
        ("async_level=3", "trainer.keep_weights", "async_level + 2"),
        (
            "trainer.fabric.activation_checkpointing_every=2",
            "trainer.fabric.activation_checkpointing_every",
            "activation_checkpointing=true",
        ),
        (
            "trainer.fabric.activation_checkpointing_saves=matmuls",
            "trainer.fabric.activation_checkpointing_saves",
            "activation_checkpointing=true",
        ),
        (
            "trainer.fabric.activation_checkpointing_saves=all",
            "trainer.fabric.activation_checkpointing_saves",
            "allowed values: 'nothing', 'matmuls', 'matmuls_and_attention'",
        ),
    ],
)
def test_invalid_overrides_fail_naming_the_key(override, key, what):
    with pytest.raises(ConfigError) as e:
        compose_config([override])
    assert key in str(e.value) and what in str(e.value)


def test_difficulty_filter_bounds_must_leave_something():
    bounds = ["orchestrator.difficulty.min_reward=0.8", "orchestrator.difficulty.max_reward=0.2"]
    with pytest.raises(ConfigError) as e:
        compose_config(["orchestrator.difficulty.enabled=true", *bounds])
    assert "orchestrator.difficulty.min_reward=0.8" in str(e.value) and "max_reward=0.2" in str(e.value)
    assert not compose_config(bounds).orchestrator.difficulty.enabled  # off: the bounds are not used


def test_adaptive_kl_needs_a_starting_beta():
    with pytest.raises(ConfigError) as e:
        compose_config(["trainer.kl.target_kl=0.01"])
    assert "trainer.kl.target_kl=0.01" in str(e.value) and "trainer.kl.beta" in str(e.value)
    assert compose_config(["trainer.kl.target_kl=0.01", "trainer.kl.beta=0.1"]).trainer.kl.beta == 0.1


def test_cli_invalid_override_exits_nonzero_with_message():
    for override, key in (
        ("trainer.optim.lrr=1", "trainer.optim.lrr"),
        ("trainer.optim.lr=abc", "trainer.optim.lr"),
        ("orchestrator.top_p=2", "orchestrator.top_p"),
    ):
        proc = asyncrl("rl", override, timeout=60)
        assert proc.returncode == 2, proc.stderr
        assert key in proc.stderr and "error: invalid config" in proc.stderr


def test_help_is_fast_and_does_not_import_torch():
    code = (
        "import sys, asyncrl.cli as c; c.main(['--help']); "
        "assert 'torch' not in sys.modules and 'hydra' not in sys.modules"
    )
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    assert time.monotonic() - start < 1.0
    for name in ("rl", "serve", "orchestrate", "train", "sft", "eval", "prepare"):
        assert name in proc.stdout


def test_command_help_lists_documented_keys():
    proc = asyncrl("rl", "--help", timeout=60)
    assert proc.returncode == 0
    assert "trainer.optim.lr" in proc.stdout and "peak learning rate" in proc.stdout


def test_unknown_command():
    proc = asyncrl("fly", timeout=30)
    assert proc.returncode == 2 and "unknown command" in proc.stderr


def test_user_config_dir_adds_environments_and_experiments(tmp_path):
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "upper.yaml").write_text(
        "# @package env.upper\ntype: mypkg.upper:Upper\nweight: 0.5\n"
    )
    (tmp_path / "experiment").mkdir()
    (tmp_path / "experiment" / "mine.yaml").write_text("# @package _global_\nname: mine\nseed: 3\n")
    cfg = compose_config(["env=[reverse_text,upper]", "experiment=mine", "+env.upper.args.n=5"], [tmp_path])
    assert cfg.env["upper"].type == "mypkg.upper:Upper" and cfg.env["upper"].args == {"n": 5}
    assert cfg.name == "mine" and cfg.seed == 3 and "reverse_text" in cfg.env
    proc = asyncrl("prepare", "--config-dir", str(tmp_path), "experiment=mine", "--cfg", timeout=60)
    assert proc.returncode == 0 and "name: mine" in proc.stdout
    with pytest.raises(ConfigError, match="not a directory"):
        compose_config([], [tmp_path / "nope"])


def _another(value):
    """A value of ``value``'s type that differs from it."""
    return "10.0.0.9" if isinstance(value, str) else value + 1 if isinstance(value, int) else value * 0.5


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_every_moved_key_is_read_as_its_new_one(old, tmp_path, caplog):
    """Each key in the map of renamed keys (into per-variant sections: ``weights.nccl.*``,
    ``trainer.loss.<name>.*``) is read as its new key, on the command line and in a config file that still
    has the old key."""
    import logging

    from omegaconf import OmegaConf

    new = RENAMED[old]
    value = _another(OmegaConf.select(OmegaConf.structured(compose_config([])), new))
    with caplog.at_level(logging.WARNING, logger="asyncrl.config"):
        cfg = compose_config([f"{old}={value}"])
    assert OmegaConf.select(OmegaConf.structured(cfg), new) == value
    assert f"{old} is deprecated: use {new}" in caplog.text
    written = OmegaConf.create(to_yaml(compose_config([])))
    parent, _, leaf = new.rpartition(".")
    OmegaConf.select(written, parent).pop(leaf)
    OmegaConf.update(written, old, value, force_add=True)
    OmegaConf.save(written, tmp_path / "config.yaml")
    loaded = load_config_file(tmp_path / "config.yaml")
    assert OmegaConf.select(OmegaConf.structured(loaded), new) == value
    again = load_config_file(tmp_path / "config.yaml", [f"{old}={_another(value)}"])
    assert OmegaConf.select(OmegaConf.structured(again), new) == _another(value)
