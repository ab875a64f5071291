"""Running the CLI as a user would, and the shrunk model and task knobs the end-to-end tests start from.

Shrunk knobs (kept small so the whole suite runs in minutes on 2 CPU cores):
- model: hidden 64, 2 layers, lowercase charset (vs 128 / 3 / printable in the default);
- task: texts of 3-6 characters, 2000 train / 24 eval examples;
- SFT: 100 steps (enough for the model to start reversing, so RL has a signal to improve).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

from asyncrl.utils.children import Proc, spawn, stop, wait_healthy
from asyncrl.utils.process import free_port
from helpers import zygote
from helpers.shared import common_temp

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

# The micro model as a mixture of experts (Qwen3-MoE): 4 experts of width 32 per layer, each token routed to
# 2.
MICRO_MOE = [
    *MICRO_MODEL,
    "model.init.architecture=Qwen3MoeForCausalLM",
    "model.init.num_experts=4",
    "model.init.num_experts_per_tok=2",
    "model.init.moe_intermediate_size=32",
]


SMALL_TASK = [
    "env.reverse_text.args.min_len=3",
    "env.reverse_text.args.max_len=6",
    "env.reverse_text.args.num_train=2000",
    "env.reverse_text.args.num_eval=24",
]


def asyncrl(
    *args: str,
    # a hang guard: under the suite's load on the slowest CPU an SFT of 150 steps takes ~450 s
    timeout: float = 900,
    cwd: Path | None = None,
    check: bool = False,
    env: dict | None = None,
    cpus: set[int] | None = None,
    via: zygote.Zygote | None = None,
) -> subprocess.CompletedProcess:
    """Run the CLI in a subprocess, as a user would; returns the completed process (text output).
    ``env``: the whole environment of the process (default: this one's); ``cpus``: the cores it may use.
    Without cores, and with an environment that is this one's but for ``PYTHONPATH``, the process is a fork
    of the worker's zygote (tests/helpers/zygote.py: torch imported once); ``via``: a zygote of the test's
    own started under ``env`` and ``cpus`` (:func:`zygote.own`) to fork from instead, which must take it."""
    if via is not None:
        forked = via.run(args, timeout, cwd, env)
        assert forked is not None, f"asyncrl {' '.join(args)} would not fork from the test's own zygote"
    else:
        forked = zygote.run(args, timeout, cwd, env) if cpus is None else None
    proc = forked or subprocess.run(
        [sys.executable, "-m", "asyncrl", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"},
        preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"asyncrl {' '.join(args)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def start_asyncrl(*args: str, log: Path, cwd: Path | None = None) -> subprocess.Popen | zygote.Forked:
    """``asyncrl *args`` in the background, its stdout and stderr into ``log``: a fork of the worker's zygote
    where it can be (as :func:`asyncrl`), else a fresh process. Either way ``.pid`` is the command's own
    process."""
    forked = zygote.start(args, cwd, log)
    if forked is not None:
        return forked
    with log.open("w") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "asyncrl", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


@contextlib.contextmanager
def serve_sidecar(model: Path, tmp_path_factory, *args: str, env: dict | None = None):
    """``asyncrl serve`` on ``model`` (a free port, loads allowed under the test's temp root) until the block
    ends: yields ``{"url", "model", "proc", "log"}``."""

    port = free_port()
    log = tmp_path_factory.mktemp("sidecar") / "inference.log"
    roots = f"inference.weights_roots=[{common_temp(tmp_path_factory)}]"  # the shared fixtures' models too
    serve = ("serve", f"model.name={model}", f"inference.port={port}", *MICRO_MODEL, roots, *args)
    # a fork of the worker's zygote where it can be (as asyncrl()), else a fresh process
    forked = zygote.start(serve, None, log, env)
    proc = (
        Proc("inference", forked, log)
        if forked
        else spawn("inference", [sys.executable, "-m", "asyncrl", *serve], log, env=env)
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, timeout_s=120)
        yield {"url": url, "model": str(model), "proc": proc, "log": log}
    finally:
        stop([proc], timeout_s=30)


def make_setup(root: Path) -> dict:
    """Data + micro model via `asyncrl prepare`, then a 100-step SFT warmup via `asyncrl sft`."""
    common = setup_paths(root)["common"]
    asyncrl("prepare", *common, *MICRO_MODEL, f"model.name={root / 'model'}", check=True)
    asyncrl(
        "sft",
        *common,
        f"model.name={root / 'model'}",
        f"sft.run_dir={root / 'sft'}",
        "sft.max_steps=100",
        check=True,
    )
    return setup_paths(root)


def setup_paths(root: Path) -> dict:
    """Where :func:`make_setup` puts things under ``root``, and the overrides that point at them."""
    common = [f"data_dir={root / 'data'}", *SMALL_TASK, "seq_len=256"]
    return {
        "root": root,
        "common": common,
        "base_model": root / "model",
        "sft_model": root / "sft" / "model",
    }


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
