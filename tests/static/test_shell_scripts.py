"""Every shell script in the repository passes shellcheck at warning level: the GPU scripts run on a lent
machine where a masked exit status or a split word costs a call, and CI runs none of them whole.
docker/install.sh is held to shellcheck's default level by test_install_script.py; the slurm templates are
checked once rendered (tests/unit/test_slurm.py)."""

from __future__ import annotations

import subprocess

from .checks import REPO, run, tool


def shell_scripts() -> list[str]:
    """The tracked shell scripts: `*.sh` and CI's entry point."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--", "*.sh", ".ci/run"], cwd=REPO, capture_output=True, check=True
    )
    return sorted(name for name in listed.stdout.decode().split("\0") if name)


def shellcheck(*paths: str):
    return run(tool("shellcheck"), "--external-sources", "--severity=warning", "--format=gcc", *paths)


def test_every_shell_script_is_shellcheck_clean():
    scripts = shell_scripts()
    assert {".ci/run", "docker/install.sh", "benchmarks/gpu_suite_lanes.sh"} <= set(scripts), scripts
    proc = shellcheck(*scripts)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_masked_exit_status_is_caught(tmp_path):
    """The kinds of warning the scripts are held to: a `cd` whose failure goes on in the wrong folder, an
    assignment inside `export` that hides its command's exit status, a sourced file without its shell."""
    script = (REPO / ".ci" / "run").read_text()
    broken = tmp_path / "run"
    broken.write_text(script.replace(" || exit 2", "") + "export CODE=$(cat code)\n")
    sourced = tmp_path / "steps.sh"
    sourced.write_text("# sourced\nstep() { echo; }\n")
    proc = shellcheck(str(broken), str(sourced))
    assert {"SC2164", "SC2155", "SC2148"} <= set(proc.stdout.replace("[", " ").replace("]", " ").split())
