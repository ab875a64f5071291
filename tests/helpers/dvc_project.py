"""A throwaway git repository made from this checkout, with the DVC pipeline shrunk, for the tests that run
it (tests/integration/test_dvc.py, test_dvc_new_experiment.py: files of their own, so the suite's workers run
them side by side).

Shrunk knobs (written into the copy's conf/pipeline.yaml, the config `dvc exp run` composes): the micro model
and small task of conftest.py, 10 SFT steps, 3 RL steps of 4 prompts x 4 samples, 8 eval prompts x 2 samples.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

from asyncrl.launcher import new as new_experiment
from helpers import zygote
from helpers.launch import MICRO_MODEL, SMALL_TASK, asyncrl

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
    """The files git would commit here (tracked, or untracked and not ignored), symlinks kept: no outputs/,
    no DVC cache, no venv; and of experiments/ only its README. DVC reads every dvc.yaml of a repository at
    each command, and the experiments' pipelines cost ~6 s of CPU a command (`dvc status` in the copy: 7.8 s
    with them, 1.6 s without), while these tests run the root pipeline and one made by
    `asyncrl new experiment`."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for rel in filter(None, listed.split("\0")):
        if rel.startswith("experiments/") and rel.count("/") > 1:
            continue
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


def make_project(tmp_path: Path) -> tuple[Path, dict]:
    """A git repository holding this checkout, with the shrunk knobs in its conf/pipeline.yaml and
    params.yaml, and the environment its commands run in."""
    repo = tmp_path / "project"  # the default remote, ../asyncrl-dvc-remote, lands in tmp_path too
    copy_checkout(repo)
    pipeline = repo / "conf" / "pipeline.yaml"
    pipeline.write_text(
        pipeline.read_text()
        + "# shrunk for tests/helpers/dvc_project.py\n"
        + yaml.safe_dump(nested(SHRUNK), sort_keys=False)
    )
    (repo / "params.yaml").write_text(
        asyncrl("prepare", "--cfg", "experiment=reverse_text", *SHRUNK, check=True).stdout
    )
    env = zygote.shim_env(
        {
            **os.environ,
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # asyncrl, python
            "GIT_AUTHOR_NAME": "test",
            "GIT_AUTHOR_EMAIL": "test@example.com",
            "GIT_COMMITTER_NAME": "test",
            "GIT_COMMITTER_EMAIL": "test@example.com",
            "PYTHONUNBUFFERED": "1",
            # DVC's user/system config and its site cache (repo index, locks) in tmp_path: isolated, and left
            # nowhere
            **{
                f"DVC_{name}": str(tmp_path / f"dvc-{name.lower()}")
                for name in ("GLOBAL_CONFIG_DIR", "SYSTEM_CONFIG_DIR", "SITE_CACHE_DIR")
            },
        }
    )  # the stages' `asyncrl` commands fork from this worker's zygote (tests/helpers/zygote.py)
    for cmd in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "baseline"]):
        subprocess.run(["git", *cmd], cwd=repo, env=env, check=True)
    return repo, env


def dvc(
    repo: Path, env: dict, *args: str, ok: bool = True, timeout: float = 900
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "dvc", *args],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if ok and proc.returncode != 0:
        raise AssertionError(f"dvc {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc
