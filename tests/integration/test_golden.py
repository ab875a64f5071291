"""Golden hashes: a short prepare -> SFT -> RL run must give committed bits, whatever the CPU or the
environment.

``tests/golden.json`` holds the hashes of the models and the learning metrics of one small pipeline
(tests/helpers/golden.py), run with ``numerics=reproducible``. They must come out the same on every x86-64
CPU with AVX2 (CI changes CPU between runs: Intel with AVX-512/AMX, AMD with AVX-512 or AVX2 only), and
whatever outer environment the user has: each variant below starts the same run with kernel choices and
thread counts that differ (torch's ISA build, MKL's code branch, OpenMP threads, one core). ``numerics=fast``
gives the machine's kernels free rein, and then the same variants differ: the check can fail.

After a change that alters the numbers on purpose, re-make the file (and the DVC locks):
``ASYNCRL_GOLDEN=write python -m pytest tests/integration/test_golden.py -k as_is``. To watch the checks fail
with the switch off: ``ASYNCRL_GOLDEN_NUMERICS=fast python -m pytest tests/integration/test_golden.py``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from asyncrl import numerics
from asyncrl.numerics import cpu_info
from helpers import zygote
from helpers.golden import GOLDEN, compare, file_hash, hashes, run_pipeline, stages
from helpers.launch import asyncrl

pytestmark = pytest.mark.slow

MODE = os.environ.get("ASYNCRL_GOLDEN_NUMERICS", "reproducible")
HAS_AVX512 = "avx512f" in cpu_info()["flags"]

# outer environments a user may have (None: unset) and the cores it may run on; reproducible mode must not
# let any of them reach the bits
VARIANTS = {
    "as_is": {},
    # and on one core: torch sizes its default thread pool from the cores it may use
    "aten_default_2_threads_mkl_auto_one_core": {
        "ATEN_CPU_CAPABILITY": "default",
        "OMP_NUM_THREADS": "2",
        "MKL_NUM_THREADS": "2",
        "MKL_CBWR": "AUTO",
        "MKL_DYNAMIC": "TRUE",
    },
    "aten_avx2_1_thread_mkl_avx2_strict": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "OMP_NUM_THREADS": "1",
        "MKL_CBWR": "AVX2,STRICT",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    },
    "aten_avx512_mkl_avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_CBWR": "AVX512",
        "OMP_NUM_THREADS": None,
    },
}
CPUS = {"aten_default_2_threads_mkl_auto_one_core": {0}}
# the variant whose every command starts a fresh interpreter, the one whose kernels (torch's portable build)
# differ most from those the numerics mode sets: the others fork theirs
FRESH = "aten_default_2_threads_mkl_auto_one_core"


@contextlib.contextmanager
def runner(root: Path, variant: str, mode: str) -> Iterator[Callable[[tuple[str, ...]], None]]:
    """What runs one ``asyncrl`` command in ``root`` from the user's environment plus ``variant``'s changes.
    ``as_is`` in this process's numerics mode forks from the worker's zygote, as the suite's other commands
    do (which imported torch under the user's environment and these numerics); :data:`FRESH` starts each
    command in a fresh interpreter, so the committed hashes are shown to hold for fresh and forked commands
    alike; the others fork from a zygote of their own, which imported torch on the variant's cores under the
    environment each command sets before it imports torch (the variant's, with ``mode`` applied), as a fresh
    interpreter would: one import for the pipeline's commands, not one each."""
    env = numerics.outer_environ()
    for key, value in VARIANTS[variant].items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    cpus = CPUS.get(variant)
    if variant == "as_is" and mode == os.environ.get(numerics.MARKER):
        yield lambda args: asyncrl(*args, cwd=root, check=True)
    elif variant == FRESH:
        yield lambda args: asyncrl(*args, cwd=root, env=env, cpus=cpus, check=True)
    else:
        numerics.apply(mode, 1, env)  # the commands' threads: one (numerics.process_threads)
        with zygote.own(env, cpus) as own:
            yield lambda args: asyncrl(*args, cwd=root, env=env, cpus=cpus, via=own, check=True)


def host_pipeline(
    root: Path, variant: str, mode: str, rl: bool = True, sft_steps: int = 30
) -> dict[str, str]:
    """The golden pipeline on this machine under ``variant`` (:func:`runner`)."""
    with runner(root, variant, mode) as run:
        return run_pipeline(root, run, mode, rl, sft_steps=sft_steps)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_outer_environment_cannot_change_the_bits(variant, tmp_path):
    """``as_is`` is the golden run itself; every other variant must hash the same."""
    if variant == "aten_avx512_mkl_avx512" and not HAS_AVX512:
        pytest.skip("this CPU has no AVX-512 (torch would run its AVX2 build, as the avx2 variant does)")
    got = host_pipeline(tmp_path, variant, MODE)
    if os.environ.get("ASYNCRL_GOLDEN") == "write" and variant == "as_is":
        import torch

        made_on = {
            "cpu": cpu_info()["model"],
            "isa": numerics.describe(MODE, {})["cpu"]["isa"],
            "torch": torch.__version__,
        }
        GOLDEN.write_text(json.dumps({"hashes": got, "made_on": made_on}, indent=2) + "\n")
        pytest.skip(f"wrote {GOLDEN}")
    why = compare(got, f"numerics={MODE}, outer environment {variant} {VARIANTS[variant]}")
    assert why is None, why


def test_fast_mode_lets_the_environment_reach_the_bits(tmp_path):
    """The same outer variant under numerics=fast: torch's portable build and its AVX2 build round
    differently on every x86-64 CPU, so the golden checks above would catch a leak. The variant builds a base
    model of its own (the initialisation's kernels), then trains the as-is base (the training step's kernels,
    from the same weights): each must differ. (Two SFT steps show it as well as thirty: the variant runs
    torch's portable kernels on one core.)"""
    as_is = host_pipeline(tmp_path / "as_is", "as_is", "fast", rl=False, sft_steps=2)
    root = tmp_path / "changed"
    root.mkdir()
    prepare, sft = stages("fast", rl=False, sft_steps=2)
    with runner(root, "aten_default_2_threads_mkl_auto_one_core", "fast") as run:
        run(prepare)
        assert file_hash(root / "base" / "model.safetensors") != as_is["base_model"]
        shutil.rmtree(root / "base")
        shutil.copytree(tmp_path / "as_is" / "base", root / "base")
        run(sft)
    changed = hashes(root)
    assert changed["base_model"] == as_is["base_model"] and changed["sft_model"] != as_is["sft_model"]
