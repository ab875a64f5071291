"""`asyncrl new experiment` end to end: the folder it writes reproduces with `dvc repro`, and a sweep from inside it
queues DVC experiments (the shrunk pipeline of tests/helpers/dvc_project.py, in a throwaway git repository)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from helpers.dvc_project import SHRUNK, STAGES, dvc, make_project

pytestmark = pytest.mark.slow


@pytest.fixture
def project(tmp_path) -> tuple[Path, dict]:
    return make_project(tmp_path)


CALC = [  # the calculator environment at the micro model's size: no system prompt, two turns
    "env.vf_calculator.args.taskset_args.num_tasks=40",
    "env.vf_calculator.args.taskset_args.instructions=null",
    "env.vf_calculator.args.num_eval=4",
    "env.vf_calculator.args.max_turns=2",
]


def test_a_new_experiment_folder_reproduces(project):
    """``asyncrl new experiment`` for the calculator (a verifiers environment): ``dvc repro`` of the folder runs
    every stage into the experiment's own outputs, a second reruns nothing, and the root pipeline is untouched."""
    repo, env = project
    shrunk = [o for o in SHRUNK if not o.startswith("env.")]
    made = subprocess.run(
        ["asyncrl", "new", "experiment", "calc", "--env", "vf_calculator", *CALC, *shrunk],
        cwd=repo / "experiments",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    pipeline = "experiments/calc/dvc.yaml"
    first = dvc(repo, env, "repro", pipeline)
    assert [s for s in STAGES if f"Running stage '{pipeline}:{s}'" in first.stdout] == STAGES, first.stdout
    lock = yaml.safe_load((repo / "experiments" / "calc" / "dvc.lock").read_text())["stages"]
    assert {o["path"] for o in lock["rl"]["outs"]} == {"outputs/calc/rl/model", "outputs/calc/rl/metrics/curves.csv"}
    assert any(d["path"] == "environments/calculator" for d in lock["rl"]["deps"])
    metrics = json.loads((repo / "outputs" / "calc" / "eval_rl" / "metrics.json").read_text())
    assert metrics["vf_calculator/num_examples"] == 4
    again = dvc(repo, env, "repro", pipeline)
    assert "Running stage" not in again.stdout and "up to date" in again.stdout, again.stdout
    root_lock = subprocess.run(["git", "status", "--porcelain", "dvc.lock"], cwd=repo, capture_output=True, text=True)
    assert root_lock.stdout == "" and not (repo / "outputs" / "reverse_text").exists()

    # a sweep from inside the folder: queued as DVC experiments of its pipeline, once the folder is committed
    sweep = ["asyncrl", "rl", "-m", "trainer.optim.lr=1e-4,3e-4"]
    run = dict(cwd=repo / "experiments" / "calc", env=env, capture_output=True, text=True, timeout=300)
    refused = subprocess.run(sweep, **run)
    assert refused.returncode == 2 and "experiments/calc is not committed" in refused.stderr, refused.stderr
    for cmd in (["add", "-A"], ["commit", "-q", "-m", "experiment calc"]):
        subprocess.run(["git", *cmd], cwd=repo, env=env, check=True)
    queued = subprocess.run(sweep, **run)
    assert queued.returncode == 0 and queued.stdout.count("sweep: queued run") == 2, queued.stdout + queued.stderr
    status = dvc(repo, env, "queue", "status").stdout
    assert status.count("Queued") == 2, status
