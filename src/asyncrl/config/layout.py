"""Where the processes of ``asyncrl rl`` run on one node's GPUs, checked in one place.

A layout is N inference replicas (``inference.gpus``, one entry per replica, each naming
``inference.tensor_parallel`` GPUs), an M-GPU trainer (``trainer.fabric.gpus`` naming
``trainer.fabric.devices`` GPUs) and, for online distillation, a teacher (``distill.gpus``). ``conf/layout/``
holds the usual ones (``asyncrl rl layout=4gpu_2replicas``). A GPU named by two processes is refused unless
``inference.share_gpus`` says it is shared on purpose: two processes on one GPU silently halve each other's
memory, and NCCL cannot link them. That GPUs named here exist is checked at launch (:func:`missing_gpus`),
where they can be counted.

Torch-free: the CLI imports it through the config checks.
"""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from asyncrl.config.variants import LOSSES

if TYPE_CHECKING:
    from asyncrl.config.root import Config
    from asyncrl.config.trainer import FabricConfig

TP_FLAGS = ("--tensor-parallel-size", "-tp")
# vLLM flags that spread one server over several GPUs besides tensor parallelism (each multiplies the GPUs it
# takes)
PARALLEL_FLAGS = {"--pipeline-parallel-size": "pp", "-pp": "pp", "--data-parallel-size": "dp", "-dp": "dp"}
# vLLM's multi-node data parallelism: asyncrl keeps each server within one node
MULTI_NODE_FLAGS = (
    "--data-parallel-size-local",
    "--data-parallel-address",
    "--data-parallel-start-rank",
    "--headless",
)


def gpu_list(entry: str) -> list[str]:
    """The GPUs of one CUDA_VISIBLE_DEVICES value, in order (``'0, 1'`` -> ``['0', '1']``)."""
    return [g.strip() for g in str(entry).split(",") if g.strip()]


def tp_flag(extra_args: list[str]) -> str | None:
    """The tensor-parallel flag in vLLM's extra arguments, if any (``inference.tensor_parallel`` sets it)."""
    for a in map(str, extra_args):
        if a.split("=", 1)[0] in TP_FLAGS:
            return a.split("=", 1)[0]
    return None


def parallel_sizes(extra_args: list[str], tp: int = 1) -> dict[str, int]:
    """vLLM's tensor-, pipeline- and data-parallel sizes (``tp``, ``pp``, ``dp``) of one server: ``tp`` is
    inference.tensor_parallel, the others come from ``inference.vllm.extra_args``; a server takes their
    product in GPUs (``--data-parallel-size K`` is vLLM's own data parallelism: K engines behind one server,
    which balances requests over them). Raises ``ValueError`` for a size that is not a positive integer and
    for vLLM's multi-node data parallelism."""
    sizes = {"tp": tp, "pp": 1, "dp": 1}
    for i, arg in enumerate(map(str, extra_args)):
        flag, eq, value = arg.partition("=")
        if flag in MULTI_NODE_FLAGS:
            raise ValueError(
                f"inference.vllm.extra_args has {flag}: vLLM's multi-node data "
                "parallelism is not what asyncrl "
                "runs; each server stays within one node (use --data-parallel-size for several GPUs of one)"
            )
        if flag in PARALLEL_FLAGS:
            value = value if eq else (str(extra_args[i + 1]) if i + 1 < len(extra_args) else "")
            if not value.isdigit() or int(value) < 1:
                raise ValueError(
                    f"inference.vllm.extra_args: {flag} needs a positive integer, got {value!r}"
                )
            sizes[PARALLEL_FLAGS[flag]] = int(value)
    return sizes


def inference_workers(cfg: Config) -> int:
    """vLLM workers the sidecars run in all: one per sidecar times its tensor-parallel size."""
    sidecars = len(cfg.inference.urls) or len(cfg.inference.gpus) or 1
    return sidecars * cfg.inference.tensor_parallel


def gpu_owners(cfg: Config) -> dict[str, list[str]]:
    """Every GPU named by the layout -> the config keys that name it (in config order)."""
    owners: dict[str, list[str]] = defaultdict(list)
    for i, entry in enumerate(cfg.inference.gpus):
        for g in gpu_list(entry):
            owners[g].append(f"inference.gpus[{i}]")
    for g in gpu_list(cfg.trainer.fabric.gpus):
        owners[g].append("trainer.fabric.gpus")
    if cfg.distill.teacher and not cfg.distill.url:  # `asyncrl rl` starts the teacher
        for g in gpu_list(cfg.distill.gpus):
            owners[g].append("distill.gpus")
    return dict(owners)


def layout_errors(cfg: Config) -> list[str]:
    """Why the GPU layout of ``cfg`` does not add up (empty when it does)."""
    inf, errors = cfg.inference, []
    tp = inf.tensor_parallel
    if tp > 1 and inf.backend != "vllm":
        errors.append(
            f"inference.tensor_parallel={tp} needs inference.backend=vllm (got {inf.backend!r}): the "
            "built-in sidecar runs on one device"
        )
    if flag := tp_flag(list(inf.vllm.extra_args)):
        errors.append(
            f"inference.vllm.extra_args sets {flag}: set inference.tensor_parallel instead (it also sizes "
            "the nccl group and is checked against inference.gpus)"
        )
    try:
        sizes = parallel_sizes(list(inf.vllm.extra_args), tp)
    except ValueError as e:
        return [*errors, str(e)]
    per_sidecar = sizes["tp"] * sizes["pp"] * sizes["dp"]
    for i, entry in enumerate(inf.gpus):
        n = len(gpu_list(entry))
        if n and n != per_sidecar:
            errors.append(
                f"inference.gpus[{i}]={entry!r} names {n} GPU(s) but each replica takes {per_sidecar} "
                f"(inference.tensor_parallel={tp}, vLLM's pipeline x data parallel sizes {sizes['pp']} x "
                f"{sizes['dp']}), e.g. inference.gpus=['0,1'] inference.tensor_parallel=2"
            )
    for g, keys in gpu_owners(cfg).items():
        repeated = sorted({k for k in keys if keys.count(k) > 1})
        if repeated:
            errors.append(f"GPU {g} appears twice in {', '.join(repeated)}: name each GPU once per process")
        elif len(keys) > 1 and not inf.share_gpus:
            errors.append(
                f"GPU {g} is named by {' and '.join(keys)}: set "
                "inference.share_gpus=true to share it on purpose "
                "(and lower inference.vllm.gpu_memory_utilization so both fit), or "
                "give each process its own GPUs"
            )
    return errors


def missing_gpus(cfg: Config, visible: int) -> list[str]:
    """GPUs the layout names that a node with ``visible`` GPUs (numbered ``0 .. visible - 1``) lacks; GPUs
    given by UUID are left to CUDA."""
    return sorted((g for g in gpu_owners(cfg) if g.isdigit() and int(g) >= visible), key=int)


def data_parallel_ranks(fab: FabricConfig) -> int:
    """The trainer's data-parallel ranks: each reads its own share of a step's micro-batches, and the
    ``context_parallel`` ranks after one another (global ranks ``k*cp .. k*cp + cp - 1``) share share
    ``k``."""
    return fab.devices * fab.num_nodes // fab.context_parallel


def context_parallel_errors(cfg: Config) -> list[str]:
    """Why ``trainer.fabric.context_parallel`` cannot hold for this config (empty when it can, or is 1)."""
    fab, cp = cfg.trainer.fabric, cfg.trainer.fabric.context_parallel
    if cp == 1:
        return []
    key = f"trainer.fabric.context_parallel={cp}"
    errors = []
    if fab.strategy != "fsdp2" or fab.accelerator != "cuda":
        errors.append(
            f"{key} needs trainer.fabric.strategy=fsdp2 and accelerator=cuda (torch's ring attention)"
        )
    if (fab.devices * fab.num_nodes) % cp:
        errors.append(
            f"{key} must divide the trainer's ranks (devices x num_nodes = {fab.devices * fab.num_nodes})"
        )
    if cfg.model.attn_implementation not in ("sdpa", "auto"):
        errors.append(
            f"{key} needs model.attn_implementation=sdpa or auto (got "
            f"{cfg.model.attn_implementation!r}): torch's ring "
            "attention replaces SDPA's kernels"
        )
    if cfg.seq_len % (2 * cp):
        errors.append(
            f"{key}: seq_len={cfg.seq_len} must be a multiple of 2 x context_parallel (the shards' halves)"
        )
    refused = {
        "trainer.fabric.compile=true": fab.compile,
        f"numerics={cfg.numerics}": cfg.numerics in ("bitwise", "reproducible"),
        f"trainer.loss.type={cfg.trainer.loss.type} (a sequence's ratio would span ranks)": LOSSES.get(
            cfg.trainer.loss.type
        ).sequence_level,
        "trainer.kl.beta > 0 (the reference forward)": cfg.trainer.kl.beta > 0,
        "trainer.behavior_kl=true": cfg.trainer.behavior_kl,
        "distill.teacher (teacher logprobs per token)": bool(cfg.distill.teacher or cfg.distill.url),
    }
    errors += [f"{key} does not run with {what} yet" for what, on in refused.items() if on]
    return errors
