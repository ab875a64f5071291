"""The gpu and trainer images, built for real and run on the CPU (``pytest -m container``; root, buildah,
podman and debootstrap needed).

docker/image-test.sh builds both targets on a stand-in for their CUDA base (no registry here; the script
says what the stand-in lacks); torch, its CUDA libraries, vLLM and flash-attn-4 come from PyPI as on a GPU
host. The golden pipeline (tests/helpers/golden.py) then runs as docker-compose.yml splits it between the two
images, on one ``/runs`` volume: prepare, reconcile and eval in ``gpu``, SFT in ``trainer``, and the RL step
loop with the trainer in a ``trainer`` container beside a ``gpu`` container running the sidecar (the built-in
backend: no GPU here) and the orchestrator, over the host's loopback. Every out hashes as tests/golden.json
commits. Each image holds what its processes need and not what the other's pins exclude, and the trainer
image refuses ``numerics=bitwise``, naming vLLM. The two images (~10 GB each) are removed afterwards.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from asyncrl import numerics
from asyncrl.launcher.environments import REPORT
from asyncrl.utils.process import free_port
from helpers.golden import compare, hashes, stages

# two image builds (~10 GB of wheels installed each) and the pipeline
pytestmark = [pytest.mark.container, pytest.mark.timeout(5400)]

SCRIPT = Path(__file__).resolve().parents[2] / "docker" / "image-test.sh"
RUN_TIMEOUT_S = 1800

# what each image's environment holds (the launcher's own report: where asyncrl comes from, the versions of
# the distributions named), after importing the kernel package the image is for (argv[1]), so that a
# dependency of it missing or at odds fails here
VERSIONS = "import importlib, sys; importlib.import_module(sys.argv.pop(1))\n" + REPORT
DISTRIBUTIONS = ("torch", "vllm", "flash-attn-4", "asyncrl")
KERNELS = {"gpu": "vllm", "trainer": "flash_attn.cute"}


def start_in(image: str, runs: Path, log: Path, *argv: str) -> subprocess.Popen:
    """``argv`` started in a new container of ``asyncrl:<image>`` as its user, ``runs`` mounted at /runs
    (``timeout`` inside the container stops it where it hangs), its output into ``log``; in a session of its
    own, so that :func:`stop` reaches what it started."""
    env = {"IMAGE": f"asyncrl:{image}", **numerics.outer_environ()}
    argv = ("timeout", "--kill-after=30", str(RUN_TIMEOUT_S), *argv)
    with log.open("w") as out:
        return subprocess.Popen(
            [str(SCRIPT), "run", str(runs), *argv],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )


def stop(proc: subprocess.Popen) -> None:
    """``proc`` and its session stopped (the script then removes its container)."""
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            continue


def wait_all(procs: dict[str, tuple[subprocess.Popen, Path]]) -> None:
    """Wait for every process to exit 0; the first that fails or outlasts the timeout stops the others, and
    its name, exit code and output are the error."""
    deadline = time.monotonic() + RUN_TIMEOUT_S + 120
    running = dict(procs)
    while running:
        for name, (proc, log) in list(running.items()):
            code = proc.poll()
            late = code is None and time.monotonic() > deadline
            if code == 0:
                del running[name]
            elif code is not None or late:
                for other, _ in procs.values():
                    stop(other)
                out = log.read_text(errors="replace")[-4000:]
                raise AssertionError(
                    f"{name} {'outlasted its timeout' if late else f'exited {code}'}:\n{out}"
                )
        time.sleep(0.5)


def run_in(image: str, runs: Path, name: str, *argv: str) -> str:
    """``argv`` run in ``asyncrl:<image>``; its output, after asserting that it exited 0."""
    log = runs.parent / f"{name}.log"
    wait_all({name: (start_in(image, runs, log, *argv), log)})
    return log.read_text(errors="replace")


def test_gpu_and_trainer_images_run_the_pipeline_as_compose_splits_it(tmp_path):
    missing = [t for t in ("buildah", "podman", "debootstrap") if not shutil.which(t)]
    assert not missing, f"{missing} missing: apt-get install -y buildah podman debootstrap (as root)"
    begin = time.monotonic()
    try:
        built = subprocess.run([str(SCRIPT), "build", "gpu", "trainer"], capture_output=True, text=True)
        assert built.returncode == 0, f"building the images failed:\n{built.stderr}"
        print(built.stdout, end="")
        pipeline(tmp_path, begin)
    finally:
        # the images (~10 GB each) go however the test ended; an error here does not hide the test's own
        removed = subprocess.run([str(SCRIPT), "remove", "gpu", "trainer"], capture_output=True, text=True)
    assert removed.returncode == 0, f"removing the images failed:\n{removed.stderr}"


def pipeline(tmp_path: Path, begin: float) -> None:
    """The checks on the built images (see the module's docstring)."""
    built = time.monotonic()
    runs = tmp_path / "runs"
    runs.mkdir()
    versions = {
        image: json.loads(
            run_in(
                image, runs, f"{image}-versions", "python", "-c", VERSIONS, kernels, *DISTRIBUTIONS
            ).splitlines()[-1]
        )["versions"]
        for image, kernels in KERNELS.items()
    }
    gpu, trainer = versions["gpu"], versions["trainer"]
    assert gpu["vllm"] and not gpu["flash-attn-4"], versions
    assert trainer["flash-attn-4"] and not trainer["vllm"], versions
    # the trainer and the sidecar beside it compute with the same torch (docs/gpus.md)
    assert gpu["torch"] == trainer["torch"] and gpu["asyncrl"] == trainer["asyncrl"], versions

    prepare, sft, rl, evaluate = stages("reproducible", evaluate=True)
    run_in("gpu", runs, "prepare", "asyncrl", *prepare)
    run_in("trainer", runs, "sft", "asyncrl", *sft)
    overrides = rl[1:]
    run_in("gpu", runs, "reconcile", "asyncrl", "reconcile", *overrides)
    port = free_port()
    serve = shlex.join(["asyncrl", "serve", *overrides, f"inference.port={port}"])
    orchestrate = shlex.join(
        ["asyncrl", "orchestrate", *overrides, f"inference.urls=[http://127.0.0.1:{port}]"]
    )
    logs = {name: tmp_path / f"{name}.log" for name in ("train", "serve+orchestrate")}
    # the sidecar stops once the orchestrator is done, as `docker compose down` would stop it
    both = f"{serve} & s=$!; {orchestrate}; rc=$?; kill $s; wait $s; exit $rc"
    wait_all(
        {
            "train": (
                start_in("trainer", runs, logs["train"], "asyncrl", "train", *overrides),
                logs["train"],
            ),
            "serve+orchestrate": (
                start_in("gpu", runs, logs["serve+orchestrate"], "sh", "-c", both),
                logs["serve+orchestrate"],
            ),
        }
    )
    run_in("gpu", runs, "eval", "asyncrl", *evaluate)
    ran = time.monotonic()
    print(f"gpu images: build {built - begin:.0f} s, pipeline {ran - built:.0f} s; {versions}")
    # torch's CUDA build computes on the CPU as the cpu image's and the host's do
    why = compare(hashes(runs), "the gpu and trainer images")
    assert why is None, why

    # what the config asks of the trainer but its image lacks is refused before anything starts
    bitwise = (
        "numerics=bitwise",
        "trainer.fabric.accelerator=cuda",
        "inference.backend=vllm",
        "model.dtype=bfloat16",
    )
    log = tmp_path / "refused.log"
    refused = start_in("trainer", runs, log, "asyncrl", "train", *overrides, *bitwise, "run_dir=x")
    code, out = refused.wait(timeout=RUN_TIMEOUT_S), log.read_text(errors="replace")
    assert code == 2 and "lacks what the trainer needs: vllm (numerics=bitwise" in out, out[-4000:]
