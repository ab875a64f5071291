"""The DVC pipeline end to end, shrunk, in a throwaway git repository made from this checkout.

One test, in order: `dvc repro` runs prepare -> sft -> rl -> eval; a second `dvc repro` runs nothing; a forced
rerun (`dvc repro -f`) writes the same dvc.lock (every out hashes the same); the outs go to the default remote
and come back; `dvc exp run -S` recomposes params.yaml through Hydra, reruns only the stages whose params
changed, and `dvc exp show --json` lists the experiment with its metrics; an unknown key fails naming it.

Shrunk knobs (written into the copy's conf/pipeline.yaml, the config `dvc exp run` composes): the micro model
and small task of conftest.py, 10 SFT steps, 3 RL steps of 4 prompts x 4 samples, 8 eval prompts x 2 samples.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncrl.launcher import new as new_experiment
from helpers.launch import MICRO_MODEL, SMALL_TASK, asyncrl

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SHRUNK = [
    *MICRO_MODEL,
    *SMALL_TASK,
    "sft.max_steps=10",
    "max_steps=3",
    "orchestrator.prompts_per_step=4",
    "orchestrator.group_size=4",
    "orchestrator.max_tokens=10",
    "eval.num_examples=8",
    "eval.n=2",
    "launcher.progress=false",
]
STAGES = ["prepare", "sft", "rl", "eval@sft", "eval@rl"]


def copy_checkout(dest: Path) -> None:
    """The files git would commit here (tracked, or untracked and not ignored), symlinks kept: no outputs/, no
    DVC cache, no venv."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for rel in filter(None, listed.split("\0")):
        src, dst = ROOT / rel, dest / rel
        if src.is_symlink() or src.is_file():  # a tracked file deleted in this checkout is skipped
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst, follow_symlinks=False)


def nested(overrides: list[str]) -> dict:
    """``a.b=1`` overrides as the nested YAML mapping that a config's ``_self_`` merges."""
    return new_experiment.nested(overrides, set())[0]


def out_hashes(repo: Path) -> dict[str, str]:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"]
    return {o["path"]: o["md5"] for stage in lock.values() for o in stage["outs"]}


@pytest.fixture
def project(tmp_path) -> tuple[Path, dict]:
    """A git repository holding this checkout, with the shrunk knobs in its conf/pipeline.yaml and params.yaml."""
    repo = tmp_path / "project"  # the default remote, ../asyncrl-dvc-remote, lands in tmp_path too
    copy_checkout(repo)
    pipeline = repo / "conf" / "pipeline.yaml"
    pipeline.write_text(
        pipeline.read_text()
        + "# shrunk for tests/integration/test_dvc.py\n"
        + yaml.safe_dump(nested(SHRUNK), sort_keys=False)
    )
    (repo / "params.yaml").write_text(
        asyncrl("prepare", "--cfg", "experiment=reverse_text", *SHRUNK, check=True).stdout
    )
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # asyncrl, python
        "GIT_AUTHOR_NAME": "test",
        "GIT_AUTHOR_EMAIL": "test@example.com",
        "GIT_COMMITTER_NAME": "test",
        "GIT_COMMITTER_EMAIL": "test@example.com",
        "PYTHONUNBUFFERED": "1",
        # DVC's user/system config and its site cache (repo index, locks) in tmp_path: isolated, and left nowhere
        **{
            f"DVC_{name}": str(tmp_path / f"dvc-{name.lower()}")
            for name in ("GLOBAL_CONFIG_DIR", "SYSTEM_CONFIG_DIR", "SITE_CACHE_DIR")
        },
    }
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "baseline"]):
        subprocess.run(["git", *cmd], cwd=repo, env=env, check=True)
    return repo, env


def dvc(repo: Path, env: dict, *args: str, ok: bool = True, timeout: float = 900) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=timeout
    )
    if ok and proc.returncode != 0:
        raise AssertionError(f"dvc {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def test_repro_noop_forced_rerun_remote_and_experiment(project):
    repo, env = project
    first = dvc(repo, env, "repro")
    assert [s for s in STAGES if f"Running stage '{s}'" in first.stdout] == STAGES
    hashes = out_hashes(repo)
    assert {
        f"outputs/reverse_text/{p}" for p in ("sft/model", "rl/model", "rl/metrics/curves.csv", "eval_rl/metrics.json")
    } <= set(hashes)
    lock = (repo / "dvc.lock").read_text()
    curves = (repo / "outputs/reverse_text/rl/metrics/curves.csv").read_text().splitlines()
    assert curves[0].startswith("step,rollout/reward_mean,") and len(curves) == 1 + 3

    again = dvc(repo, env, "repro")
    assert "Running stage" not in again.stdout and "Data and pipelines are up to date." in again.stdout

    dvc(repo, env, "repro", "-f")
    assert (repo / "dvc.lock").read_text() == lock, "a forced rerun changed dvc.lock: some out is not deterministic"

    # the default remote (a directory beside the clone) round-trips every out of the pipeline (the target: the
    # experiments/*/dvc.lock of the copy name outs that were never run here)
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
        ["git", "diff", "-U0", "HEAD", "--", "params.yaml"], cwd=repo, capture_output=True, text=True, check=True
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
