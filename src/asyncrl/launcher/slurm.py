"""``asyncrl slurm <template> [options] [overrides]``: render a SLURM batch script for an RL run.

The templates are bash scripts with ``{{name}}`` placeholders in ``asyncrl/slurm/`` (``slurm/`` at the
repository root): ``single_node`` runs ``asyncrl rl`` on one node, its GPUs split between the sidecars and
the trainer; ``multi_node`` splits one allocation by node list into N trainer nodes (``asyncrl train`` under
srun, one task per GPU, which Fabric detects) and M inference nodes (``asyncrl serve`` per server slot), with
the orchestrator on the first inference node. ``--gpus-per-node 0`` makes them CPU jobs: the built-in (hf)
sidecar, one per inference node, and a CPU trainer, one process per trainer node (gloo). Processes find each
other by each node's ``NodeAddr`` (``scontrol show node``), which is the node's name unless slurm.conf sets
another. Hydra overrides pass through to every process. They are
composed here first, so a mistyped key fails now rather than after the job has waited in the queue; keys the
template sets itself (GPUs, node counts, URLs) are refused in them. Torch-free: it only writes a file.
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

from asyncrl.config import Config, ConfigError
from asyncrl.config.compose import compose_config
from asyncrl.config.layout import parallel_sizes
from asyncrl.launcher.slurm_options import Job, build_parser
from asyncrl.paths import RunDir
from asyncrl.transport.base import transport_of
from asyncrl.utils.atomic import write_text_atomic

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "slurm"
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
# where multi_node puts a transport's rendezvous: trainer node 0, a port from the job id (the script's
# variables, expanded when it runs)
RENDEZVOUS = ("$MASTER_ADDR", "$((MASTER_PORT + 1))")
# what the scripts write unquoted into srun's --output patterns and messages: no spaces, quotes or '%'
_SAFE_PATH = re.compile(r"^[\w./+@:,=~-]+$")

# override keys each template sets itself, and what sets them
_OWNED_BOTH = {
    "inference.backend": "the template (vllm)",
    "inference.urls": "the template",
    "trainer.fabric.accelerator": "the template (cuda)",
}
OWNED = {
    "single_node": {
        **_OWNED_BOTH,
        "inference.gpus": "--inference-gpus",
        "trainer.fabric.gpus": "--inference-gpus and --gpus-per-node",
        "trainer.fabric.devices": "--inference-gpus and --gpus-per-node",
        "trainer.fabric.num_nodes": "the template (1)",
    },
    "multi_node": {
        **_OWNED_BOTH,
        "inference.gpus": "the template (one GPU set per server slot)",
        "inference.host": "the template (0.0.0.0)",
        "inference.port": "--port",
        "inference.admin_token": "the script (a random token per job, or $ASYNCRL_ADMIN_TOKEN)",
        "trainer.fabric.gpus": "the template (each task sees its node's GPUs)",
        "trainer.fabric.devices": "--gpus-per-node",
        "trainer.fabric.num_nodes": "--trainer-nodes",
    },
}
# on CPU nodes (--gpus-per-node=0) the template sets the backend and the accelerator, and no GPU keys
_OWNED_CPU = {
    "inference.backend": "the template (hf on CPU nodes)",
    "trainer.fabric.accelerator": "the template (cpu on CPU nodes)",
}
_NOT_OWNED_CPU = {"single_node": ("inference.gpus", "trainer.fabric.gpus", "trainer.fabric.devices")}


def owned(job: Job) -> dict[str, str]:
    """The override keys ``job``'s script sets itself, and what sets them."""
    if job.gpus_per_node > 0:
        return OWNED[job.template]
    keys = {**OWNED[job.template], **_OWNED_CPU}
    for key in _NOT_OWNED_CPU.get(job.template, ()):
        del keys[key]
    return keys


def owned_overrides(job: Job) -> list[str]:
    """The overrides each template appends, with stand-in values for what only the job knows (hosts, token),
    for checking that the whole config composes."""
    g = job.gpus_per_node
    if g == 0:
        common = ["inference.backend=hf", "trainer.fabric.accelerator=cpu"]
    else:
        common = ["inference.backend=vllm", "trainer.fabric.accelerator=cuda"]
    if job.template == "single_node" and g == 0:
        return [*common, "trainer.fabric.num_nodes=1"]
    # (inference.gpus left out: how many servers depends on the config itself)
    if job.template == "single_node":
        i = job.inference_gpus or 0
        trainer_gpus = ",".join(str(x) for x in range(i, g))
        return [
            *common,
            "trainer.fabric.num_nodes=1",
            f"trainer.fabric.gpus='{trainer_gpus}'",
            f"trainer.fabric.devices={g - i}",
        ]
    return [
        *common,
        f"trainer.fabric.num_nodes={job.trainer_nodes}",
        f"trainer.fabric.devices={max(g, 1)}",
        f"inference.urls=['http://inference-node:{job.port}']",
        "inference.admin_token=token",
    ]


def check(job: Job) -> tuple[Config, int]:
    """Raise ``ValueError`` naming the option or key for anything the script could not run with; returns the
    composed config (with stand-ins for what the job decides) and the GPUs per server."""
    keys = owned(job)
    for arg in job.overrides:
        key = arg.lstrip("+~").partition("=")[0]
        if key in keys:
            raise ValueError(
                f"{key} is set by {keys[key]} in the {job.template} template; "
                f"remove {arg!r} from the overrides"
            )
    g = job.gpus_per_node
    if g == 0 and job.inference_gpus is not None:
        raise ValueError(
            "--inference-gpus needs GPUs: with --gpus-per-node=0 the sidecar and the trainer share the CPUs"
        )
    if job.template == "single_node" and g > 0:
        assert job.inference_gpus is not None
        if g < 2:
            raise ValueError(
                f"--gpus-per-node={g}: single_node puts the sidecars and the trainer "
                "on separate GPUs, so it needs "
                "at least 2; on one GPU run `asyncrl rl` with inference.gpus=['0'] trainer.fabric.gpus=0"
            )
        if job.inference_gpus >= g:
            raise ValueError(
                f"--inference-gpus={job.inference_gpus} is not allowed; allowed values: 1 .. {g - 1} "
                f"(--gpus-per-node={g}, and the trainer needs at least one)"
            )
    elif job.template == "multi_node" and job.inference_gpus is not None:
        raise ValueError(
            "--inference-gpus is for single_node; multi_node serves on every GPU of --inference-nodes"
        )
    try:
        cfg = compose_config([*job.overrides, *owned_overrides(job)], job.config_dirs)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    sizes = parallel_sizes(list(cfg.inference.vllm.extra_args), cfg.inference.tensor_parallel)
    per_server = sizes["tp"] * sizes["pp"] * sizes["dp"] if g > 0 else 1
    serving = job.inference_gpus if job.template == "single_node" else g
    if g > 0 and serving is not None and serving % per_server:
        option = "--inference-gpus" if job.template == "single_node" else "--gpus-per-node"
        raise ValueError(
            f"{option}={serving} is not a multiple of the {per_server} GPUs each vLLM server takes "
            f"(inference.tensor_parallel={cfg.inference.tensor_parallel}, inference.vllm.extra_args="
            f"{list(cfg.inference.vllm.extra_args)})"
        )
    if job.template == "multi_node":
        placed = transport_of(cfg).placed_rendezvous(*RENDEZVOUS)
        for arg in job.overrides:
            key = arg.lstrip("+~").partition("=")[0]
            if key in {o.partition("=")[0] for o in placed}:
                raise ValueError(
                    f"{key} is set by the script (trainer node 0, a port from the job id) in the multi_node "
                    f"template; remove {arg!r} from the overrides"
                )
    fab = cfg.trainer.fabric
    if fab.devices * fab.num_nodes > 1 and fab.strategy == "auto":
        raise ValueError(
            "trainer.fabric.strategy=auto trains on one device, and this job gives the trainer "
            f"{fab.num_nodes} node(s) x {fab.devices} device(s): add trainer.fabric.strategy=fsdp2 (or ddp)"
        )
    for what, path in (("--workdir", Path(job.workdir).resolve()), ("run_dir", cfg.run_dir)):
        if not _SAFE_PATH.match(str(path)):
            raise ValueError(
                f"{what}={path}: the script writes it unquoted; use letters, digits and . _ / + - = , @ ~"
            )
    return cfg, per_server


def render_template(text: str, values: dict[str, str]) -> str:
    """Fill every ``{{name}}`` in one pass (a value that contains ``{{...}}`` is not filled again)."""
    missing = sorted(set(_PLACEHOLDER.findall(text)) - set(values))
    assert not missing, f"no value for {missing}"
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def render(job: Job, argv: list[str]) -> str:
    """The batch script for ``job``; ``argv`` (the command's arguments) is recorded in its header."""
    cfg, per_server = check(job)
    run = RunDir(cfg.run_dir)
    g = job.gpus_per_node
    args = [a for d in job.config_dirs for a in ("--config-dir", str(Path(d).resolve()))] + job.overrides
    container = ""
    if job.container_image:
        # the job's working directory (run_dir, data and models under it) is the same path in the container
        container = f'--container-image={shlex.quote(job.container_image)} --container-mounts="$PWD:$PWD" '
        container += '--container-workdir="$PWD"'
    extra = [f"#SBATCH --partition={job.partition}"] if job.partition else []
    extra += [f"#SBATCH --account={job.account}"] if job.account else []
    cpus_per_task = job.cpus_per_gpu * (g if job.template == "single_node" else 1)
    resources = f"#SBATCH --cpus-per-task={cpus_per_task}\n#SBATCH --gres=gpu:{g}"
    if g == 0:  # (what SLURM_CPUS_ON_NODE then counts: --exclusive gives each task's node all its cores)
        resources = (
            "# CPU nodes (--gpus-per-node=0): no GPUs requested; each step takes all cores of its node"
        )
    values = {
        # a newline in an argument would end the comment line
        "rendered_by": shlex.join(["asyncrl", "slurm", *argv]).replace("\n", "\\n"),
        "job_name": job.job_name,
        "time": job.time,
        "workdir": str(Path(job.workdir).resolve()),
        "job_log": "%x-%j.out",
        "extra_sbatch": "\n".join(extra) or "# (no --partition or --account: the cluster's defaults)",
        "setup": "\n".join(job.setup) or ":",
        "args": " ".join(shlex.quote(a) for a in args),
        "container": container,
        "gpus_per_node": str(g),
        "resources": resources,
        "backend": "vllm" if g else "hf",
        "accelerator": "cuda" if g else "cpu",
        "gpus_per_server": str(per_server),
        "log_dir": str(run.logs),
    }
    if job.template == "single_node":
        values |= {
            "inference_gpus": str(job.inference_gpus or 0),
            "trainer_gpus": str(g - (job.inference_gpus or 0)),
        }
    else:
        n, m, servers = job.trainer_nodes, job.inference_nodes, max(g // per_server, 1)
        values |= {
            "tasks_per_node": str(max(g, 1)),
            "nodes": str(n + m),
            "trainer_nodes": str(n),
            "inference_nodes": str(m),
            "last_trainer": str(n - 1),
            "last_node": str(n + m - 1),
            "servers_per_node": str(servers),
            "rendezvous": " ".join(f'"{o}"' for o in transport_of(cfg).placed_rendezvous(*RENDEZVOUS)),
            "port": str(job.port),
            "last_port": str(job.port + servers - 1),
            "health_timeout": str(job.health_timeout),
            # srun's filename patterns: %N the node's name, %t the task's rank in its step
            "inference_log": str(run.log("inference-%N-%t")),
            "trainer_log": str(run.log("trainer")),
            "orchestrator_log": str(run.log("orchestrator")),
        }
    return render_template((TEMPLATE_DIR / f"{job.template}.sbatch").read_text(), values)


def cli(argv: list[str]) -> int:
    """``asyncrl slurm``: parse, check, render and write; exit 2 with the reason on a bad option or
    override."""
    ns = build_parser().parse_intermixed_args(argv)
    job = Job(**vars(ns))
    try:
        script = render(job, argv)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if job.out == "-":
        sys.stdout.write(script)
        return 0
    out = Path(job.out.replace("{job_name}", job.job_name))
    write_text_atomic(out, script)
    os.chmod(out, 0o755)
    if job.template == "single_node" and job.gpus_per_node == 0:
        layout = "1 CPU node"
    elif job.template == "single_node":
        train = job.gpus_per_node - (job.inference_gpus or 0)
        layout = f"1 node: {job.inference_gpus} GPU(s) serve, {train} train"
    elif job.gpus_per_node == 0:
        layout = f"{job.trainer_nodes} trainer + {job.inference_nodes} inference CPU node(s)"
    else:
        nodes = f"{job.trainer_nodes} trainer + {job.inference_nodes} inference node(s)"
        layout = f"{nodes} of {job.gpus_per_node} GPUs"
    print(f"wrote {out} ({layout}); submit it with: sbatch {out}")
    return 0
