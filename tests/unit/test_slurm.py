"""`asyncrl slurm`: the rendered batch scripts parse (bash -n, shellcheck), run against stand-ins for srun,
scontrol and asyncrl (every process gets its node, GPUs, port and overrides; a failure ends the job and stops
the servers), and a bad option or override is refused before anything is written."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config.compose import compose_config
from asyncrl.launcher.slurm import cli
from asyncrl.utils.children import spawn
from asyncrl.utils.process import free_port
from helpers.launch import asyncrl

SHELLCHECK = Path(sys.executable).parent / "shellcheck"
# the overrides of every rendered script here: a small GPU run, FSDP2 over the trainer's GPUs
OVERRIDES = ["experiment=reverse_text", "trainer.fabric.strategy=fsdp2"]

# srun as far as the templates use it: --nodelist/--nodes, --ntasks-per-node, --ntasks, --output (%N, %t); as
# the real one, it takes the job's SLURM_NTASKS for --ntasks when not given one, and then spreads that many
# tasks over the nodes whatever --ntasks-per-node says; each task gets SLURM's task variables and runs in the
# background; SIGTERM stops them all, as srun's does
FAKE_SRUN = """#!{python}
import os, signal, subprocess, sys
args, opts = sys.argv[1:], {{}}
while args and args[0].startswith("-"):
    name, _, value = args.pop(0).partition("=")
    opts[name] = value
listed = opts["--nodelist"] if "--nodelist" in opts else os.environ["SLURM_JOB_NODELIST"]
nodes = listed.split(",") if "--nodelist" in opts else listed.split(",")[:1]
total = int(opts.get("--ntasks") or os.environ.get("SLURM_NTASKS") or 0)
total = total or len(nodes) * int(opts.get("--ntasks-per-node") or 1)
per_node = -(-total // len(nodes))
procs = []
stopped = []

def stop(signum, frame):  # no waiting in here: the interrupted p.wait() holds that Popen's lock
    stopped.append(signum)
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

signal.signal(signal.SIGTERM, stop)
for n, node in enumerate(nodes):
    for local in range(min(per_node, total - n * per_node)):
        if stopped:
            break
        rank = n * per_node + local
        env = dict(os.environ, SLURM_NTASKS=str(total), SLURM_NNODES=str(len(nodes)),
                   SLURM_NODELIST=",".join(nodes), SLURM_PROCID=str(rank), SLURM_LOCALID=str(local),
                   SLURM_NODEID=str(n), SLURMD_NODENAME=node, FAKE_SRUN_OPTS=" ".join(sorted(opts)))
        if "--ntasks-per-node" in opts:
            env["SLURM_NTASKS_PER_NODE"] = str(per_node)
        out = opts.get("--output", "").replace("%N", node).replace("%t", str(rank))
        log = open(out, "ab") if out else None
        procs.append(subprocess.Popen(args, env=env, stdout=log, stderr=log, start_new_session=True))

codes = [p.wait() for p in procs]
sys.exit(143 if stopped else max(codes))
"""

# scontrol: `show hostnames` and `show node` (NodeAddr from $FAKE_NODE_ADDRS, name=address pairs, else the
# name)
FAKE_SCONTROL = """#!/bin/bash
[[ $1 == show ]] || exit 1
case $2 in
  hostnames) tr , '\\n' <<< "$3" ;;
  node)
    addr=$3
    IFS=, read -r -a pairs <<< "${{FAKE_NODE_ADDRS:-}}"
    for pair in "${{pairs[@]}}"; do [[ ${{pair%%=*}} == "$3" ]] && addr=${{pair#*=}}; done
    printf 'NodeName=%s Arch=x86_64\\n   NodeAddr=%s NodeHostName=%s Version=22.05.8\\n' "$3" "$addr" "$3" ;;
  *) exit 1 ;;
esac
"""

# asyncrl: records its arguments and environment; `serve` answers /health on its node's NodeAddr and port
# until stopped; the command named in $FAKE_FAIL exits 3, the others succeed
FAKE_ASYNCRL = """#!{python}
import http.server, json, os, sys, time
cmd, args = sys.argv[1], sys.argv[2:]
keys = ("CUDA_VISIBLE_DEVICES", "MASTER_ADDR", "MASTER_PORT", "SLURMD_NODENAME", "SLURM_PROCID",
        "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_NTASKS_PER_NODE", "FAKE_SRUN_OPTS")
record = {{"cmd": cmd, "args": args, "pid": os.getpid(), "env": {{k: os.environ.get(k) for k in keys}}}}
with open(os.path.join(os.environ["FAKE_RECORDS"], f"{{cmd}}-{{os.getpid()}}.json"), "w") as f:
    json.dump(record, f)
if cmd == "serve":
    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    port = int([a for a in args if a.startswith("inference.port=")][-1].split("=")[1])
    node = os.environ["SLURMD_NODENAME"]
    addrs = dict(p.split("=") for p in os.environ.get("FAKE_NODE_ADDRS", "").split(",") if p)
    http.server.HTTPServer((addrs.get(node, node), port), Health).serve_forever()
time.sleep(0.2)
sys.exit(3 if cmd == os.environ.get("FAKE_FAIL") else 0)
"""


@pytest.fixture
def fake_slurm(tmp_path) -> dict:
    """A directory of stand-ins that goes first on PATH, and where their records land."""
    bin_dir, records = tmp_path / "bin", tmp_path / "records"
    bin_dir.mkdir()
    records.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL), ("asyncrl", FAKE_ASYNCRL)):
        (bin_dir / name).write_text(text.format(python=sys.executable))
        (bin_dir / name).chmod(0o755)
    return {"bin": bin_dir, "records": records}


def render(tmp_path, *argv: str) -> Path:
    out = tmp_path / "job.sbatch"
    assert cli([*argv, "--out", str(out), "--workdir", str(tmp_path)]) == 0
    return out


def run_job(
    script: Path, fake: dict, nodes: list[str], gpus: str, **env: str
) -> subprocess.CompletedProcess:
    """The script as sbatch would run it on the first of ``nodes``; its processes stop with it (by group)."""
    per_node = re.search(r"^#SBATCH --ntasks-per-node=(\d+)$", script.read_text(), re.MULTILINE)
    job_env = {
        **os.environ,
        "PATH": f"{fake['bin']}:{os.environ['PATH']}",
        "FAKE_RECORDS": str(fake["records"]),
        "SLURM_JOB_NODELIST": ",".join(nodes),
        "SLURM_JOB_ID": "4242",
        "SLURM_NTASKS": str(len(nodes) * int(per_node.group(1) if per_node else 1)),  # every task of the job
        "SLURM_CPUS_PER_TASK": "2",
        "CUDA_VISIBLE_DEVICES": gpus,
        "ASYNCRL_POLL_S": "0.2",
        **env,
    }
    proc = subprocess.Popen(
        ["bash", str(script)], cwd=script.parent, env=job_env, text=True, start_new_session=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def records(fake: dict, cmd: str) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(fake["records"].glob(f"{cmd}-*.json"))]


def arg(record: dict, key: str) -> str:
    return [a for a in record["args"] if a.startswith(key + "=")][-1].split("=", 1)[1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("template", ["single_node", "multi_node"])
def test_rendered_scripts_parse(tmp_path, template):
    extra = [
        "--container-image",
        "nvcr.io#org/asyncrl:gpu",
        "--setup",
        "module load cuda",
        "--partition",
        "gpu",
    ]
    script = render(tmp_path, template, *extra, *OVERRIDES, "model.name=${sft.run_dir}/model")
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # the dev extra's (docker/install.sh is checked with it); info-level notes are intended
    if SHELLCHECK.exists():
        proc = subprocess.run(
            [str(SHELLCHECK), "--severity=warning", str(script)], capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stdout
    text = script.read_text()
    assert "{{" not in text and "#SBATCH --partition=gpu" in text
    assert (
        "ARGS=(experiment=reverse_text trainer.fabric.strategy=fsdp2 'model.name=${sft.run_dir}/model')"
        in text
    )
    assert "--container-image='nvcr.io#org/asyncrl:gpu'" in text and "\nmodule load cuda\n" in text


def test_multi_node_lines_for_two_trainer_and_two_inference_nodes(tmp_path):
    (tmp_path / "conf").mkdir()
    argv = [
        "--trainer-nodes",
        "2",
        "--inference-nodes",
        "2",
        "--config-dir",
        str(tmp_path / "conf"),
        *OVERRIDES,
    ]
    text = render(tmp_path, "multi_node", *argv).read_text()
    # every command gets it too
    assert f"ARGS=(--config-dir {tmp_path / 'conf'} experiment=reverse_text" in text
    assert "#SBATCH --nodes=4\n#SBATCH --ntasks-per-node=8\n" in text
    assert "export TRAINER_NODES=2 INFERENCE_NODES=2 GPUS_PER_NODE=8\n" in text
    assert (
        "export TASKS_PER_NODE=8  #" in text and "#SBATCH --cpus-per-task=8\n#SBATCH --gres=gpu:8\n" in text
    )
    assert (
        'srun --nodes="$TRAINER_NODES" --ntasks=$((TRAINER_NODES * TASKS_PER_NODE)) '
        '--ntasks-per-node="$TASKS_PER_NODE"' in text
    )
    assert '"trainer.fabric.num_nodes=$TRAINER_NODES" "trainer.fabric.devices=$TASKS_PER_NODE"' in text
    assert '"inference.urls=[$(join "${URLS[@]}")]"' in text
    assert "--output=outputs/reverse_text/rl/logs/inference-%N-%t.log" in text
    # weights.transport=filesystem has no rendezvous for the script to place
    assert "weights.nccl" not in text


def test_multi_node_job_gives_every_process_its_node_gpus_port_and_urls(tmp_path, fake_slurm):
    """2 trainer + 2 inference nodes of 2 GPUs, named as no resolver knows them: slurm.conf gives each a
    NodeAddr, the loopback addresses 127.0.0.x, which is where the processes must reach each other."""
    port = free_port()
    script = render(
        tmp_path,
        "multi_node",
        "--trainer-nodes=2",
        "--inference-nodes=2",
        "--gpus-per-node=2",
        f"--port={port}",
        "--health-timeout=20",
        *OVERRIDES,
        # a transport with a rendezvous: the script places it on trainer node 0
        "weights.transport=nccl",
        "strict_async=true",
    )
    nodes = ["node-a", "node-b", "node-c", "node-d"]
    addrs = dict(zip(nodes, (f"127.0.0.{i}" for i in (11, 12, 13, 14)), strict=True))
    proc = run_job(
        script, fake_slurm, nodes, gpus="0,1", FAKE_NODE_ADDRS=",".join(f"{n}={a}" for n, a in addrs.items())
    )
    assert proc.returncode == 0, proc.stderr
    (reconcile,) = records(fake_slurm, "reconcile")
    assert reconcile["env"]["SLURMD_NODENAME"] == nodes[0]

    serve = records(fake_slurm, "serve")
    slots = {
        (r["env"]["SLURMD_NODENAME"], r["env"]["CUDA_VISIBLE_DEVICES"], int(arg(r, "inference.port")))
        for r in serve
    }
    assert slots == {(n, str(g), port + g) for n in nodes[2:] for g in (0, 1)}
    assert all(
        arg(r, "inference.host") == "0.0.0.0" and arg(r, "inference.backend") == "vllm" for r in serve
    )

    train = records(fake_slurm, "train")
    assert sorted(int(r["env"]["SLURM_PROCID"]) for r in train) == [0, 1, 2, 3]
    assert {r["env"]["SLURMD_NODENAME"] for r in train} == set(nodes[:2])
    # what Fabric's SLURM environment reads: 2 tasks per node on 2 nodes, rank 0's host as the rendezvous
    assert all(r["env"]["SLURM_NTASKS_PER_NODE"] == "2" and r["env"]["SLURM_NNODES"] == "2" for r in train)
    assert {r["env"]["MASTER_ADDR"] for r in train} == {addrs[nodes[0]]}

    (orchestrate,) = records(fake_slurm, "orchestrate")
    assert orchestrate["env"]["SLURMD_NODENAME"] == nodes[2]
    # steps that share inference node 0 must say so, or SLURM runs the orchestrator once the servers have
    # ended
    assert (
        "--overlap" in orchestrate["env"]["FAKE_SRUN_OPTS"]
        and "--overlap" in serve[0]["env"]["FAKE_SRUN_OPTS"]
    )
    # every process composes the same config (the real composer, as the processes would)
    cfgs = [compose_config(r["args"]) for r in (reconcile, serve[0], train[0], orchestrate)]
    urls = sorted(f"http://{addrs[n]}:{port + g}" for n in nodes[2:] for g in (0, 1))
    for cfg in cfgs:
        assert sorted(cfg.inference.urls) == urls
        fab = cfg.trainer.fabric
        assert (fab.num_nodes, fab.devices, fab.strategy, fab.accelerator) == (2, 2, "fsdp2", "cuda")
        assert (
            cfg.inference.admin_token == cfgs[0].inference.admin_token
            and len(cfg.inference.admin_token) == 32
        )
        assert cfg.weights.nccl.host == addrs[nodes[0]]
    assert not any(alive(r["pid"]) for r in serve), "the servers outlived the job"


def test_cpu_nodes_run_the_builtin_sidecar_and_one_trainer_process_per_node(tmp_path, fake_slurm):
    """--gpus-per-node=0: no GPU request, one hf sidecar on the inference node, the trainer's two ranks on
    CPU (the job has no SLURM_CPUS_PER_TASK then: each step takes SLURM_CPUS_ON_NODE)."""
    port = free_port()
    script = render(
        tmp_path,
        "multi_node",
        "--gpus-per-node=0",
        "--trainer-nodes=2",
        f"--port={port}",
        "--health-timeout=20",
        *OVERRIDES,
    )
    text = script.read_text()
    assert "--gres" not in text and "#SBATCH --ntasks-per-node=1\n" in text
    nodes = ["127.0.0.51", "127.0.0.52", "127.0.0.53"]
    proc = run_job(script, fake_slurm, nodes, gpus="", SLURM_CPUS_PER_TASK="", SLURM_CPUS_ON_NODE="4")
    assert proc.returncode == 0, proc.stderr
    (serve,) = records(fake_slurm, "serve")
    assert serve["env"]["SLURMD_NODENAME"] == nodes[2] and int(arg(serve, "inference.port")) == port
    train = records(fake_slurm, "train")
    assert sorted(r["env"]["SLURMD_NODENAME"] for r in train) == nodes[:2]
    cfg = compose_config(train[0]["args"])
    fab = cfg.trainer.fabric
    assert (fab.accelerator, fab.num_nodes, fab.devices, cfg.inference.backend) == ("cpu", 2, 1, "hf")
    assert cfg.inference.urls == [f"http://{nodes[2]}:{port}"]

    single = render(tmp_path, "single_node", "--gpus-per-node=0", *OVERRIDES, "trainer.fabric.devices=2")
    assert run_job(single, fake_slurm, nodes[:1], gpus="", SLURM_CPUS_ON_NODE="4").returncode == 0
    (rl,) = records(fake_slurm, "rl")
    cfg = compose_config(rl["args"])
    assert (cfg.trainer.fabric.accelerator, cfg.trainer.fabric.devices, cfg.inference.backend) == (
        "cpu",
        2,
        "hf",
    )


def test_vllm_data_parallelism_makes_one_server_per_node(tmp_path, fake_slurm):
    port = free_port()
    script = render(
        tmp_path, "multi_node", "--gpus-per-node=2", f"--port={port}", *OVERRIDES,
        "inference.vllm.extra_args=[--data-parallel-size,2]",
    )  # fmt: skip
    proc = run_job(script, fake_slurm, ["127.0.0.21", "127.0.0.22"], gpus="6,7")
    assert proc.returncode == 0, proc.stderr
    (serve,) = records(fake_slurm, "serve")
    assert (serve["env"]["CUDA_VISIBLE_DEVICES"], int(arg(serve, "inference.port"))) == ("6,7", port)
    assert compose_config(serve["args"]).inference.vllm.extra_args == ["--data-parallel-size", "2"]


def test_a_failed_process_ends_the_job_and_stops_the_servers(tmp_path, fake_slurm):
    script = render(tmp_path, "multi_node", "--gpus-per-node=1", f"--port={free_port()}", *OVERRIDES)
    proc = run_job(script, fake_slurm, ["127.0.0.31", "127.0.0.32"], gpus="0", FAKE_FAIL="orchestrate")
    assert proc.returncode == 3
    assert (
        "the orchestrator exited with code 3; its log: outputs/reverse_text/rl/logs/orchestrator.log"
        in proc.stderr
    )
    assert not any(alive(r["pid"]) for r in records(fake_slurm, "serve"))


@pytest.mark.parametrize("tp,expected", [(1, "['4','5']"), (2, "['4,5']")])
def test_single_node_splits_the_jobs_gpus(tmp_path, fake_slurm, tp, expected):
    """The job's GPUs are 4-7 (no device cgroup): the first two serve, the other two train."""
    script = render(
        tmp_path, "single_node", "--gpus-per-node=4", "--inference-gpus=2", *OVERRIDES,
        f"inference.tensor_parallel={tp}",
    )  # fmt: skip
    proc = run_job(script, fake_slurm, ["127.0.0.41"], gpus="4,5,6,7")
    assert proc.returncode == 0, proc.stderr
    (rl,) = records(fake_slurm, "rl")
    assert arg(rl, "inference.gpus") == expected and arg(rl, "trainer.fabric.gpus") == "'6,7'"
    cfg = compose_config(rl["args"])
    assert (cfg.trainer.fabric.gpus, cfg.trainer.fabric.devices, cfg.inference.backend) == ("6,7", 2, "vllm")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["multi_node", "--trainer-nodes", "0"],
         "argument --trainer-nodes: 0 is not allowed; allowed values: an integer >= 1"),
        (["multi_node", "--inference-nodes", "x"], "argument --inference-nodes: 'x' is not allowed"),
        (["single_node", "--time", "25h"], "argument --time: '25h' is not allowed; allowed values: SLURM's"),
        (["three_nodes"], "invalid choice: 'three_nodes'"),
    ],
)  # fmt: skip
def test_a_bad_option_names_itself_and_the_allowed_values(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        cli([*argv, "--out", str(tmp_path / "job.sbatch")])
    assert e.value.code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "job.sbatch").exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["multi_node", "trainer.fabric.devices=4"], "trainer.fabric.devices is set by --gpus-per-node"),
        (
            ["single_node", "+trainer.fabric.gpus=0"],
            "trainer.fabric.gpus is set by --inference-gpus and --gpus-per",
        ),
        (["multi_node", "inference.urls=[http://a:1]"], "inference.urls is set by the template"),
        (
            ["single_node", "--gpus-per-node=8", "--inference-gpus=8"],
            "--inference-gpus=8 is not allowed; allowed values: 1 .. 7",
        ),
        (
            ["single_node", "--gpus-per-node=1"],
            "--gpus-per-node=1: single_node puts the sidecars and the trainer",
        ),
        (["multi_node", "--inference-gpus=2"], "--inference-gpus is for single_node"),
        (["single_node", "--gpus-per-node=0", "--inference-gpus=1"], "--inference-gpus needs GPUs"),
        (
            ["multi_node", "--gpus-per-node=0", "inference.backend=vllm"],
            "inference.backend is set by the template",
        ),
        (["multi_node", "trainer.optim.lrr=1"], "did you mean trainer.optim.lr?"),
        (["multi_node", "trainer.fabric.strategy=auto"], "add trainer.fabric.strategy=fsdp2"),
        (
            [
                "multi_node",
                "--gpus-per-node=8",
                "trainer.fabric.strategy=fsdp2",
                "inference.tensor_parallel=3",
            ],
            "--gpus-per-node=8 is not a multiple of the 3 GPUs",
        ),
        (
            ["multi_node", "trainer.fabric.strategy=fsdp2", "inference.vllm.extra_args=[--headless]"],
            "vLLM's multi-node data parallelism",
        ),
        (
            [
                "multi_node",
                "trainer.fabric.strategy=fsdp2",
                "weights.transport=nccl",
                "inference.vllm.extra_args=[--data-parallel-size,2]",
            ],
            "use weights.transport=filesystem",
        ),
        (
            [
                "multi_node",
                "trainer.fabric.strategy=fsdp2",
                "weights.transport=nccl",
                "strict_async=true",
                "weights.nccl.port=5",
            ],
            "weights.nccl.port is set by the script (trainer node 0, a port from the job id)",
        ),
        (
            ["multi_node", "trainer.fabric.strategy=fsdp2", "run_dir=runs/a b"],
            "run_dir=runs/a b: the script writes it",
        ),
    ],
)
def test_a_bad_combination_is_refused_before_anything_is_written(tmp_path, capsys, argv, message):
    assert cli([*argv, "--out", str(tmp_path / "job.sbatch")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "job.sbatch").exists()


def test_the_command_writes_the_script_and_says_how_to_submit_it(tmp_path):
    proc = asyncrl(
        "slurm", "multi_node", "--trainer-nodes=2", "--inference-nodes=2", *OVERRIDES, cwd=tmp_path
    )
    out = tmp_path / "outputs" / "slurm" / "asyncrl.sbatch"
    assert proc.returncode == 0 and f"submit it with: sbatch {out.relative_to(tmp_path)}" in proc.stdout, (
        proc.stderr
    )
    assert f"#SBATCH --chdir={tmp_path}\n" in out.read_text()
    bad = asyncrl("slurm", "multi_node", "trainer.fabric.num_nodes=3", cwd=tmp_path)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "trainer.fabric.num_nodes is set by --trainer-nodes" in bad.stderr


def test_rendering_imports_neither_torch_nor_vllm(tmp_path):
    argv = ["slurm", "multi_node", "trainer.fabric.strategy=fsdp2", "--out", str(tmp_path / "job.sbatch")]
    code = (
        f"import sys; from asyncrl.cli import main; assert main({argv!r}) == 0; "
        "assert 'torch' not in sys.modules and 'vllm' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_spawn_can_remove_a_variable(tmp_path, monkeypatch):
    """`asyncrl rl` hides SLURM_NTASKS from its trainer, so that inside a SLURM step Fabric starts the
    trainer's ranks itself instead of taking the one process for all of them."""
    monkeypatch.setenv("SLURM_NTASKS", "1")
    code = "import os; print(os.environ.get('SLURM_NTASKS', 'unset'))"
    proc = spawn("probe", [sys.executable, "-c", code], tmp_path / "probe.log", {"SLURM_NTASKS": None})
    assert proc.popen.wait(timeout=30) == 0
    assert (tmp_path / "probe.log").read_text().strip() == "unset"
