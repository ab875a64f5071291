"""CLI errors that guide: every invalid key, group option, path or combination stops before anything
starts, with the key, the value and what is allowed, exit 2 and no traceback."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path

import pytest

from asyncrl.config import ConfigError
from asyncrl.config.compose import compose_config
from asyncrl.config.preflight import dir_problem, preflight
from asyncrl.launcher.rl import Progress
from asyncrl.paths import RunDir
from helpers.launch import asyncrl


def refused(*args: str, cwd=None) -> str:
    proc = asyncrl(*args, timeout=120, cwd=cwd)
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc.stderr


@pytest.mark.parametrize("override", ["trainer.optim.lrr=1", "+trainer.optim.lrr=1"])
def test_a_mistyped_key_is_refused_with_a_suggestion_even_with_plus(override):
    err = refused("rl", override, "--cfg")
    assert "trainer.optim.lrr is not a config key" in err and "did you mean trainer.optim.lr?" in err
    assert "+trainer" not in err  # Hydra's hint, which then silently dropped the key


def test_keys_below_a_value_and_unknown_top_level_keys():
    assert "did you mean max_steps?" in refused("rl", "max_step=3", "--cfg")
    assert "is a value (float), not a section" in refused("rl", "trainer.optim.lr.x=1", "--cfg")


@pytest.mark.parametrize("group,option", [("env", "[nope]"), ("model", "nope"), ("experiment", "nope")])
def test_an_unknown_group_option_lists_the_available_ones(group, option):
    err = refused("rl", f"{group}={option}", "--cfg")
    assert f"no such option in config group '{group}'" in err and "available:" in err
    if group == "env":
        assert "reverse_text" in err


def test_free_form_keys_and_user_groups_are_accepted(tmp_path):
    (tmp_path / "env").mkdir()
    (tmp_path / "env" / "mine.yaml").write_text("mine:\n  type: reverse_text\n")
    # a new key of a free-form dict (env.<name>.args) takes Hydra's `+`
    cfg = compose_config(["env=[reverse_text,mine]", "+env.mine.args.min_len=2"], [tmp_path])
    assert cfg.env["mine"].args["min_len"] == 2


def test_conflicting_env_args_are_refused_by_every_command_before_it_starts(tmp_path):
    args = ("env.reverse_text.args.min_len=9", "env.reverse_text.args.max_len=3", f"data_dir={tmp_path}/d")
    for command in ("prepare", "rl", "eval"):
        assert "env.reverse_text.args.min_len=9 > max_len=3" in refused(command, *args)


def test_an_unimportable_environment_names_its_key_and_the_fix(tmp_path):
    err = refused("prepare", "env.reverse_text.type=no_such_pkg.tasks:Env", f"data_dir={tmp_path}")
    assert "env.reverse_text.type=no_such_pkg.tasks:Env: cannot import no_such_pkg.tasks" in err
    assert "pip install -e" in err


def test_paths_that_cannot_be_written_and_missing_data(tmp_path):
    (tmp_path / "file").write_text("")
    assert dir_problem(tmp_path / "file") == "exists and is not a directory"
    assert "is a file" in dir_problem(tmp_path / "file" / "sub" / "run")
    assert dir_problem(tmp_path / "new" / "run") is None
    assert "cannot be created" in dir_problem(Path("/proc/asyncrl-nope"))  # /proc takes no directory, even from root
    cfg = compose_config([f"run_dir={tmp_path / 'file' / 'run'}", f"data_dir={tmp_path / 'nodata'}"])
    with pytest.raises(ConfigError) as e:
        preflight(cfg, "rl")
    assert f"run_dir={tmp_path / 'file' / 'run'}: cannot be created" in str(e.value)
    assert "no task data" in str(e.value) and "run `asyncrl prepare`" in str(e.value)
    err = refused("eval", f"data_dir={tmp_path / 'nodata'}", f"eval.out_dir={tmp_path / 'file'}")
    assert "eval.out_dir=" in err and "no task data" in err


def test_an_unreachable_sidecar_says_so_and_names_the_key(caplog):
    from asyncrl.orchestrator.client import InferencePool

    pool = InferencePool(["http://127.0.0.1:9"], "m", 5.0, 4, None, {})

    async def wait():
        try:
            await pool.wait_healthy(0.5)
        finally:
            await pool.close()

    with pytest.raises(ConfigError, match=r"inference.urls=\['http://127.0.0.1:9'\]: no sidecar answered"):
        asyncio.run(wait())


def test_the_launcher_warns_once_when_most_samples_are_truncated(tmp_path, caplog):
    run = RunDir(tmp_path / "run").create()
    rows = [{"step": s, "time": 0.0, "rollout/truncated": 200} for s in range(3)]
    run.metrics_file("orchestrator").write_text("".join(json.dumps(r) + "\n" for r in rows))
    progress = Progress(run, enabled=False, max_steps=3, samples_per_step=256, seq_len=64)
    with caplog.at_level(logging.WARNING):
        progress.update()
        progress.update()
    assert caplog.text.count("200 of 256 samples were cut at seq_len=64") == 1
