"""Shared fixtures: a micro model, and a prepared + SFT-warmed setup that the end-to-end tests start from.

Shrunk knobs (kept small so the whole suite runs in minutes on 2 CPU cores):
- model: hidden 64, 2 layers, lowercase charset (vs 128 / 3 / printable in the default);
- task: texts of 3-6 characters, 2000 train / 24 eval examples;
- SFT: 100 steps (enough for the model to start reversing, so RL has a signal to improve).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest

from asyncrl import numerics

pytest_plugins = ["suite_budget"]  # --budget-s, --passed-file: the GPU suite over several calls to one machine

# The suite's own torch (engine, loss and packing tests run in this process) uses the pinned kernels of
# numerics=reproducible, set before anything imports torch; the processes it starts apply their own mode.
numerics.apply("reproducible", 1)

MICRO_MODEL = [
    "model.init.hidden_size=64",
    "model.init.intermediate_size=128",
    "model.init.num_hidden_layers=2",
    "model.init.head_dim=16",
    "model.init.num_attention_heads=4",
    "model.init.num_key_value_heads=4",
    "model.init.charset=ascii_lowercase",
    "model.init.max_position_embeddings=128",
]
SMALL_TASK = [
    "env.reverse_text.args.min_len=3",
    "env.reverse_text.args.max_len=6",
    "env.reverse_text.args.num_train=2000",
    "env.reverse_text.args.num_eval=24",
]


def asyncrl(
    *args: str,
    timeout: float = 300,
    cwd: Path | None = None,
    check: bool = False,
    env: dict | None = None,
    cpus: set[int] | None = None,
) -> subprocess.CompletedProcess:
    """Run the CLI in a subprocess, as a user would; returns the completed process (text output).
    ``env``: the whole environment of the process (default: this one's); ``cpus``: the cores it may use."""
    proc = subprocess.run(
        [sys.executable, "-m", "asyncrl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"asyncrl {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# metrics that measure time, or how the machinery coped (a server taken out of rotation, a request sent again),
# not learning: they differ between runs that learn the same
TIMING = (
    "time",
    "time/",
    "train/tokens_per_s",
    "sft/tokens_per_s",
    "rollout/throughput_tok_s",
    "inference/failovers",
    "inference/retried_requests",
)


@contextlib.contextmanager
def unusable_bwrap():
    """The path of a bwrap that cannot make namespaces (as in a default Docker container), in a world-readable
    directory so that the sandbox user (nobody, when the tests run as root) can run it."""
    shared = Path(tempfile.mkdtemp(prefix="asyncrl-fake-bwrap-"))
    try:
        shared.chmod(0o755)
        fake = shared / "bwrap"
        fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create new namespace' >&2\nexit 1\n")
        fake.chmod(0o755)
        yield str(fake)
    finally:
        shutil.rmtree(shared)


def offline_hub(monkeypatch, rows_by_dataset: dict[str, list[dict]]) -> list[tuple[str, dict]]:
    """Stand in for the hub (unreachable here): ``datasets.load_dataset(path, **kwargs)`` returns the rows given
    for ``path``, as a real one would; the calls made are recorded in the returned list."""
    calls: list[tuple[str, dict]] = []

    def load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        return rows_by_dataset[path]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def learning_metrics(metrics_file: Path) -> list[dict]:
    """The rows of a metrics JSONL file without their timing keys: equal between runs that compute the same."""
    return [{k: v for k, v in r.items() if not k.startswith(TIMING)} for r in read_jsonl(metrics_file)]


def staggered_sampling(model: Path | str, n: int = 8) -> dict:
    """``sampling_params`` for ``/inference/v1/generate`` under which a request's ``n`` samples stop on different
    steps, for a random-init model with the char tokenizer (its distribution is near uniform; half the letters are
    stop tokens; vLLM takes temperatures up to 2, so a trained model would sample much the same). vLLM 0.26's
    token route left the samples that finished first out of such a request's answer, unless it was final-only
    (``asyncrl.inference.vllm_server.final_only_unless_streamed``)."""
    from transformers import AutoTokenizer

    stops = AutoTokenizer.from_pretrained(str(model)).convert_tokens_to_ids(list("nopqrstuvwxyz"))
    return {"n": n, "max_tokens": 8, "temperature": 1.0, "seed": 3, "logprobs": 1, "stop_token_ids": stops}


def two_packed_rows() -> dict:
    """A micro-batch of 2 packed rows of 12 tokens (samples of 5 + 7 and 3 + 9), for ``packed_logprobs``."""
    import torch

    pos = torch.stack([torch.cat([torch.arange(5), torch.arange(7)]), torch.cat([torch.arange(3), torch.arange(9)])])
    return {"input_ids": torch.randint(6, 30, (2, 12)), "position_ids": pos, "temperatures": torch.ones(2, 12)}


@pytest.fixture(scope="session")
def micro_model(tmp_path_factory) -> Path:
    """A random-init micro Qwen3 with a char tokenizer, built in-process."""
    from asyncrl.config.compose import compose_config
    from asyncrl.models import build_tiny_model

    cfg = compose_config(MICRO_MODEL)
    return build_tiny_model(cfg.model.init, tmp_path_factory.mktemp("micro") / "model", seed=0)


@contextlib.contextmanager
def serve_sidecar(model: Path, tmp_path_factory, *args: str, env: dict | None = None):
    """``asyncrl serve`` on ``model`` (a free port, loads allowed under the test's temp root) until the block
    ends: yields ``{"url", "model", "proc", "log"}``."""
    from asyncrl.launcher.process import spawn, stop, wait_healthy
    from asyncrl.utils.process import free_port

    port = free_port()
    log = tmp_path_factory.mktemp("sidecar") / "inference.log"
    command = [sys.executable, "-m", "asyncrl", "serve", f"model.name={model}", f"inference.port={port}"]
    roots = f"inference.weights_roots=[{tmp_path_factory.getbasetemp()}]"
    proc = spawn("inference", [*command, *MICRO_MODEL, roots, *args], log, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout_s=120)
        yield {"url": url, "model": str(model), "proc": proc, "log": log}
    finally:
        stop([proc], timeout_s=30)


@pytest.fixture(scope="session")
def micro_sidecar(micro_model, tmp_path_factory):
    """One plain sidecar on the micro model for the whole session (the token-route and verifiers tests)."""
    with serve_sidecar(micro_model, tmp_path_factory) as server:
        yield server


@pytest.fixture(scope="session")
def setup(tmp_path_factory) -> dict:
    return make_setup(tmp_path_factory.mktemp("setup"))


def make_setup(root: Path) -> dict:
    """Data + micro model via `asyncrl prepare`, then a 100-step SFT warmup via `asyncrl sft`."""
    common = [f"data_dir={root / 'data'}", *SMALL_TASK, "seq_len=256"]
    asyncrl("prepare", *common, *MICRO_MODEL, f"model.name={root / 'model'}", check=True)
    asyncrl(
        "sft", *common, f"model.name={root / 'model'}", f"sft.run_dir={root / 'sft'}", "sft.max_steps=100", check=True
    )
    return {"root": root, "common": common, "base_model": root / "model", "sft_model": root / "sft" / "model"}


def rl_args(setup: dict, run_dir: Path, *extra: str) -> list[str]:
    """Overrides of a short RL run from the SFT-warmed micro model (16 prompts x 16 samples: enough signal
    for the reward to rise within 20 steps; strict async so a run replays exactly)."""
    return [
        *setup["common"],
        f"model.name={setup['sft_model']}",
        f"run_dir={run_dir}",
        "orchestrator.max_tokens=10",
        "orchestrator.prompts_per_step=16",
        "orchestrator.group_size=16",
        "trainer.optim.lr=1e-3",
        "strict_async=true",
        "launcher.progress=false",
        *extra,
    ]


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: skipped where there is none (CI), run on the lent GPU. Tests marked
    `container` build images (minutes, as root): they run only when asked for, `pytest -m container`."""
    if "container" not in (config.getoption("-m") or ""):
        for item in items:
            if "container" in item.keywords:
                item.add_marker(pytest.mark.skip(reason="builds images: run with `pytest -m container`"))
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def straight(setup, tmp_path_factory) -> Path:
    """8 RL steps in one go, checkpointing every 4: the reference for resume, crashes and determinism."""
    run = tmp_path_factory.mktemp("straight") / "rl"
    proc = asyncrl("rl", *rl_args(setup, run, "max_steps=8", "ckpt.interval=4"))
    assert proc.returncode == 0, proc.stderr
    return run


@pytest.fixture(scope="session")
def single_process_trainer(micro_model, tmp_path_factory) -> Path:
    """``asyncrl train`` alone, one process, on 3 steps of synthetic rollouts packed for two ranks: the reference
    that the FSDP2 and two-node runs (test_fsdp.py, test_multinode.py) must train like."""
    from synthetic import trainer_only_args, write_synthetic_rollouts  # imports torch: after numerics.apply

    run = tmp_path_factory.mktemp("single_process_trainer") / "single"
    write_synthetic_rollouts(run, steps=3, ranks=2)
    proc = asyncrl("train", *trainer_only_args(micro_model), f"run_dir={run}", timeout=300)
    assert proc.returncode == 0, proc.stderr
    return run
