"""The options of ``asyncrl slurm``: the parser, and the :class:`Job` they describe (torch-free)."""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass, field

TEMPLATES = ("single_node", "multi_node")
DEFAULT_OUT = "outputs/slurm/{job_name}.sbatch"
_SLURM_TIME = re.compile(r"^(\d+|\d+:\d\d|\d+:\d\d:\d\d|\d+-\d+|\d+-\d+:\d\d|\d+-\d+:\d\d:\d\d)$")


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
        if self.template == "single_node" and self.inference_gpus is None and self.gpus_per_node > 0:
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
        "  asyncrl slurm multi_node --trainer-nodes 2 --inference-nodes 2 --partition gpu "
        "experiment=reverse_text model=hf model.name=Qwen/Qwen3-0.6B trainer.fabric.strategy=fsdp2",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    name = _matching(re.compile(r"^[\w.,-]+$"), "letters, digits and . _ , -")
    p.add_argument(
        "template", choices=TEMPLATES, help="one node (`asyncrl rl`), or N trainer + M inference nodes"
    )
    p.add_argument(
        "--out",
        default=DEFAULT_OUT,
        metavar="PATH",
        help=f"script to write; '-' = stdout (default: {DEFAULT_OUT})",
    )
    p.add_argument(
        "--job-name", default="asyncrl", type=name, metavar="NAME", help="SLURM job name (default: asyncrl)"
    )
    p.add_argument("--partition", type=name, metavar="NAME", help="SLURM partition (default: the cluster's)")
    p.add_argument("--account", type=name, metavar="NAME", help="SLURM account (default: the user's)")
    p.add_argument(
        "--time",
        default="24:00:00",
        type=_matching(_SLURM_TIME, "SLURM's MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"),
        help="time limit (default: 24:00:00)",
    )
    _add_layout(p)
    _add_environment(p)
    return p


def _add_layout(p: argparse.ArgumentParser) -> None:
    """Where the processes run: GPUs and nodes, ports and health checks."""
    p.add_argument(
        "--gpus-per-node",
        default=8,
        type=_at_least(0),
        metavar="G",
        help="GPUs of each node (default: 8); 0: CPU nodes, the built-in sidecar and a CPU trainer (gloo)",
    )
    p.add_argument(
        "--cpus-per-gpu", default=8, type=_at_least(1), metavar="C", help="CPU cores per GPU (default: 8)"
    )
    p.add_argument(
        "--inference-gpus",
        type=_at_least(1),
        metavar="I",
        help="single_node: GPUs that serve, the rest train (default: half of --gpus-per-node)",
    )
    p.add_argument(
        "--trainer-nodes",
        default=1,
        type=_at_least(1),
        metavar="N",
        help="multi_node: trainer nodes (default: 1)",
    )
    p.add_argument(
        "--inference-nodes",
        default=1,
        type=_at_least(1),
        metavar="M",
        help="multi_node: inference nodes (default: 1)",
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


def _add_environment(p: argparse.ArgumentParser) -> None:
    """What each step runs in, and the overrides it passes on."""
    p.add_argument(
        "--container-image",
        metavar="IMAGE",
        help="run every step in this image (pyxis: srun --container-image)",
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
