"""The DVC pipeline end to end, shrunk (tests/helpers/dvc_project.py), in a throwaway git repository.

One test, in order: `dvc repro` runs prepare -> sft -> rl -> eval; a second `dvc repro` runs nothing; forced
reruns (`dvc repro -f -s`) write the same dvc.lock (every out hashes the same); the outs go to the default
remote and come back; `dvc exp run -S` recomposes params.yaml through Hydra, reruns only the stages whose
params changed, and `dvc exp show --json` lists the experiment with its metrics; an unknown key fails naming
it.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from helpers.dvc_project import STAGES, dvc, make_project, out_hashes

pytestmark = pytest.mark.slow


@pytest.fixture
def project(tmp_path) -> tuple[Path, dict]:
    return make_project(tmp_path)


def test_repro_noop_forced_rerun_remote_and_experiment(project):
    repo, env = project
    first = dvc(repo, env, "repro")
    assert [s for s in STAGES if f"Running stage '{s}'" in first.stdout] == STAGES
    hashes = out_hashes(repo)
    assert {
        f"outputs/reverse_text/{p}"
        for p in ("sft/model", "rl/model", "rl/metrics/curves.csv", "eval_rl/metrics.json")
    } <= set(hashes)
    lock = (repo / "dvc.lock").read_text()
    curves = (repo / "outputs/reverse_text/rl/metrics/curves.csv").read_text().splitlines()
    assert curves[0].startswith("step,rollout/reward_mean,") and len(curves) == 1 + 3

    again = dvc(repo, env, "repro")
    assert "Running stage" not in again.stdout and "Data and pipelines are up to date." in again.stdout

    # sft is not forced again: its model and metrics under numerics=reproducible are test_golden.py's,
    # committed bit for bit; nor eval@sft, eval@rl's code on another model
    forced = ["prepare", "rl", "eval@rl"]
    rerun = dvc(repo, env, "repro", "-f", "-s", *forced).stdout
    assert [s for s in STAGES if f"Running stage '{s}'" in rerun] == forced, rerun
    assert (repo / "dvc.lock").read_text() == lock, (
        "a forced rerun changed dvc.lock: some out is not deterministic"
    )

    # the default remote (a directory beside the clone) round-trips every out of the pipeline (the target: in
    # a checkout, experiments/*/dvc.lock name outs that were never run there)
    dvc(repo, env, "push", "dvc.yaml")
    assert (repo.parent / "asyncrl-dvc-remote").is_dir()
    shutil.rmtree(repo / ".dvc" / "cache")
    shutil.rmtree(repo / "outputs")
    dvc(repo, env, "pull", "dvc.yaml")
    assert out_hashes(repo) == hashes and "up to date" in dvc(repo, env, "status", "dvc.yaml").stdout
    subprocess.run(["git", "commit", "-q", "-am", "pipeline run"], cwd=repo, env=env, check=True)

    exp = dvc(repo, env, "exp", "run", "-n", "lr3e-4", "-S", "trainer.optim.lr=3e-4")
    ran = [s for s in STAGES if f"Running stage '{s}'" in exp.stdout]
    assert ran == ["rl", "eval@rl"], exp.stdout
    # Hydra recomposed params.yaml from conf/: only the overridden key differs from the committed one
    diff = subprocess.run(
        ["git", "diff", "-U0", "HEAD", "--", "params.yaml"],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert [line for line in diff.splitlines() if line[:1] in "+-" and line[:3] not in ("+++", "---")] == [
        "-    lr: 0.0001",
        "+    lr: 0.0003",
    ], diff

    shown = json.loads(dvc(repo, env, "exp", "show", "--json").stdout)
    exps = {e["name"]: e["revs"][0]["data"] for base in shown for e in (base.get("experiments") or [])}
    assert "lr3e-4" in exps, shown
    data = exps["lr3e-4"]
    assert data["params"]["params.yaml"]["data"]["trainer"]["optim"]["lr"] == 3e-4
    metrics = data["metrics"]["outputs/reverse_text/eval_rl/metrics.json"]["data"]
    assert 0.0 <= metrics["greedy/reward_mean"] <= 1.0 and metrics["reverse_text/num_examples"] == 8

    bad = dvc(repo, env, "exp", "run", "-S", "trainer.optim.lrr=1", ok=False)
    assert bad.returncode != 0 and "trainer.optim.lrr" in bad.stdout + bad.stderr
