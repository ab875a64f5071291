"""Every locked dependency of an image installs from a wheel: PyPI's, or one that a builder stage compiles.

docker/locks/<image>.txt (`make image-lock`, docker/lock.py) records what `docker/install.sh <image> deps`
resolves to and the file pip picks. Offline, no build: the locks must be made from today's pins, each wheel
must fit the image's Python and platform, and each sdist (a package with no wheel for them) must be in
docker/source-only.txt, which the Dockerfile's builder stages compile into wheels for the image stages to
install with --only-binary :all:.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest
from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import canonicalize_name, parse_wheel_filename

from .checks import REPO, parse_dockerfile, run, stage_chain

LOCKS = REPO / "docker" / "locks"
_spec = importlib.util.spec_from_file_location("docker_lock", REPO / "docker" / "lock.py")
LOCK_PY = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(LOCK_PY)  # docker/lock.py: the digest of a lock's inputs
SOURCE_ONLY = REPO / "docker" / "source-only.txt"
DOCKERFILE = (REPO / "Dockerfile").read_text()
# each image's base -> (Python, glibc): the Python and platform its wheels must fit. A new base fails
# test_the_bases_are_the_ones_locked_for: update this table and run `make image-lock`
BASES = {
    "python:3.12.12-slim-bookworm": ((3, 12), (2, 36)),  # Debian 12
    "nvidia/cuda:13.0.2-devel-ubuntu24.04": ((3, 12), (2, 39)),  # Ubuntu 24.04's python3
}
IMAGE_BASE = {"cpu": "cpu-base", "dev": "cpu-base", "gpu": "gpu-base", "trainer": "gpu-base"}
# manylinux's legacy names: the glibc they stand for
LEGACY = {"manylinux2014": (2, 17), "manylinux2010": (2, 12), "manylinux1": (2, 5)}


def base_of(image: str) -> str:
    chain = stage_chain(parse_dockerfile(DOCKERFILE), image)
    return chain[0].base


def image_tags(python: tuple[int, int], glibc: tuple[int, int]) -> set[Tag]:
    platforms = [f"manylinux_{glibc[0]}_{minor}_x86_64" for minor in range(glibc[1], 4, -1)]
    platforms += [f"{name}_x86_64" for name, v in LEGACY.items() if v <= glibc] + ["linux_x86_64"]
    abi = f"cp{python[0]}{python[1]}"
    return set(cpython_tags(python, [abi, "abi3", "none"], platforms)) | set(
        compatible_tags(python, abi, platforms)
    )


def requirements(image: str) -> list[str]:
    proc = run(
        "bash",
        str(REPO / "docker" / "install.sh"),
        image,
        "requirements",
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stderr
    return [line for line in proc.stdout.splitlines() if line.strip()]


def read_lock(text: str) -> tuple[str | None, dict[str, tuple[str, str]]]:
    """(inputs digest, {name: (version, artifact)}) of a lock's text."""
    digest = next(iter(re.findall(r"^# inputs (\w+)$", text, re.MULTILINE)), None)
    entries = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            spec, artifact = line.split(maxsplit=1)
            name, version = spec.split("==")
            entries[canonicalize_name(name)] = (version, artifact)
    return digest, entries


def source_only() -> dict[str, str]:
    lines = [line for line in SOURCE_ONLY.read_text().splitlines() if line and not line.startswith("#")]
    return {canonicalize_name(line.split("==")[0]): line.split("==")[1] for line in lines}


def lock_problems(image: str, text: str, reqs: list[str], built: dict[str, str]) -> list[str]:
    digest, entries = read_lock(text)
    problems = []
    if digest != LOCK_PY.inputs_digest(reqs):
        problems.append(f"{image}: the lock was made for other pins than today's: run `make image-lock`")
    for line in reqs:
        req = Requirement(line)
        if req.marker and not req.marker.evaluate({"sys_platform": "linux", "platform_system": "Linux"}):
            continue
        have = entries.get(canonicalize_name(req.name))
        if have is None or not req.specifier.contains(have[0], prereleases=True):
            problems.append(
                f"{image}: {line} is pinned, the lock has {have and have[0]}: run `make image-lock`"
            )
    python, glibc = BASES.get(base_of(image), ((0, 0), (0, 0)))
    fits = image_tags(python, glibc)
    for name, (version, artifact) in sorted(entries.items()):
        if "TORCH_INDEX_URL" in artifact:
            continue  # the CPU torch, from PyTorch's own index (wheels only), installed first
        if artifact.endswith(".whl"):
            if not parse_wheel_filename(artifact)[3] & fits:
                problems.append(f"{image}: {artifact} does not fit Python {python} on glibc {glibc}")
        elif built.get(name) != version:
            problems.append(
                f"{image}: {name}=={version} ships only as source ({artifact}) and no builder stage builds "
                f"it: add `{name}=={version}` to docker/source-only.txt"
            )
    return problems


def test_the_bases_are_the_ones_locked_for():
    for image in IMAGE_BASE:
        assert base_of(image) in BASES, (
            f"{image}: base {base_of(image)} is not in BASES: add it, `make image-lock`"
        )


# ids not bare image names: conftest skips a test whose keywords hold `gpu` where there is no CUDA
@pytest.mark.parametrize("image", sorted(IMAGE_BASE), ids=lambda image: f"{image}-image")
def test_every_locked_dependency_installs_from_a_wheel(image):
    lock = LOCKS / f"{image}.txt"
    assert lock.exists(), f"no {lock.relative_to(REPO)}: run `make image-lock`"
    assert lock_problems(image, lock.read_text(), requirements(image), source_only()) == []


def test_every_source_only_entry_is_locked_and_built_by_the_builder_stages():
    locked = {}
    for lock in LOCKS.glob("*.txt"):
        locked.update(
            {n: v for n, (v, a) in read_lock(lock.read_text())[1].items() if not a.endswith(".whl")}
        )
    assert source_only() == {n: v for n, v in locked.items() if n in source_only()}, (
        "docker/source-only.txt is stale"
    )
    assert set(source_only()) <= set(locked), (
        f"no lock builds from source: {set(source_only()) - set(locked)}"
    )
    stages = parse_dockerfile(DOCKERFILE)
    for image, builder in (
        ("cpu", "wheels"),
        ("dev", "wheels"),
        ("gpu", "gpu-wheels"),
        ("trainer", "gpu-wheels"),
    ):
        runs = {
            i: " ".join(a for s in stage_chain(stages, n) for ins, a, _ in s.lines if ins == i)
            for i, n in (("RUN", builder), ("COPY", image))
        }
        assert "docker/install.sh source-wheels" in runs["RUN"], builder
        assert f"--from={builder}" in runs["COPY"], f"{image} copies no wheels from {builder}"
        own = " ".join(a for ins, a, _ in stage_chain(stages, image)[-1].lines if ins == "RUN")
        assert re.search(rf"SOURCE_WHEELS=\S+ (\S+=\S+ )*docker/install\.sh {image} deps", own), image


def test_the_trainer_image_has_flash_attn_4_and_the_gpu_images_torch_without_vllm():
    """The trainer's image exists for flash-attn-4, which vLLM's pins exclude; its torch (and the CUDA build
    that torch pins) is the sidecar's, so that both compute alike."""
    trainer = read_lock((LOCKS / "trainer.txt").read_text())[1]
    gpu = read_lock((LOCKS / "gpu.txt").read_text())[1]
    assert "flash-attn-4" in trainer and "vllm" not in trainer and "flash-attn-4" not in gpu
    for name in ("torch", "triton", "nvidia-cuda-runtime", "nvidia-nccl-cu13"):
        assert trainer[name][0] == gpu[name][0], f"{name}: trainer {trainer[name][0]}, gpu {gpu[name][0]}"


def test_the_lock_check_fails_on_broken_locks():
    reqs = requirements("cpu")
    text = (LOCKS / "cpu.txt").read_text()
    assert lock_problems("cpu", text, reqs, source_only()) == []
    unbuilt = lock_problems("cpu", text, reqs, {})
    assert any("pycosat==0.6.6 ships only as source" in p for p in unbuilt), unbuilt
    py313 = re.sub(
        r"^(numpy==\S+\s+)\S+$", r"\1numpy-2.3.5-cp313-cp313-manylinux_2_27_x86_64.whl", text, flags=re.M
    )
    assert any("does not fit" in p for p in lock_problems("cpu", py313, reqs, source_only()))
    repinned = [r.replace("transformers==5.17.0", "transformers==5.18.0") for r in reqs]
    assert any("other pins" in p for p in lock_problems("cpu", text, repinned, source_only()))
    assert any(
        "transformers==5.18.0 is pinned" in p for p in lock_problems("cpu", text, repinned, source_only())
    )
