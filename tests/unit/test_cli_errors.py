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
from asyncrl.config.invariants import learning_problems
from asyncrl.launcher.preflight import dir_problem, preflight
from asyncrl.launcher.progress import Progress
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


@pytest.mark.parametrize("plus", ["", "+"])
def test_a_mistyped_environment_argument_gets_a_suggestion_with_or_without_plus(plus, tmp_path):
    err = refused("prepare", f"{plus}env.reverse_text.args.max_lenn=9", f"data_dir={tmp_path}", "--cfg")
    assert "env.reverse_text.args.max_lenn is not a config key" in err
    assert "did you mean env.reverse_text.args.max_len" in err and "allowed: min_len, max_len" in err
    assert "+env" not in err


@pytest.mark.parametrize("plus", ["", "+"])
def test_a_mistyped_key_of_a_nested_section_or_an_entry_gets_a_suggestion(plus):
    err = refused("rl", f"{plus}orchestrator.difficulty.min_rewrd=0.1", "--cfg")
    assert (
        "did you mean orchestrator.difficulty.min_reward or" in err and "allowed: enabled, min_reward" in err
    )
    err = refused("rl", f"{plus}env.reverse_text.wieght=2", "--cfg")
    assert "did you mean env.reverse_text.weight?" in err and "allowed: type, weight, args" in err
    err = refused("rl", f"{plus}env.revers_text.args.max_len=9", "--cfg")
    assert "env has no key 'revers_text'; did you mean env.reverse_text?" in err


def test_an_existing_environment_argument_is_set_with_or_without_plus():
    for plus in ("", "+"):
        assert (
            compose_config([f"{plus}env.reverse_text.args.max_len=9"]).env["reverse_text"].args["max_len"]
            == 9
        )


def test_a_configuration_that_cannot_learn_is_refused_and_one_without_reward_warned(tmp_path):
    err = refused("rl", "orchestrator.group_size=1", "--cfg")
    assert "orchestrator.group_size=1 with orchestrator.drop_zero_advantage=true" in err
    assert "every group is dropped" in err
    no_reward = (
        "orchestrator.group_size=1",
        "orchestrator.drop_zero_advantage=false",
        f"run_dir={tmp_path}/run",
    )
    proc = asyncrl("train", *no_reward, "--cfg", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (
        "warning: orchestrator.group_size=1: every advantage is 0" in proc.stderr
        and "learns from no reward" in (proc.stderr)
    )
    cfg = compose_config(["trainer.loss.adv_tau=0", "distill.teacher=outputs/models/tiny"])
    assert learning_problems(cfg) == (
        [],
        [
            "trainer.loss.adv_tau=0: the policy-gradient term is off, so the run learns from the teacher "
            "(distill.*) only, not from rewards"
        ],
    )


def test_cfg_checks_what_a_launch_would_and_creates_nothing(tmp_path):
    err = refused(
        "prepare", "env.reverse_text.type=no_such_pkg.tasks:Env", f"data_dir={tmp_path}/d", "--cfg"
    )
    assert "cannot import no_such_pkg.tasks" in err
    assert "no task data" in refused("rl", f"data_dir={tmp_path}/nodata", f"run_dir={tmp_path}/run", "--cfg")
    proc = asyncrl("prepare", f"data_dir={tmp_path}/d", "--cfg", timeout=120)
    assert proc.returncode == 0 and f"data_dir: {tmp_path}/d" in proc.stdout, proc.stderr
    assert not (tmp_path / "d").exists()


@pytest.mark.parametrize("command", ["compare", "curves"])
def test_the_analysis_commands_have_real_help(command):
    proc = asyncrl(command, "--help", timeout=60)
    assert proc.returncode == 0 and f"usage: asyncrl {command}" in proc.stdout, proc.stderr
    assert command in asyncrl("--help", timeout=60).stdout


def test_compare_prints_eval_metrics_side_by_side(tmp_path):
    for name, reward in (("eval_sft", 0.25), ("eval_rl", 0.5)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.json").write_text(json.dumps({"eval/reward_mean": reward, "n": 3}))
    proc = asyncrl("compare", str(tmp_path / "eval_sft"), str(tmp_path / "eval_rl"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [
        "metric              eval_sft     eval_rl",
        "eval/reward_mean      0.2500      0.5000",
    ]
    assert "no eval metrics" in refused("compare", str(tmp_path / "nowhere"))


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


def test_a_taskset_argument_mistake_names_the_key_the_allowed_names_and_the_closest(tmp_path):
    """A verifiers taskset's arguments are checked by its pydantic config; its errors come in the project's
    form."""
    calc = "env.vf_calculator.args.taskset_args"
    err = refused("prepare", "env=[vf_calculator]", f"+{calc}.num_task=3", f"{calc}.max_operand=x",
                  f"data_dir={tmp_path}/d")  # fmt: skip
    assert f"{calc}.num_task is not a config key" in err and f"did you mean {calc}.num_tasks" in err
    assert "allowed: task, system_prompt, num_tasks, seed, max_operand, operators, instructions" in err
    assert f"{calc}.max_operand='x': Input should be a valid integer" in err
    assert "validation error" not in err and "Extra inputs" not in err  # not pydantic's own text


def test_a_refused_launch_leaves_no_directory_behind(tmp_path):
    """The run directory is tried for real (created, written) before the other checks; when they refuse the
    launch, what the check created goes again, and a directory that was there stays."""
    err = refused("rl", f"data_dir={tmp_path}/nodata", f"run_dir={tmp_path}/runs/a/run")
    assert "no task data" in err and not (tmp_path / "runs").exists()
    (tmp_path / "kept").mkdir()
    refused("rl", f"data_dir={tmp_path}/nodata", f"run_dir={tmp_path}/kept/run")
    assert (tmp_path / "kept").is_dir() and not (tmp_path / "kept" / "run").exists()


def test_an_unimportable_environment_names_its_key_and_the_fix(tmp_path):
    err = refused("prepare", "env.reverse_text.type=no_such_pkg.tasks:Env", f"data_dir={tmp_path}")
    assert "env.reverse_text.type=no_such_pkg.tasks:Env: cannot import no_such_pkg.tasks" in err
    assert "pip install -e" in err


def test_paths_that_cannot_be_written_and_missing_data(tmp_path):
    (tmp_path / "file").write_text("")
    assert dir_problem(tmp_path / "file") == "exists and is not a directory"
    assert "is a file" in dir_problem(tmp_path / "file" / "sub" / "run")
    assert dir_problem(tmp_path / "new" / "run") is None
    # /proc takes no directory, even from root
    assert "cannot be created" in dir_problem(Path("/proc/asyncrl-nope"))
    cfg = compose_config([f"run_dir={tmp_path / 'file' / 'run'}", f"data_dir={tmp_path / 'nodata'}"])
    with pytest.raises(ConfigError) as e:
        preflight(cfg, "rl")
    assert f"run_dir={tmp_path / 'file' / 'run'}: cannot be created" in str(e.value)
    assert "no task data" in str(e.value) and "run `asyncrl prepare`" in str(e.value)
    err = refused("eval", f"data_dir={tmp_path / 'nodata'}", f"eval.out_dir={tmp_path / 'file'}")
    assert "eval.out_dir=" in err and "no task data" in err


def test_an_unreachable_sidecar_says_so_and_names_the_key(caplog):
    from asyncrl.rollouts.client import InferencePool

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


def test_the_progress_line_numbers_steps_as_the_metrics_do_and_says_why_nothing_trains(
    tmp_path, capsys, caplog
):
    run = RunDir(tmp_path / "run").create()
    rows = [{"step": 0, "time": 0.0, "rollout/reward_mean": 1.0, "rollout/dropped_groups": 4}]
    run.metrics_file("orchestrator").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run.metrics_file("trainer").write_text(json.dumps({"step": 0, "time": 0.0, "train/loss": 0.0}) + "\n")
    progress = Progress(run, enabled=True, max_steps=3, groups_per_step=4)
    progress.tty = False
    with caplog.at_level(logging.WARNING):
        progress.update()
        progress.update()
    (line,) = capsys.readouterr().out.splitlines()
    # step 0, as in trainer.jsonl
    assert line.startswith("step 0 (1/3 done) | reward 1.000 (rollout step 0)")
    assert line.endswith(
        "rollout step 0: all 4 groups dropped (4 with zero advantage (equal rewards in "
        "the group)), nothing to train on"
    )
    assert caplog.text.count("all 4 groups dropped") == 1
    filtered = {"rollout/dropped_groups": 4, "rollout/filtered_too_hard": 3, "rollout/filtered_too_easy": 0}
    assert progress.all_dropped(filtered) == (
        "all 4 groups dropped (1 with zero advantage (equal rewards in the group), 3 "
        "too hard), nothing to train on"
    )
    assert progress.all_dropped({"rollout/dropped_groups": 3}) is None


def test_each_command_runs_the_module_named_after_it():
    """`asyncrl X` runs `main` (or `cli`, for the commands with their own options) of the module named X, so
    the entry of a command is found by its name and no two entry modules share one."""
    import importlib

    from asyncrl.cli import COMMANDS, OWN_OPTIONS

    for command, (module, _) in COMMANDS.items():
        assert module.rsplit(".", 1)[-1] == command.replace("-", "_"), (command, module)
        entry = "cli" if command in OWN_OPTIONS else "main"
        assert callable(getattr(importlib.import_module(module), entry)), (command, module, entry)
