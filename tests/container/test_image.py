"""The cpu and dev images, built for real and run (``pytest -m container``; root, buildah, podman and
debootstrap needed).

docker/image-test.sh builds the cpu and dev targets with buildah; the golden pipeline
(tests/helpers/golden.py, plus its eval) then runs inside the cpu image, as the image's non-root user with a
/runs volume, and on the host: every out must hash the same in both, and as tests/golden.json commits. Not
in CI: `make image-test` runs this and tests/container/test_gpu_images.py in about 14 minutes on 2 cores,
most of it pip installing into four images (docs/containers.md).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from asyncrl import numerics
from helpers.golden import compare, run_pipeline
from helpers.launch import asyncrl

# two image builds (~2 min each on overlay storage, 2 cores; ~5 on vfs) and two pipelines: past the suite's
# 600 s
pytestmark = [pytest.mark.container, pytest.mark.timeout(3600)]

SCRIPT = Path(__file__).resolve().parents[2] / "docker" / "image-test.sh"


def image(*args: str, timeout: float = 3600, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert proc.returncode == 0, (
        f"{SCRIPT.name} {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    )
    return proc


def test_images_build_and_the_cpu_image_reproduces_the_host(tmp_path):
    missing = [t for t in ("buildah", "podman", "debootstrap") if not shutil.which(t)]
    assert not missing, f"{missing} missing: apt-get install -y buildah podman debootstrap (as root)"
    start = time.monotonic()
    print(image("build").stdout, end="")
    built = time.monotonic()
    in_image = run_pipeline(
        tmp_path / "image",
        lambda args: image("run", str(tmp_path / "image"), "asyncrl", *args),
        "reproducible",
        evaluate=True,
    )
    ran = time.monotonic()
    host = run_pipeline(
        tmp_path / "host",
        lambda args: asyncrl(*args, cwd=tmp_path / "host", check=True, env=numerics.outer_environ()),
        "reproducible",
        evaluate=True,
    )
    print(
        f"image test: build {built - start:.0f} s, pipeline in the cpu image {ran - built:.0f} s, on the "
        f"host {time.monotonic() - ran:.0f} s"
    )
    assert in_image == host, f"the cpu image and the host differ: {in_image} vs {host}"
    why = compare(in_image, "the cpu image")
    assert why is None, why
    # the dev image (the devcontainer's) holds the test tools and the editable project
    dev = image(
        "run",
        str(tmp_path / "image"),
        "python",
        "-m",
        "pytest",
        "--version",
        env={"IMAGE": "asyncrl:dev", **numerics.outer_environ()},
    )
    assert "pytest" in dev.stdout + dev.stderr
