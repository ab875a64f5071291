"""Shared fixtures: a micro model, a prepared + SFT-warmed setup and the runs the end-to-end tests
share (helpers in tests/helpers/)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from asyncrl import numerics
from helpers.launch import MICRO_MODEL, MICRO_MOE, asyncrl, make_setup, rl_args, serve_sidecar, setup_paths
from helpers.shared import built_once

# --budget-s, --passed-file: the GPU suite over several calls to one machine; --cpu-log: CPU seconds per test
pytest_plugins = ["helpers.suite_budget", "helpers.cpu_time"]

# The suite's own torch (engine, loss and packing tests run in this process) uses the pinned kernels of
# numerics=reproducible, set before anything imports torch; the processes it starts apply their own mode.
numerics.apply("reproducible", 1)


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory) -> Path:
    """A random-init micro Qwen3 with a char tokenizer, built in-process."""
    from asyncrl.config.compose import compose_config  # conftest stays torch-free until numerics.apply
    from asyncrl.models.hf import build_tiny_model  # (imports torch)

    cfg = compose_config(MICRO_MODEL)
    return (
        built_once(
            tmp_path_factory, "micro", lambda root: build_tiny_model(cfg.model.init, root / "model", seed=0)
        )
        / "model"
    )


@pytest.fixture(scope="session")
def micro_moe(tmp_path_factory) -> Path:
    """The micro model as a random-init Qwen3-MoE (``MICRO_MOE``), built in-process."""
    from asyncrl.config.compose import compose_config
    from asyncrl.models.hf import build_tiny_model

    cfg = compose_config(MICRO_MOE)
    return (
        built_once(
            tmp_path_factory,
            "micro_moe",
            lambda root: build_tiny_model(cfg.model.init, root / "model", seed=0),
        )
        / "model"
    )


@pytest.fixture(scope="session")
def micro_sidecar(micro_model, tmp_path_factory):
    """One plain sidecar on the micro model for the whole session (the token-route and verifiers tests)."""
    with serve_sidecar(micro_model, tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="session")
def setup(tmp_path_factory) -> dict:
    return setup_paths(built_once(tmp_path_factory, "setup", make_setup))


# The test files that take longest, longest first: `make test` hands whole files to its workers in this order
# (`--no-loadscope-reorder`; xdist would otherwise start the files with the most tests first), so no long
# file starts last and leaves one worker running alone. Seconds per file on 2 cores (Intel Xeon, AVX-512, the
# pytest of `make test` with `--durations=0`, setup and teardown included, summed per file): golden 267,
# verifiers_env 253, dvc 139, rl 131, benchmark_scripts 123, crash_resume 70, dvc_new_experiment 70,
# continuous 55, server 52, multinode 48, engine_process 45, notebooks 41, unit/zygote 38, slurm_cluster 37,
# wandb 37, sweep 32; every other file 26 or less.
LONGEST_FIRST = [
    f"tests/{name}.py"
    for name in (
        *(
            "integration/test_golden",
            "integration/test_verifiers_env",
            "integration/test_dvc",
            "integration/test_rl",
        ),
        *(
            "integration/test_benchmark_scripts",
            "integration/test_crash_resume",
            "integration/test_dvc_new_experiment",
            "integration/test_continuous",
        ),
        *(
            "integration/test_server",
            "integration/test_multinode",
            "integration/test_engine_process",
            "integration/test_notebooks",
        ),
        *(
            "unit/test_zygote",
            "integration/test_slurm_cluster",
            "integration/test_wandb",
            "integration/test_sweep",
        ),
    )
]


# the marks that say how many GPUs a `gpu` test needs (one without)
GPU_COUNTS = {"two_gpus": 2, "four_gpus": 4}


def gpus_needed(marks: set[str]) -> int:
    """How many GPUs a test with these marks needs (0: none). Marks that the GPU scripts could not honour are
    an error: a GPU count or `trainer_env` without `gpu` (CI would run the test), `trainer_env` with a count
    (its lanes are one GPU each)."""
    counts = [n for mark, n in GPU_COUNTS.items() if mark in marks]
    if "gpu" not in marks:
        if counts or "trainer_env" in marks:
            raise ValueError("two_gpus, four_gpus and trainer_env mark `gpu` tests only: add the `gpu` mark")
        return 0
    if counts and "trainer_env" in marks:
        raise ValueError("a trainer_env test runs on one GPU: drop two_gpus or four_gpus")
    return max(counts, default=1)


def file_order(items: list, skipped_at_once: set[str], workers: int) -> dict[str, int]:
    """Each file's place in the run. xdist's file scheduler gives every worker two files at the start and one
    more whenever one ends, so a worker's second file waits behind its first: the first ``workers`` places go
    to the longest files, the next ``workers`` to files that skip at once here (the `gpu` files without
    CUDA), so no long file waits behind a long one, then the rest longest first."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    files = sorted(
        dict.fromkeys(item.nodeid.split("::")[0] for item in items), key=lambda f: rank.get(f, len(rank))
    )
    quick = [f for f in files if f in skipped_at_once][:workers]
    head = [f for f in files[:workers] if f not in quick]
    order = head + quick + [f for f in files if f not in head and f not in quick]
    return {f: i for i, f in enumerate(order)}


def pytest_collection_modifyitems(config, items):
    """The longest files first (a stable sort: a file's tests keep their order). Tests marked `gpu` need
    CUDA: skipped where there is none (CI), run on the lent GPU; marked `two_gpus` or `four_gpus` as well,
    skipped where fewer GPUs are visible (the marks are what benchmarks/gpu_suite_lanes.sh deals lanes by).
    Tests marked `container` build images (minutes, as root): they run only when asked for, `pytest -m
    container`."""
    if "container" not in (config.getoption("-m") or ""):
        for item in items:
            if "container" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="builds images: run with `pytest -m container`"))
    try:
        import torch  # may be missing where only the static checks run

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    gpus = torch.cuda.device_count() if has_cuda else 0
    for item in items:
        try:
            need = gpus_needed({mark.name for mark in item.iter_markers()})
        except ValueError as e:
            raise pytest.UsageError(f"{item.nodeid}: {e}") from None
        if need > gpus:
            item.add_marker(pytest.mark.skip(reason=f"needs {need} GPUs" if has_cuda else "needs CUDA"))
    by_file: dict[str, list] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(item)
    skipped = {f for f, its in by_file.items() if all(i.get_closest_marker("skip") for i in its)}
    # xdist's workers collect; 1 without xdist
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    place = file_order(items, skipped, workers)
    items.sort(key=lambda item: place[item.nodeid.split("::")[0]])  # stable: a file's tests keep their order


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter):
    """The machine, beside the slowest tests: the suite's time is read against the CPU it ran on."""
    cpu = numerics.cpu_info()
    isa = [f for f in ("avx2", "avx512f", "amx_tile") if f in cpu["flags"]]
    terminalreporter.write_line(
        f"machine: {cpu['model']} ({cpu['vendor']}), {os.cpu_count()} cores, {' '.join(isa)}"
    )


@pytest.fixture(scope="session")
def straight(setup, tmp_path_factory) -> Path:
    """8 RL steps in one go, checkpointing every 4: the reference for resume, crashes and determinism."""

    def build(root: Path) -> None:
        proc = asyncrl("rl", *rl_args(setup, root / "rl", "max_steps=8", "ckpt.interval=4"))
        assert proc.returncode == 0, proc.stderr

    return built_once(tmp_path_factory, "straight", build) / "rl"


@pytest.fixture(scope="session")
def single_process_trainer(micro_model, tmp_path_factory) -> Path:
    """``asyncrl train`` alone, one process, on 3 steps of synthetic rollouts packed for two ranks: the
    reference that the FSDP2 and two-node runs (test_fsdp.py, test_multinode.py) must train like."""
    # imports torch: after numerics.apply
    from helpers.synthetic import trainer_only_args, write_synthetic_rollouts

    def build(root: Path) -> None:
        write_synthetic_rollouts(root / "single", steps=3, ranks=2)
        proc = asyncrl("train", *trainer_only_args(micro_model), f"run_dir={root / 'single'}", timeout=300)
        assert proc.returncode == 0, proc.stderr

    return built_once(tmp_path_factory, "single_process_trainer", build) / "single"
