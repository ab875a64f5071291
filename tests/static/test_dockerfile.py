"""The Dockerfile: hadolint clean, and the targets that compose, the devcontainer and the README use."""

from __future__ import annotations

import pytest

from .checks import REPO, dockerfile_problems, parse_dockerfile, run, stage_chain, tool

DOCKERFILE = (REPO / "Dockerfile").read_text()


def hadolint(path):
    return run(tool("hadolint"), "--config", str(REPO / ".hadolint.yaml"), "--no-color", str(path))


def test_hadolint_clean():
    proc = hadolint(REPO / "Dockerfile")
    assert proc.returncode == 0, (
        f"hadolint findings (fix, or ignore one with its reason):\n{proc.stdout}{proc.stderr}"
    )


@pytest.mark.parametrize(
    "broken, code",
    [
        ("FROM python:3.12.12-slim-bookworm AS cpu-base", "FROM python AS cpu-base"),  # untagged base image
        ("USER 0:0\n", "USER 0:0\nRUN apt-get install -y curl\n"),  # unpinned, no --no-install-recommends
    ],
)
def test_hadolint_fails_on_a_broken_copy(tmp_path, broken, code):
    path = tmp_path / "Dockerfile"
    path.write_text(DOCKERFILE.replace(broken, code, 1))
    assert path.read_text() != DOCKERFILE
    proc = hadolint(path)
    assert proc.returncode != 0 and "DL" in proc.stdout, proc.stdout


def test_targets_entrypoint_user_and_install_script():
    assert dockerfile_problems(DOCKERFILE) == []
    stages = parse_dockerfile(DOCKERFILE)
    # the image's install steps are the script that `make install` runs: each target copies it in
    for target in ("cpu", "dev", "gpu"):
        copies = [a for s in stage_chain(stages, target) for i, a, _ in s.lines if i == "COPY"]
        assert any("docker/install.sh" in a or a.split()[-2:] == [".", "."] for a in copies), target


@pytest.mark.parametrize(
    "old, new, problem",
    [
        ("AS gpu\n", "AS cuda\n", "no stage named 'gpu'"),
        (
            'ENTRYPOINT ["asyncrl"]\nCMD ["--help"]\n\n# ----',
            'ENTRYPOINT ["python"]\nCMD ["--help"]\n\n# ----',
            "ENTRYPOINT is",
        ),
        ("nvidia/cuda:13.0.2-devel-ubuntu24.04", "nvidia/cuda:latest", "pin the base image"),
        ("RUN docker/install.sh cpu project", "RUN docker/install.sh cpu project\nUSER 0:0", "runs as root"),
        (
            "RUN docker/install.sh gpu project",
            "RUN pip install --no-cache-dir . && true",
            "outside docker/install.sh",
        ),
    ],
)
def test_dockerfile_checks_fail_on_broken_copies(old, new, problem):
    assert old in DOCKERFILE
    problems = dockerfile_problems(DOCKERFILE.replace(old, new, 1))
    assert any(problem in p for p in problems), problems
