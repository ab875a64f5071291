"""docker/install.sh, the one install recipe of the images and of `make install`."""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from pathlib import Path

import pytest

from .checks import REPO, run, tool

SCRIPT = REPO / "docker" / "install.sh"


def plan(*args: str, **env: str) -> list[str]:
    """The commands the script would run (DRY_RUN=1), one string each."""
    proc = run(
        "bash", str(SCRIPT), *args, env={**os.environ, "PYTHON": sys.executable, "DRY_RUN": "1", **env}
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def pin(name: str) -> str:
    return re.search(rf"^{name}=(\S+)", SCRIPT.read_text(), re.MULTILINE).group(1)


def test_shellcheck_clean():
    proc = run(tool("shellcheck"), str(SCRIPT))
    assert proc.returncode == 0, proc.stdout


def test_shellcheck_fails_on_a_broken_copy(tmp_path):
    broken = tmp_path / "install.sh"
    broken.write_text(SCRIPT.read_text().replace("PY=${PYTHON:-python3}", "PY=${PYTHON:-python3}\ncd $ROOT"))
    proc = run(tool("shellcheck"), str(broken))
    assert proc.returncode != 0 and "SC2086" in proc.stdout, proc.stdout


def test_cpu_plan_pins_the_cpu_torch_then_installs_asyncrl():
    steps = plan("cpu", TORCH_INDEX_URL="https://example.invalid/whl/cpu")
    torch = next(i for i, s in enumerate(steps) if "torch==" in s)
    assert "--index-url https://example.invalid/whl/cpu" in steps[torch]
    assert f"torch=={pin('TORCH_CPU')}" in steps[torch]
    # the rest from pyproject.toml, after torch
    assert any("transformers==" in s for s in steps[torch + 1 :])
    # then asyncrl and the shipped environments (verifiers tasksets, agent programs), each an installable
    # package, in one call built with the environment's own (locked) setuptools
    shipped = sorted(p.name for p in (REPO / "environments").iterdir() if (p / "pyproject.toml").exists())
    *_, project, check, _receipt = steps
    packages = project.split("pip install --no-deps --no-build-isolation ")[1].split()
    assert packages == [str(REPO), *(str(REPO / "environments" / name) for name in shipped)]
    assert check.endswith("pip check")
    editable = plan("cpu", "project", ASYNCRL_EDITABLE="1")[0].split("--no-build-isolation ")[1].split()
    assert editable[::2] == ["-e"] * (len(shipped) + 1) and editable[1::2] == packages


def test_gpu_plan_takes_vllm_from_pyproject_and_flash_attn_only_built_and_asked_for():
    steps = "\n".join(plan("gpu", FLASH_ATTN="1", FLASH_ATTN_WHEELS="/opt/wheels"))
    assert "vllm==0.26.0" in steps and "--find-links /opt/wheels --only-binary flash-attn" in steps
    assert f"flash-attn=={pin('FLASH_ATTN_VERSION')}" in steps
    # the default, as the Dockerfile's: torch's varlen kernel is flash-attn 2's kernel
    for without in (plan("gpu"), plan("gpu", FLASH_ATTN="0")):
        assert "vllm==0.26.0" in "\n".join(without) and "flash" not in "\n".join(without).lower()
    wheel = "\n".join(plan("flash-attn-wheel", "deps", FLASH_ATTN_WHEELS="/w"))
    assert (
        f"torch=={pin('TORCH_GPU')}" in wheel
        and "--no-build-isolation" in wheel
        and "--wheel-dir /w" in wheel
    )


def test_source_only_dependencies_are_built_as_wheels_and_images_install_wheels_only():
    built = "\n".join(plan("source-wheels", "deps", SOURCE_WHEELS="/w"))
    assert "pip wheel --no-deps --wheel-dir /w -r" in built and built.endswith("docker/source-only.txt")
    for target in ("cpu", "dev", "gpu"):
        steps = plan(target, "deps", SOURCE_WHEELS="/w")
        main = next(s for s in steps if "transformers==" in s)
        assert "--find-links /w --only-binary :all:" in main, target
        # without it (make install on a machine with a compiler) pip may build from source
        assert not any(":all:" in s for s in plan(target, "deps")), target


def test_requirements_phase_prints_what_deps_installs():
    cpu = plan("cpu", "requirements")
    assert (
        cpu[0] == f"torch=={pin('TORCH_CPU')}"
        and "transformers==5.17.0" in cpu
        and "pytest==9.2.0" not in cpu
    )
    assert "pytest==9.2.0" in plan("dev", "requirements") and "vllm==0.26.0" in plan("gpu", "requirements")


def test_bad_arguments_print_the_usage():
    for args in (["tpu"], ["cpu", "everything"], []):
        proc = run("bash", str(SCRIPT), *args)
        assert proc.returncode == 2 and "TARGET" in proc.stderr, args


def test_this_environment_was_installed_by_the_script():
    """`make install` runs docker/install.sh dev: CI exercises the image's install steps on every run."""
    receipt = Path(sys.prefix) / "asyncrl-install.json"
    if not receipt.exists():
        if os.environ.get("CI"):
            pytest.fail(
                f"{receipt} is missing: CI's environment must be installed by "
                "docker/install.sh (make install)"
            )
        pytest.skip("this environment was not installed by docker/install.sh (make install does that)")
    data = json.loads(receipt.read_text())
    assert data["target"] == "dev"
    assert data["install_sh_sha256"] == hashlib.sha256(SCRIPT.read_bytes()).hexdigest(), (
        "docker/install.sh changed since this environment was installed: run make install"
    )
    import torch

    assert torch.__version__.split("+")[0] == pin("TORCH_CPU")
