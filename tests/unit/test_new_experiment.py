"""``asyncrl new experiment``: what it writes (the Hydra experiment, its resolved params, a pipeline made
from the root one, a README) in a copy of this repository's conf/ and dvc.yaml, and what it refuses before
writing anything. That the folder then reproduces with ``dvc repro`` is
tests/integration/test_dvc_new_experiment.py's."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from asyncrl.config.compose import compose_config, to_yaml
from asyncrl.launcher import new as new_experiment

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo(tmp_path) -> Path:
    """The parts of a checkout the command reads: conf/, dvc.yaml, and the calculator environment's
    package."""
    shutil.copytree(ROOT / "conf", tmp_path / "conf")
    shutil.copy(ROOT / "dvc.yaml", tmp_path / "dvc.yaml")
    (tmp_path / "environments" / "calculator" / "asyncrl_calculator").mkdir(parents=True)
    (tmp_path / "environments" / "tool_agents" / "asyncrl_tool_agents").mkdir(parents=True)
    return tmp_path


def test_the_stages_depend_on_the_code_an_environment_names(repo):
    """A verifiers taskset's package, and an agent's: the package of each import path its args name."""
    for env, package in (
        ("vf_calculator", "environments/calculator"),
        ("adder_pydantic_ai", "environments/tool_agents"),
    ):
        cfg = compose_config([f"env=[{env}]"], [repo / "conf"])
        assert new_experiment.env_packages(repo, cfg) == [package], env
    assert new_experiment.env_packages(repo, compose_config(["env=[reverse_text]"], [repo / "conf"])) == []


def test_an_experiment_folder_from_one_command(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo / "environments")  # run from anywhere inside the repository
    assert (
        new_experiment.cli(
            ["experiment", "calc", "--env", "vf_calculator", "max_steps=7", "sft.optim.lr=3e-4"]
        )
        == 0
    )
    assert "next: dvc repro experiments/calc/dvc.yaml" in capsys.readouterr().out
    conf = yaml.safe_load((repo / "conf" / "experiment" / "calc.yaml").read_text())
    assert {"override /env": ["vf_calculator"]} in conf["defaults"] and conf["defaults"][-1] == "_self_"
    cfg = compose_config(["experiment=calc"], [repo / "conf"])
    assert (repo / "experiments" / "calc" / "params.yaml").read_text() == to_yaml(cfg)
    # the root pipeline's settings, its own places, the overrides given
    root_cfg = compose_config(["experiment=reverse_text"])
    assert list(cfg.env) == ["vf_calculator"] and cfg.max_steps == 7 and cfg.sft.optim.lr == 3e-4
    assert cfg.seq_len == root_cfg.seq_len and cfg.sft.max_steps == root_cfg.sft.max_steps
    assert cfg.numerics == "reproducible" and cfg.name == "calc"
    assert cfg.data_dir.startswith(cfg.output_dir) and cfg.model.name.startswith(cfg.output_dir)
    assert cfg.output_dir != root_cfg.output_dir
    spec = yaml.safe_load((repo / "experiments" / "calc" / "dvc.yaml").read_text())
    root_spec = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    assert spec["stages"].keys() == root_spec["stages"].keys()
    assert spec["vars"] == ["params.yaml", {"P": "experiments/calc/params.yaml"}]
    for name, stage in spec["stages"].items():
        inner = stage.get("do", stage)
        assert inner["wdir"] == "../.." and "--config-file ${P}" in str(inner["cmd"]), name
        assert "params.yaml" not in str(inner["cmd"]).replace("${P}", ""), name
        assert list(inner["params"][0]) == ["${P}"], name
        reads_env = "env" in inner["params"][0]["${P}"]
        assert ("environments/calculator" in inner["deps"]) == reads_env, name
    assert all(path.startswith("../../") for item in spec["plots"] for p in item.values() for path in p["y"])
    readme = (repo / "experiments" / "calc" / "README.md").read_text()
    assert "**Question.**" in readme and "-S experiments/calc/params.yaml:" in readme


def test_without_env_it_keeps_the_root_pipelines_environment(repo, monkeypatch):
    monkeypatch.chdir(repo)
    assert new_experiment.cli(["experiment", "plain"]) == 0
    cfg = compose_config(["experiment=plain"], [repo / "conf"])
    assert list(cfg.env) == list(compose_config(["experiment=reverse_text"]).env)
    spec = yaml.safe_load((repo / "experiments" / "plain" / "dvc.yaml").read_text())
    assert not any(
        "environments/" in d for s in spec["stages"].values() for d in s.get("do", s).get("deps", [])
    )


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["experiment", "Bad-Name"], "lowercase letters, digits and _"),
        (["experiment", "calc", "--env", "nope"], "--env nope: no conf/env/nope.yaml (environments: "),
        (["experiment", "calc", "trainer.optim.lrr=1"], "lrr"),
        (["experiment", "calc", "+extra=1"], "expected key=value"),
    ],
)
def test_refusals_name_the_problem_and_leave_nothing(repo, monkeypatch, capsys, argv, says):
    monkeypatch.chdir(repo)
    before = sorted(p.relative_to(repo) for p in repo.rglob("*"))
    assert new_experiment.cli(argv) == 2
    assert says in capsys.readouterr().err
    assert sorted(p.relative_to(repo) for p in repo.rglob("*")) == before


def test_an_existing_experiment_is_kept_unless_forced(repo, monkeypatch, capsys):
    monkeypatch.chdir(repo)
    assert new_experiment.cli(["experiment", "calc"]) == 0
    readme = repo / "experiments" / "calc" / "README.md"
    readme.write_text("results so far")
    assert new_experiment.cli(["experiment", "calc", "max_steps=3"]) == 2
    assert "exists" in capsys.readouterr().err and readme.read_text() == "results so far"
    assert new_experiment.cli(["experiment", "calc", "max_steps=3", "--force"]) == 0
    assert compose_config(["experiment=calc"], [repo / "conf"]).max_steps == 3
    made_by = "asyncrl new experiment calc max_steps=3\n"  # the command that remakes it on a clone
    assert f"Made by: {made_by}" in (repo / "conf" / "experiment" / "calc.yaml").read_text()
    assert f"#   {made_by}" in (repo / "experiments" / "calc" / "dvc.yaml").read_text()


def test_outside_a_repository_it_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert new_experiment.cli(["experiment", "calc"]) == 2
    assert "not inside an asyncrl repository" in capsys.readouterr().err


def test_a_sweep_inside_an_experiment_folder_becomes_dvc_experiments(repo, monkeypatch, capsys):
    """``-m`` from inside experiments/NAME/: every combination checked against the folder's params file, then
    one ``dvc exp run --queue`` of the folder's pipeline each (``--cfg`` lists them); a mistake refuses them
    all."""
    from asyncrl.cli import main
    from asyncrl.launcher import dvc_sweep

    monkeypatch.chdir(repo)
    assert new_experiment.cli(["experiment", "calc"]) == 0
    folder = repo / "experiments" / "calc"
    (folder / "notes").mkdir()
    assert (
        dvc_sweep.experiment_folder(folder / "notes") == folder and dvc_sweep.experiment_folder(repo) is None
    )
    monkeypatch.chdir(folder / "notes")
    capsys.readouterr()
    assert main(["rl", "-m", "trainer.optim.lr=1e-4,3e-4", "seed=1", "--cfg"]) == 0
    params = "experiments/calc/params.yaml"
    assert capsys.readouterr().out.splitlines() == [
        f"run {i}: dvc exp run --queue experiments/calc/dvc.yaml -S "
        f"{params}:trainer.optim.lr={lr} -S {params}:seed=1"
        for i, lr in enumerate(["0.0001", "0.0003"])  # as Hydra's sweeper writes them
    ]
    assert main(["rl", "-m", "trainer.optim.lrr=1e-4,3e-4"]) == 2
    err = capsys.readouterr().err
    assert "nothing was queued" in err and "run 0 (trainer.optim.lrr=0.0001)" in err and "lrr" in err
    assert main(["rl", "-m", "seed=1"]) == 2 and "needs a swept key" in capsys.readouterr().err
    monkeypatch.setattr(dvc_sweep, "committed", lambda folder: False)
    assert main(["rl", "-m", "seed=1,2"]) == 2
    assert "experiments/calc is not committed" in capsys.readouterr().err
