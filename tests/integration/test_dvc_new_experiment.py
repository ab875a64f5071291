"""`asyncrl new experiment` end to end: the folder it writes reproduces with `dvc repro`, and a sweep from
inside it queues DVC experiments (the shrunk pipeline of tests/helpers/dvc_project.py, in a throwaway git
repository)."""

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


def test_a_new_experiment_folder_reproduces(project):
    """``asyncrl new experiment`` (the shrunk task at another SFT length): ``dvc repro`` of the folder runs
    every stage into the experiment's own outputs, a second reruns nothing, and the root pipeline is
    untouched. (Which environment packages its stages depend on is tests/unit/test_new_experiment.py's.)"""
    repo, env = project
    made = subprocess.run(
        ["asyncrl", "new", "experiment", "short_sft", "--env", "reverse_text", *SHRUNK, "sft.max_steps=8"],
        cwd=repo / "experiments",
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    pipeline = "experiments/short_sft/dvc.yaml"
    first = dvc(repo, env, "repro", pipeline)
    assert [s for s in STAGES if f"Running stage '{pipeline}:{s}'" in first.stdout] == STAGES, first.stdout
    lock = yaml.safe_load((repo / "experiments" / "short_sft" / "dvc.lock").read_text())["stages"]
    assert {o["path"] for o in lock["rl"]["outs"]} == {
        "outputs/short_sft/rl/model",
        "outputs/short_sft/rl/metrics/curves.csv",
    }
    assert lock["sft"]["params"]["experiments/short_sft/params.yaml"]["sft"]["max_steps"] == 8
    metrics = json.loads((repo / "outputs" / "short_sft" / "eval_rl" / "metrics.json").read_text())
    assert metrics["reverse_text/num_examples"] == 8
    again = dvc(repo, env, "repro", pipeline)
    assert "Running stage" not in again.stdout and "up to date" in again.stdout, again.stdout
    root_lock = subprocess.run(
        ["git", "status", "--porcelain", "dvc.lock"], cwd=repo, capture_output=True, text=True
    )
    assert root_lock.stdout == "" and not (repo / "outputs" / "reverse_text").exists()

    # a sweep from inside the folder: queued as DVC experiments of its pipeline, once the folder is committed
    sweep = ["asyncrl", "rl", "-m", "trainer.optim.lr=1e-4,3e-4"]
    run = dict(cwd=repo / "experiments" / "short_sft", env=env, capture_output=True, text=True, timeout=300)
    refused = subprocess.run(sweep, **run)
    assert refused.returncode == 2 and "experiments/short_sft is not committed" in refused.stderr, (
        refused.stderr
    )
    for cmd in (["add", "-A"], ["commit", "-q", "-m", "experiment short_sft"]):
        subprocess.run(["git", *cmd], cwd=repo, env=env, check=True)
    queued = subprocess.run(sweep, **run)
    assert queued.returncode == 0 and queued.stdout.count("sweep: queued run") == 2, (
        queued.stdout + queued.stderr
    )
    status = dvc(repo, env, "queue", "status").stdout
    assert status.count("Queued") == 2, status
