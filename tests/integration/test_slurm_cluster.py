"""The rendered SLURM scripts, submitted with the real ``sbatch`` to a real SLURM cluster of three nodes on
this machine (tests/helpers/slurm_cluster.py), on CPU nodes (``--gpus-per-node 0``).

single_node: ``asyncrl rl`` as the job's one srun task learns exactly as the same ``asyncrl rl`` run outside
SLURM (the session's ``straight`` run), metric for metric. multi_node: the trainer as two srun tasks on two
nodes (FSDP2 over gloo, Fabric reading its ranks from SLURM), the built-in sidecar and the orchestrator on
the third, every process reaching the others at their node's NodeAddr; its losses are the one-process run's,
to the tolerance of tests/integration/test_multinode.py. Skipped where SLURM is not installed (the reason
names the install command).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

import helpers.metrics
from asyncrl.launcher.slurm import cli
from asyncrl.utils.process import free_port
from helpers.launch import rl_args
from helpers.required import require
from helpers.slurm_cluster import Cluster, missing, slurm_cluster
from helpers.synthetic import COMPARED

pytestmark = pytest.mark.slow

STEPS = 3  # step 2 trains on rollouts of policy 1: a weight update has reached the sidecar on its node
JOB_TIMEOUT_S = 300


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Cluster:
    require(missing(), "a SLURM cluster (slurmctld, slurmd)")
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as c:
        yield c


def submit(cluster: Cluster, workdir: Path, template: str, *argv: str) -> tuple[int, dict[str, str]]:
    """Render ``template`` into ``workdir``, submit it and wait for the job's end; returns its id and
    record."""
    script = workdir / f"{template}.sbatch"
    options = ["--gpus-per-node=0", "--time=10", f"--job-name={template}", f"--workdir={workdir}"]
    assert cli([template, *options, "--out", str(script), *argv]) == 0
    # the job runs this interpreter's `asyncrl` (and this PYTHONPATH): sbatch passes its environment on
    env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "ASYNCRL_POLL_S": "1"}
    job = cluster.sbatch(script, env)
    record = cluster.wait(job, JOB_TIMEOUT_S)
    output = (workdir / f"{template}-{job}.out").read_text(errors="replace")[-4000:]
    assert (record["State"], record["ExitCode"]) == ("COMPLETED", "0:0"), (
        f"{record}\n{output}\n{cluster.logs()}"
    )
    return job, record


def learning_metrics(run_dir: Path, process: str) -> list[dict]:
    return helpers.metrics.learning_metrics(run_dir / "metrics" / f"{process}.jsonl")


def test_single_node_job_learns_as_asyncrl_rl_does(setup, straight, cluster, tmp_path):
    run = tmp_path / "rl"
    _, record = submit(cluster, tmp_path, "single_node", *rl_args(setup, run, f"max_steps={STEPS}"))
    assert record["NodeList"] in cluster.nodes
    for process in ("orchestrator", "trainer"):
        assert learning_metrics(run, process) == learning_metrics(straight, process)[:STEPS], process


def test_multi_node_job_trains_across_two_nodes_as_one_process(setup, straight, cluster, tmp_path):
    run, port = tmp_path / "rl", free_port()
    argv = ["--trainer-nodes=2", "--inference-nodes=1", f"--port={port}", "--health-timeout=300"]
    overrides = rl_args(setup, run, f"max_steps={STEPS}", "trainer.fabric.strategy=fsdp2")
    job, record = submit(cluster, tmp_path, "multi_node", *argv, *overrides)
    assert record["NodeList"] == "node[1-3]"
    # the script's srun steps: 0 reconcile on node1, 1 the sidecar on node3, then together (2 and 3, either
    # way) the trainer's two tasks on node1 and node2 and the orchestrator on node3
    on = {n: cluster.steps_on(n, job) for n in cluster.nodes}
    (trainer,) = on["node2"]
    assert on == {"node1": {0, trainer}, "node2": {trainer}, "node3": {1, 5 - trainer}} and trainer in (
        2,
        3,
    ), on
    sidecar = f"http://{cluster.addrs['node3']}:{port}"  # node3's NodeAddr: its name resolves nowhere
    assert f"- {sidecar}\n" in (run / "configs" / "orchestrator.yaml").read_text()
    trainer_log = (run / "logs" / "trainer.log").read_text()  # srun --label: each line starts with its rank
    assert "0: " in trainer_log and "1: " in trainer_log and "MEMBER: 2/2" in trainer_log

    rows = {
        "slurm": learning_metrics(run, "trainer"),
        "straight": learning_metrics(straight, "trainer")[:STEPS],
    }
    assert [r["step"] for r in rows["slurm"]] == list(range(STEPS))
    for key in COMPARED:
        a = [r[key] for r in rows["straight"]]
        b = [r[key] for r in rows["slurm"]]
        assert a == pytest.approx(b, rel=1e-5, abs=1e-7), key
    # strict async_level=1: step 2's rollouts came from policy 1, which the orchestrator sent to the sidecar
    assert [r["async/staleness"] for r in learning_metrics(run, "orchestrator")] == [0, 1, 1]
