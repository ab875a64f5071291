"""``asyncrl slurm <template> [options] [overrides]``: render a SLURM batch script for an RL run.

The templates are bash scripts with ``{{name}}`` placeholders in ``asyncrl/slurm/`` (``slurm/`` at the
repository root): ``single_node`` runs ``asyncrl rl`` on one node, its GPUs split between the sidecars and
the trainer; ``multi_node`` splits one allocation by node list into N trainer nodes (``asyncrl train`` under
srun, one task per GPU, which Fabric detects) and M inference nodes (``asyncrl serve`` per server slot), with
the orchestrator on the first inference node. Hydra overrides pass through to every process. They are
composed here first, so a mistyped key fails now rather than after the job has waited in the queue; keys the
template sets itself (GPUs, node counts, URLs) are refused in them. Torch-free: it only writes a file.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.config import Config, ConfigError
from asyncrl.config.compose import compose_config
from asyncrl.config.layout import parallel_sizes
from asyncrl.paths import RunDir
from asyncrl.utils.atomic import write_text_atomic

TEMPLATE_DIR = Path(__file__).resolve().parents[1] / "slurm"
TEMPLATES = ("single_node", "multi_node")
DEFAULT_OUT = "outputs/slurm/{job_name}.sbatch"
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
# what the scripts write unquoted into srun's --output patterns and messages: no spaces, quotes or '%'
_SAFE_PATH = re.compile(r"^[\w./+@:,=~-]+$")
_SLURM_TIME = re.compile(r"^(\d+|\d+:\d\d|\d+:\d\d:\d\d|\d+-\d+|\d+-\d+:\d\d|\d+-\d+:\d\d:\d\d)$")

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
        "weights.nccl_host": "the script (trainer node 0)",
        "weights.nccl_port": "the script (from the job id)",
    },
}


@dataclass
class Job:
    """What a rendered script needs: the options of ``asyncrl slurm``."""

    template: str
    out: str = DEFAULT_OUT
    job_name: str = "asyncrl"
    partition: str | None = None
    account: str | None = None
    time: str = "24:00:00"
    gpus_per_node: int = 8
    cpus_per_gpu: int = 8
    inference_gpus: int | None = None
    trainer_nodes: int = 1
    inference_nodes: int = 1
    port: int = 8000
    health_timeout: int = 1800
    container_image: str | None = None
    setup: list[str] = field(default_factory=list)
    workdir: str = "."
    config_dirs: list[str] = field(default_factory=list)
    overrides: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.template == "single_node" and self.inference_gpus is None:
            self.inference_gpus = max(self.gpus_per_node // 2, 1)


def _at_least(low: int, high: int | None = None):
    def parse(text: str) -> int:
        allowed = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed values: {allowed}") from None
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{value} is not allowed; allowed values: {allowed}")
        return value

    return parse


def _matching(pattern: re.Pattern, allowed: str):
    def parse(text: str) -> str:
        if not pattern.match(text):
            raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed values: {allowed}")
        return text

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="asyncrl slurm",
        description="Render a SLURM batch script for an RL run; the arguments after the options are Hydra "
        "overrides for every process of the run (as for `asyncrl rl`). Submit the script with `sbatch`.",
        epilog="examples:\n"
        "  asyncrl slurm single_node --gpus-per-node 8 --inference-gpus 4 experiment=reverse_text model=hf "
        "model.name=Qwen/Qwen3-0.6B trainer.fabric.strategy=fsdp2\n"
        "  asyncrl slurm multi_node --trainer-nodes 2 --inference-nodes 2 --partition gpu experiment=reverse_text "
        "model=hf model.name=Qwen/Qwen3-0.6B trainer.fabric.strategy=fsdp2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    name = _matching(re.compile(r"^[\w.,-]+$"), "letters, digits and . _ , -")
    p.add_argument("template", choices=TEMPLATES, help="one node (`asyncrl rl`), or N trainer + M inference nodes")
    p.add_argument(
        "--out", default=DEFAULT_OUT, metavar="PATH", help=f"script to write; '-' = stdout (default: {DEFAULT_OUT})"
    )
    p.add_argument("--job-name", default="asyncrl", type=name, metavar="NAME", help="SLURM job name (default: asyncrl)")
    p.add_argument("--partition", type=name, metavar="NAME", help="SLURM partition (default: the cluster's)")
    p.add_argument("--account", type=name, metavar="NAME", help="SLURM account (default: the user's)")
    p.add_argument(
        "--time",
        default="24:00:00",
        type=_matching(_SLURM_TIME, "SLURM's MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"),
        help="time limit (default: 24:00:00)",
    )
    p.add_argument("--gpus-per-node", default=8, type=_at_least(1), metavar="G", help="GPUs of each node (default: 8)")
    p.add_argument("--cpus-per-gpu", default=8, type=_at_least(1), metavar="C", help="CPU cores per GPU (default: 8)")
    p.add_argument(
        "--inference-gpus",
        type=_at_least(1),
        metavar="I",
        help="single_node: GPUs that serve, the rest train (default: half of --gpus-per-node)",
    )
    p.add_argument(
        "--trainer-nodes", default=1, type=_at_least(1), metavar="N", help="multi_node: trainer nodes (default: 1)"
    )
    p.add_argument(
        "--inference-nodes", default=1, type=_at_least(1), metavar="M", help="multi_node: inference nodes (default: 1)"
    )
    p.add_argument(
        "--port",
        default=8000,
        type=_at_least(1024, 65000),
        help="multi_node: port of each node's first server, the next ones count up (default: 8000)",
    )
    p.add_argument(
        "--health-timeout",
        default=1800,
        type=_at_least(1),
        metavar="S",
        help="multi_node: seconds the servers may take to answer /health (default: 1800)",
    )
    p.add_argument(
        "--container-image", metavar="IMAGE", help="run every step in this image (pyxis: srun --container-image)"
    )
    p.add_argument(
        "--setup",
        action="append",
        default=[],
        metavar="CMD",
        help="a shell command run first, e.g. 'source .venv/bin/activate' (repeatable)",
    )
    p.add_argument("--workdir", default=".", help="the job's working directory (default: the current one)")
    p.add_argument(
        "--config-dir",
        dest="config_dirs",
        action="append",
        default=[],
        metavar="DIR",
        help="also look for group options in DIR (repeatable; the job's commands get it too)",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value", help="Hydra overrides for every process")
    return p


def owned_overrides(job: Job) -> list[str]:
    """The overrides each template appends, with stand-in values for what only the job knows (hosts, token),
    for checking that the whole config composes."""
    g = job.gpus_per_node
    common = ["inference.backend=vllm", "trainer.fabric.accelerator=cuda"]
    if job.template == "single_node":  # (inference.gpus left out: how many servers depends on the config itself)
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
        f"trainer.fabric.devices={g}",
        f"inference.urls=['http://inference-node:{job.port}']",
        "inference.admin_token=token",
        "weights.nccl_host=trainer-node",
        "weights.nccl_port=20001",
    ]


def check(job: Job) -> tuple[Config, int]:
    """Raise ``ValueError`` naming the option or key for anything the script could not run with; returns the
    composed config (with stand-ins for what the job decides) and the GPUs per server."""
    for arg in job.overrides:
        key = arg.lstrip("+~").partition("=")[0]
        if key in OWNED[job.template]:
            raise ValueError(
                f"{key} is set by {OWNED[job.template][key]} in the {job.template} template; "
                f"remove {arg!r} from the overrides"
            )
    g = job.gpus_per_node
    if job.template == "single_node":
        assert job.inference_gpus is not None
        if g < 2:
            raise ValueError(
                f"--gpus-per-node={g}: single_node puts the sidecars and the trainer on separate GPUs, so it needs "
                "at least 2; on one GPU run `asyncrl rl` with inference.gpus=['0'] trainer.fabric.gpus=0"
            )
        if job.inference_gpus >= g:
            raise ValueError(
                f"--inference-gpus={job.inference_gpus} is not allowed; allowed values: 1 .. {g - 1} "
                f"(--gpus-per-node={g}, and the trainer needs at least one)"
            )
    elif job.inference_gpus is not None:
        raise ValueError("--inference-gpus is for single_node; multi_node serves on every GPU of --inference-nodes")
    try:
        cfg = compose_config([*job.overrides, *owned_overrides(job)], job.config_dirs)
    except ConfigError as e:
        raise ValueError(str(e)) from None
    sizes = parallel_sizes(list(cfg.inference.vllm.extra_args), cfg.inference.tensor_parallel)
    per_server = sizes["tp"] * sizes["pp"] * sizes["dp"]
    serving = job.inference_gpus if job.template == "single_node" else g
    assert serving is not None
    if serving % per_server:
        option = "--inference-gpus" if job.template == "single_node" else "--gpus-per-node"
        raise ValueError(
            f"{option}={serving} is not a multiple of the {per_server} GPUs each vLLM server takes "
            f"(inference.tensor_parallel={cfg.inference.tensor_parallel}, inference.vllm.extra_args="
            f"{list(cfg.inference.vllm.extra_args)})"
        )
    fab = cfg.trainer.fabric
    if fab.devices * fab.num_nodes > 1 and fab.strategy == "auto":
        raise ValueError(
            f"trainer.fabric.strategy=auto trains on one device, and this job gives the trainer "
            f"{fab.num_nodes} node(s) x {fab.devices} GPU(s): add trainer.fabric.strategy=fsdp2 (or ddp)"
        )
    for what, path in (("--workdir", Path(job.workdir).resolve()), ("run_dir", cfg.run_dir)):
        if not _SAFE_PATH.match(str(path)):
            raise ValueError(f"{what}={path}: the script writes it unquoted; use letters, digits and . _ / + - = , @ ~")
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
        "gpus_per_server": str(per_server),
        "log_dir": str(run.logs),
    }
    if job.template == "single_node":
        assert job.inference_gpus is not None
        values |= {
            "cpus_per_node": str(job.cpus_per_gpu * g),
            "inference_gpus": str(job.inference_gpus),
            "trainer_gpus": str(g - job.inference_gpus),
        }
    else:
        n, m, servers = job.trainer_nodes, job.inference_nodes, g // per_server
        values |= {
            "nodes": str(n + m),
            "trainer_nodes": str(n),
            "inference_nodes": str(m),
            "last_trainer": str(n - 1),
            "last_node": str(n + m - 1),
            "servers_per_node": str(servers),
            "port": str(job.port),
            "last_port": str(job.port + servers - 1),
            "cpus_per_gpu": str(job.cpus_per_gpu),
            "health_timeout": str(job.health_timeout),
            # srun's filename patterns: %N the node's name, %t the task's rank in its step
            "inference_log": str(run.log("inference-%N-%t")),
            "trainer_log": str(run.log("trainer")),
            "orchestrator_log": str(run.log("orchestrator")),
        }
    return render_template((TEMPLATE_DIR / f"{job.template}.sbatch").read_text(), values)


def cli(argv: list[str]) -> int:
    """``asyncrl slurm``: parse, check, render and write; exit 2 with the reason on a bad option or override."""
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
    if job.template == "single_node":
        layout = f"1 node: {job.inference_gpus} GPU(s) serve, {job.gpus_per_node - (job.inference_gpus or 0)} train"
    else:
        layout = f"{job.trainer_nodes} trainer + {job.inference_nodes} inference node(s) of {job.gpus_per_node} GPUs"
    print(f"wrote {out} ({layout}); submit it with: sbatch {out}")
    return 0
