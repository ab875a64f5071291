"""What the RL trainer and the SFT warmup share: Fabric, the model, optimizer and schedule, the packed
forward pass, checkpoints and weight export. Each ``build_*`` constructs one component.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncrl.config import Config
from asyncrl.config.trainer import FabricConfig, OptimConfig, SchedulerConfig
from asyncrl.models import TORCH_DTYPES, attention
from asyncrl.numerics import use_fused_adamw
from asyncrl.trainer.loss import compute_logprobs, sampled_logprobs
from asyncrl.utils.atomic import remove_dir, seal
from asyncrl.utils.seed import rng_state, set_rng_state


def build_fabric(cfg: FabricConfig):
    from lightning.fabric import Fabric

    from asyncrl.trainer.parallel import build_strategy

    strategy, precision = build_strategy(cfg)
    fabric = Fabric(
        accelerator=cfg.accelerator,
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        strategy=strategy,
        **({"precision": precision} if isinstance(precision, str) else {"plugins": [precision]}),
    )
    fabric.launch()
    return fabric


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig, fused: bool = False) -> torch.optim.Optimizer:
    """AdamW; ``fused`` takes torch's single-kernel implementation (see :func:`asyncrl.numerics.use_fused_adamw`)."""
    # no weight decay on norms and biases (1-D parameters), as is standard for transformers
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, fused=fused or None)


def lr_factor(step: int, cfg: SchedulerConfig, total_steps: int) -> float:
    """Multiplier of the peak learning rate at optimizer step ``step`` (pure function)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.name == "constant":
        return 1.0
    span = max(total_steps - cfg.warmup_steps, 1)
    progress = min(max(step - cfg.warmup_steps, 0) / span, 1.0)
    decay = 1 - progress if cfg.name == "linear" else 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * decay


def build_scheduler(optimizer: torch.optim.Optimizer, cfg: SchedulerConfig, total_steps: int):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg, total_steps))


PACKED_KWARGS = "packed_attention_kwargs"  # the key micro_batch_to_device adds (not a tensor: never sent on)


def micro_batch_to_device(mb: dict[str, torch.Tensor], device: torch.device) -> dict[str, Any]:
    """A packed micro-batch's tensors on ``device``, plus its samples' boundaries for the attention kernels
    (:func:`asyncrl.models.attention.packed_kwargs`, under :data:`PACKED_KWARGS`) computed from the host copy of
    ``position_ids``: on a GPU that computation is two host syncs (``nonzero``, the longest sample).

    On CUDA the copies are non-blocking from pinned memory. A copy from pageable memory waits for all the work
    queued before it: moving micro-batch k+1 would wait for k's backward, then the GPU would idle while the host
    launched the next forward."""
    device = torch.device(device)
    cuda = device.type == "cuda"

    def move(t: torch.Tensor) -> torch.Tensor:
        return (t.pin_memory() if cuda and not t.is_cuda else t).to(device, non_blocking=cuda)

    out: dict[str, Any] = {k: move(v) for k, v in mb.items()}
    kwargs = attention.packed_kwargs(mb["position_ids"].cpu())
    kwargs["cu_seq_lens_q"] = kwargs["cu_seq_lens_k"] = move(kwargs["cu_seq_lens_q"])
    out[PACKED_KWARGS] = kwargs
    return out


def micro_batches_to_device(micro_batches: list[dict[str, torch.Tensor]], device: torch.device) -> list[dict]:
    """A step's micro-batches on ``device``, every copy queued up front (:func:`micro_batch_to_device`)."""
    return [micro_batch_to_device(mb, device) for mb in micro_batches]


def packed_logprobs(model: torch.nn.Module, mb: dict[str, Any], entropy_out: list | None = None) -> torch.Tensor:
    """Next-token logprobs ``[B, T-1]`` of a packed micro-batch (samples separated by position resets); with
    ``entropy_out``, the entropies of its loss tokens are appended to it (a 1-D CPU tensor).

    ``use_cache=False`` matters: with a cache transformers skips packed-sequence detection and tokens
    would attend across samples.
    """
    extra: dict[str, Any] = {}
    if attention.takes_packed_kwargs(getattr(getattr(model, "config", None), "_attn_implementation", None)):
        # once a forward, not in every layer; from the host copy when micro_batch_to_device made one
        extra = mb[PACKED_KWARGS] if PACKED_KWARGS in mb else attention.packed_kwargs(mb["position_ids"])
    logits = model(input_ids=mb["input_ids"], position_ids=mb["position_ids"], use_cache=False, **extra).logits
    # numerics=bitwise: the sampler's own logprob kernel (asyncrl.models.bitwise.install sets it);
    # trainer.fabric.compile: compute_logprobs compiled (compiled_logprobs)
    logprobs_of = getattr(model, "asyncrl_token_logprobs", None) or compute_logprobs
    if entropy_out is None:
        return logprobs_of(logits, mb["input_ids"], mb["temperatures"])
    found: list[torch.Tensor] = []
    logprobs = logprobs_of(logits, mb["input_ids"], mb["temperatures"], found)
    entropy_out.append(found[0][mb["loss_mask"][:, 1:].bool()].float().cpu())
    return logprobs


def compiled_logprobs(dynamic: bool | None = None) -> Callable[..., torch.Tensor]:
    """:func:`compute_logprobs` under ``torch.compile`` (``trainer.fabric.compile``): the temperature, log-softmax
    and gather over the vocabulary fuse into one pass over the logits, forward and backward, instead of several
    fp32 tensors of ``[T, vocab]`` (10 GB each for a 16k row and a 152k vocabulary). With ``entropy_out`` (the
    whole distribution is needed) it runs uncompiled.

    ``dynamic=None`` (torch's automatic dynamic shapes): the token count turns symbolic when it first changes and the
    vocabulary, which never does, stays a constant in the kernels. ``dynamic=True`` (before 5cebd17) made it symbolic
    too, and the pointwise backward over the flattened ``[T, vocab]`` logits then splits each index by a runtime
    value (``benchmarks/trainer_mfu.py --step-variant 5cebd17`` measures the two)."""
    from asyncrl.trainer.parallel import inductor_for_varying_shapes

    inductor_for_varying_shapes()
    fused = torch.compile(sampled_logprobs, dynamic=dynamic)

    def logprobs_of(logits, input_ids, temperatures, entropy_out: list | None = None) -> torch.Tensor:
        if entropy_out is not None:
            return compute_logprobs(logits, input_ids, temperatures, entropy_out)
        return fused(logits, input_ids, temperatures)

    return logprobs_of


def step_over_micro_batches(
    fabric,
    model,
    optimizer,
    scheduler,
    micro_batches: list[dict[str, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, dict[str, torch.Tensor]], tuple[torch.Tensor, dict]],
    max_grad_norm: float,
    entropy_out: list | None = None,
) -> dict[str, float]:
    """Forward/backward every micro-batch (the loss is already normalised by the step's token count),
    clip, and take one optimizer step. Returns summed metrics plus ``loss`` and ``grad_norm`` (``loss_fn``'s
    metrics may be floats or 0-dim device tensors, read here in one host sync with the losses); with
    ``entropy_out``, collects the loss tokens' entropies there (see :func:`packed_logprobs`)."""
    from torch.profiler import record_function  # names the phases in a profile (benchmarks/trainer_mfu.py)

    sums: dict[str, float] = {"loss": 0.0}
    losses = []
    unread: list[tuple[str, torch.Tensor]] = []  # metrics the loss left on the device (rl_loss's read_metrics)
    for mb in micro_batches_to_device(micro_batches, fabric.device):
        with record_function("asyncrl.forward"):
            loss, metrics = loss_fn(packed_logprobs(model, mb, entropy_out), mb)
        with record_function("asyncrl.backward"):
            # The loss is a sum over this rank's tokens divided by the whole step's token count, so the step's
            # gradient is the *sum* over ranks; DDP and FSDP average instead, hence the factor.
            fabric.backward(loss * fabric.world_size)
        losses.append(loss.detach())  # read once after the loop: a float() here would be a host sync
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor):
                unread.append((k, v))
            else:
                sums[k] = sums.get(k, 0.0) + v
    grad_norm: torch.Tensor | None = None
    if micro_batches:
        with record_function("asyncrl.clip"):
            grad_norm = clip_gradients(list(model.parameters()), max_grad_norm)
        with record_function("asyncrl.optimizer"):
            optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    # One host sync for the losses, the unread metrics and the gradient norm (fp32 and fp64 values are exact in
    # fp64), after the clip and the optimizer step are queued, so that nothing waits on the host in between. (On an
    # H100 the two syncs this replaced cost nothing measurable: trainer_mfu.py --step-variant e8a3883.)
    norm = [] if grad_norm is None else [grad_norm]
    values = [*losses, *(v for _, v in unread), *norm]
    read = torch.stack([v.double() for v in values]).tolist() if values else []
    sums["grad_norm"] = read.pop() if norm else 0.0
    for value in read[: len(losses)]:
        sums["loss"] += value
    for (k, _), value in zip(unread, read[len(losses) :], strict=True):
        sums[k] = sums.get(k, 0.0) + value
    return sums


def clip_gradients(parameters: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor | None:
    """The global L2 norm of the gradients (a 0-dim tensor on their device, not read here: a host sync),
    clipped to ``max_norm`` (0 = measure only); None without gradients.

    Computed explicitly, as torchtitan does (``get_total_norm`` over the sharded gradients, then
    ``full_tensor()`` to reduce it across ranks), so the same code serves one device and FSDP2.
    """
    from torch.distributed.tensor import DTensor

    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return None
    norm = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    if max_norm > 0:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, norm)
    return norm


def batch_to_torch(micro_batches: list[dict[str, Any]]) -> list[dict[str, torch.Tensor]]:
    return [{k: torch.as_tensor(v) for k, v in mb.items()} for mb in micro_batches]


@dataclass
class TrainState:
    """Everything a trainer checkpoint restores."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    progress: dict = field(default_factory=dict)

    def save(self, fabric, path: Path, cfg_yaml: str, extra: dict | None = None) -> None:
        """A checkpoint directory, atomic across ranks: every rank writes its shard into one temporary
        directory that rank 0 created; rank 0 renames it and writes the marker once all are done.

        A LoRA model's checkpoint holds its adapters (and optimizer), not the frozen base, which a resume
        loads from ``model.name`` again; except under FSDP2, whose sharded checkpoints cannot be filtered
        (Lightning refuses, pytorch#105379) and hold the base shards too."""
        from asyncrl.models.lora import is_adapter_name, is_lora_model
        from asyncrl.trainer.parallel import is_sharded

        lora = is_lora_model(self.model)
        filt = {"model": lambda k, v: is_adapter_name(k)} if lora and not is_sharded(self.model) else None
        tmp = path.with_name(f".{path.name}.tmp")
        if fabric.global_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            (tmp / "config.yaml").write_text(cfg_yaml)
        fabric.barrier()
        fabric.save(
            tmp / "state.ckpt",
            {
                "model": self.model,
                "optimizer": self.optimizer,
                "scheduler": self.scheduler,
                "progress": dict(self.progress),
                "rng": rng_state(),
                **(extra or {}),
            },
            filter=filt,
        )
        fabric.barrier()
        if fabric.global_rank == 0:
            remove_dir(path)  # marker first: a resume never takes a half-deleted checkpoint as complete
            os.replace(tmp, path)
            seal(path, digest=True)  # a resume verifies the checkpoint against these sums before loading it
        fabric.barrier()

    def load(self, fabric, path: Path) -> dict:
        state = {"model": self.model, "optimizer": self.optimizer, "scheduler": self.scheduler}
        # our own checkpoint (RNG states hold numpy arrays), so full unpickling is fine
        rest = fabric.load(path / "state.ckpt", state, strict=False, weights_only=False)
        self.progress = rest.get("progress", {})
        if "rng" in rest:
            set_rng_state(rest["rng"])
        return rest


def full_state_dict(
    fabric, model: torch.nn.Module, dtype: torch.dtype | None = None, only: Callable[[str], bool] | None = None
) -> dict[str, torch.Tensor] | None:
    """The unsharded weights (those whose name passes ``only``) as CPU tensors in ``dtype`` (a collective under
    FSDP2; returned on rank 0).

    One tensor at a time: all-gather it (every rank), cast it on the GPU, copy it to rank 0's CPU. Casting
    before the copy halves the bytes that cross PCIe and avoids a slow CPU-side cast; gathering one tensor
    at a time keeps the extra GPU memory to a single parameter.
    """
    from torch.distributed.tensor import DTensor

    from asyncrl.transport.weights import export_items

    rank0 = fabric.global_rank == 0
    out = {}
    for name, tensor in export_items(model):
        if only is not None and not only(name):
            continue
        full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
        if rank0:
            out[name] = full.detach().to(dtype or full.dtype).to("cpu")
    return out if rank0 else None


def export_model(fabric, raw_model, tokenizer, path: Path, dtype: str | None = None) -> None:
    """Publish the current policy as an HF directory at ``path`` (atomic, rank 0 writes), in the serving
    ``dtype`` (e.g. bf16: half the bytes for the sidecar to read than the fp32 master weights). A LoRA model
    (peft) publishes its adapters only, in peft's layout (see :mod:`asyncrl.models.lora`)."""
    from asyncrl.models import publish_weights
    from asyncrl.models.lora import is_adapter_name, is_lora_model

    lora = is_lora_model(raw_model)
    state = full_state_dict(
        fabric, raw_model, TORCH_DTYPES[dtype] if dtype else None, is_adapter_name if lora else None
    )
    if fabric.global_rank == 0:
        publish_weights(raw_model, tokenizer, path, state_dict=state)
    fabric.barrier()


def export_final(fabric, raw_model, tokenizer, cfg: Config, model_dir: Path) -> None:
    """The run's final policy as a plain HF model at ``model_dir`` (what evals and the next stage load). With
    LoRA: the adapter goes to ``<model_dir>/../adapter`` and base + adapter, merged, to ``model_dir``."""
    from asyncrl.models.lora import is_lora_model, merge_adapter

    if not is_lora_model(raw_model):
        export_model(fabric, raw_model, tokenizer, model_dir, cfg.model.dtype)
        return

    adapter = model_dir.parent / "adapter"
    export_model(fabric, raw_model, tokenizer, adapter, cfg.model.dtype)
    if fabric.global_rank == 0:
        merge_adapter(cfg.model, adapter, model_dir)
    fabric.barrier()


def build_reference(fabric, cfg: Config) -> torch.nn.Module:
    """The reference policy of the KL penalty: the starting policy, loaded again from ``model.name`` (so a
    resumed run gets the same one), frozen, and placed as the trained model is: sharded the same way under
    FSDP2 (its forward is a collective there too), on the device otherwise (DDP refuses a module with
    nothing to train, and a frozen copy needs no gradient sync). Its forward runs under ``fabric.autocast``,
    so a bf16-mixed run computes the reference in bf16 like the policy."""
    from asyncrl.models import load_model

    ref = load_model(cfg.model, dtype="float32").eval().requires_grad_(False)
    if cfg.trainer.fabric.strategy == "fsdp2":
        return fabric.setup_module(ref)
    return ref.to(fabric.device)


def build_train_state(
    cfg: Config, optim: OptimConfig, schedule: SchedulerConfig, total_steps: int, vllm_forward: bool = False
):
    """Fabric, the raw model, its tokenizer and the :class:`TrainState` (Fabric-wrapped model, optimizer,
    scheduler) of a trainer; ``raw`` is what weight export reads. ``vllm_forward``: the forward of
    ``numerics=bitwise`` (:mod:`asyncrl.models.bitwise`; the process called ``bitwise.enable()`` first)."""
    from asyncrl.models import load_model, load_tokenizer
    from asyncrl.trainer.parallel import apply_activation_checkpointing, compile_layers

    fabric = build_fabric(cfg.trainer.fabric)
    # fp32 master weights whatever the serving dtype; bf16-mixed computes in bf16 (see trainer/parallel.py)
    raw = load_model(cfg.model, dtype="float32").train()
    if cfg.model.lora.enabled:
        from asyncrl.models.lora import apply_lora

        raw = apply_lora(raw, cfg.model.lora)
    if vllm_forward:  # before activation checkpointing and FSDP2 wrap the layers, so their hooks run around it
        from asyncrl.models import bitwise

        bitwise.install(raw)
    if cfg.trainer.fabric.strategy != "fsdp2":  # FSDP2 applies both in parallelize()
        if cfg.trainer.fabric.activation_checkpointing:
            apply_activation_checkpointing(raw, sharded=False)
        if cfg.trainer.fabric.compile:
            compile_layers(raw)
    if cfg.trainer.fabric.compile:
        raw.asyncrl_token_logprobs = compiled_logprobs()
    tokenizer = load_tokenizer(cfg.model)
    # the optimizer must see the parameters after setup: FSDP2 replaces them with sharded DTensors
    model = fabric.setup_module(raw)
    fused = use_fused_adamw(cfg.numerics, cfg.trainer.fabric.accelerator)
    optimizer = fabric.setup_optimizers(build_optimizer(raw, optim, fused))
    scheduler = build_scheduler(optimizer, schedule, total_steps)
    return fabric, raw, tokenizer, TrainState(model, optimizer, scheduler, {"step": 0})
