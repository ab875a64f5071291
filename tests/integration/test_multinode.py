"""The SLURM templates' two trainer paths, without a cluster.

Multi-node: the trainer on two "nodes" (two torchrun invocations on localhost, one CPU process each, gloo)
trains exactly like one process, Fabric reading its ranks from the launcher's environment with
``trainer.fabric.num_nodes=2``; both nodes share one run_dir, as on a shared filesystem. Single node:
`asyncrl rl` run as srun's one task still starts a trainer on two devices (Fabric, not SLURM, starts its
ranks)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from asyncrl.utils.process import free_port
from helpers.launch import SMALL_TASK, asyncrl
from helpers.standin import build_standin, serve_standin
from helpers.synthetic import COMPARED, trainer_metrics, trainer_only_args, write_synthetic_rollouts

pytestmark = pytest.mark.slow

TIMEOUT_S = 300


def start_node(rank: int, port: int, args: list[str], log: Path) -> subprocess.Popen:
    """``torchrun --nnodes 2 --node-rank <rank>``: one node of two, in a process group of its own so that it
    and its worker stop together."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=1",
        f"--node-rank={rank}",
        "--master-addr=127.0.0.1",
        f"--master-port={port}",
        "-m",
        "asyncrl",
        "train",
        *args,
    ]
    with log.open("wb") as f:
        return subprocess.Popen(
            argv,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )


def wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """Exit codes once every process has exited, or as soon as one fails (``None`` for those still
    running)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
            return codes
        time.sleep(0.2)
    return [p.poll() for p in procs]


def test_trainer_on_two_torchrun_nodes_matches_one_process(micro_model, single_process_trainer, tmp_path):
    common = trainer_only_args(micro_model)
    single, nodes = single_process_trainer, tmp_path / "nodes"  # single: the session's one-process run
    write_synthetic_rollouts(nodes, steps=3, ranks=2)
    two_nodes = [
        *common,
        f"run_dir={nodes}",
        "trainer.fabric.strategy=fsdp2",
        "trainer.fabric.num_nodes=2",
        "trainer.fabric.devices=1",
    ]
    port = free_port()
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    procs = [start_node(rank, port, two_nodes, logs[rank]) for rank in (0, 1)]
    try:
        codes = wait_all(procs, TIMEOUT_S)
    finally:
        for p in procs:  # ours only, by process group: a node still running after a failure or the timeout
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    out = "\n".join(f"--- node {r} ---\n{logs[r].read_text(errors='replace')[-3000:]}" for r in (0, 1))
    assert codes == [0, 0], out

    metrics = {"single": trainer_metrics(single), "nodes": trainer_metrics(nodes)}
    assert [r["step"] for r in metrics["nodes"]] == [0, 1, 2]  # one row per step: only global rank 0 logs
    for key in COMPARED:
        a = [r[key] for r in metrics["single"]]
        b = [r[key] for r in metrics["nodes"]]
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7), key
    # the exported policy gathers node 1's shards too: the same update as one process's (see test_fsdp.py)
    one, two = (load_file(str(run / "weights" / "step_3" / "model.safetensors")) for run in (single, nodes))
    start = load_file(str(micro_model / "model.safetensors"))
    diff = sum(float((one[k] - two[k]).norm() ** 2) for k in one) ** 0.5
    update = sum(float((one[k] - start[k]).norm() ** 2) for k in one) ** 0.5
    assert update > 0 and diff / update < 1e-2, (diff, update)
    assert (nodes / "checkpoints" / "step_3" / "trainer" / "STABLE").exists()
    assert (nodes / "model" / "model.safetensors").is_file()


def test_rl_run_as_one_srun_task_trains_on_two_devices(micro_model, tmp_path):
    """single_node.sbatch runs `asyncrl rl` under `srun --ntasks=1`: the trainer inherits srun's task
    variables, which Lightning would take for a SLURM-launched world of one process (and then refuse
    devices=2)."""
    data = tmp_path / "data"
    # model.init.build=false: the data only; the session's micro model is used as it is
    asyncrl(
        "prepare",
        f"data_dir={data}",
        *SMALL_TASK,
        f"model.name={micro_model}",
        "model.init.build=false",
        check=True,
    )
    srun_task = {  # what srun sets for the one task of `srun --ntasks=1` in a job named asyncrl
        "SLURM_JOB_ID": "7",
        "SLURM_JOB_NAME": "asyncrl",
        "SLURM_NTASKS": "1",
        "SLURM_NTASKS_PER_NODE": "1",
        "SLURM_NNODES": "1",
        "SLURM_PROCID": "0",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
    }
    run = tmp_path / "rl"
    proc = asyncrl(
        "rl",
        f"data_dir={data}",
        *SMALL_TASK,
        f"model.name={micro_model}",
        f"run_dir={run}",
        "seq_len=128",
        "max_steps=2",
        "orchestrator.max_tokens=8",
        "orchestrator.prompts_per_step=4",
        "orchestrator.group_size=4",
        "trainer.fabric.strategy=fsdp2",
        "trainer.fabric.devices=2",
        "launcher.progress=false",
        env={**os.environ, **srun_task},
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in trainer_metrics(run)] == [0, 1]
    assert "MEMBER: 2/2" in (run / "logs" / "trainer.log").read_text()  # two ranks, started by Fabric


def test_orchestrator_packs_a_share_for_every_trainer_rank_on_every_node(setup, micro_model, tmp_path):
    """Each rank trains micro-batches ``rank, rank + world, ...`` of a step: with three one-device nodes the
    count must be a multiple of 3, or one rank waits in a collective that another never joins (the two-node
    SLURM job of tests/integration/test_slurm_cluster.py would hang)."""
    from asyncrl.config.compose import compose_config
    from asyncrl.orchestrator.orchestrate import Orchestrator

    run = tmp_path / "run"
    with serve_standin(build_standin()) as url:
        cfg = compose_config(
            [
                *setup["common"],
                f"model.name={micro_model}",
                f"run_dir={run}",
                f"inference.urls=[{url}]",
                "max_steps=4",
                "async_level=10",  # no trainer here: policy 0 serves every batch
                "trainer.keep_weights=12",
                "orchestrator.drop_zero_advantage=false",
                "orchestrator.save_samples=false",
                "orchestrator.max_tokens=8",
                "trainer.fabric.strategy=ddp",
                "trainer.fabric.num_nodes=3",
                "trainer.fabric.devices=1",
            ]
        )
        asyncio.run(asyncio.wait_for(Orchestrator(cfg).run_loop(), 60))
    counts = [
        json.loads((run / "rollouts" / f"step_{n}" / "meta.json").read_text())["num_micro_batches"]
        for n in range(4)
    ]
    assert all(c > 0 and c % 3 == 0 for c in counts), counts
