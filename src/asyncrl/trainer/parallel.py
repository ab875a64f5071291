"""Every sharding decision of the trainer, in one place (as torchtitan keeps them).

``trainer.fabric.strategy=fsdp2`` gives Fabric a ``ModelParallelStrategy`` whose ``parallelize_fn`` is
:func:`parallelize`: each decoder layer, then the root (embeddings, final norm, tied lm_head), is
sharded with FSDP2 (``fully_shard``) over the data-parallel mesh. Mixed precision lives here too, as
FSDP2's policy: bf16 parameters in compute, fp32 master weights and fp32 gradient reductions. The same
code runs on CPU with the gloo backend (CI tests it with two processes) and on GPUs with NCCL;
multi-node runs start under torchrun or SLURM, which Fabric detects.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
import torch._inductor.config as inductor
from lightning_fabric.plugins.precision import MixedPrecision
from lightning_fabric.strategies import ModelParallelStrategy
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from asyncrl.config.trainer import FabricConfig
from asyncrl.models.adapters import unwrap


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The repeated blocks of an HF causal LM (``model.model.layers`` for Llama/Qwen/Mistral families), under
    a peft (LoRA) wrapper too."""
    model = unwrap(model)
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(
            f"{type(model).__name__}: cannot find decoder layers at model.model.layers; "
            "add this architecture to asyncrl.trainer.parallel.decoder_layers"
        )
    return list(layers)


# what a checkpointed decoder layer keeps of its forward (trainer.fabric.activation_checkpointing_saves); the
# rest is recomputed in backward. By op name (namespace::name): custom ops exist only once their module is
# imported.
MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::_grouped_mm"})
ATTENTION = frozenset(
    {
        "torch_attn::_varlen_attn",  # model.attn_implementation=varlen (torch's flash kernel)
        "asyncrl::fa4_varlen_fwd",  # varlen_fa4 (asyncrl.models.fa4)
        "aten::_scaled_dot_product_flash_attention",
        "aten::_scaled_dot_product_efficient_attention",
        "aten::_scaled_dot_product_cudnn_attention",
        "aten::_scaled_dot_product_flash_attention_for_cpu",
        "aten::_flash_attention_forward",
        "aten::_efficient_attention_forward",
    }
)
SAVES = {"nothing": frozenset(), "matmuls": MATMULS, "matmuls_and_attention": MATMULS | ATTENTION}


def checkpoint_context(saves: str):
    """``context_fn`` for torch's checkpoint that keeps the outputs of the ops :data:`SAVES` names for
    ``saves`` and recomputes the rest (torch's selective activation checkpointing); ``None`` for
    ``"nothing"``: the whole layer is recomputed."""
    if saves not in SAVES:
        raise ValueError(f"activation_checkpointing_saves={saves!r}; allowed: {sorted(SAVES)}")
    kept = SAVES[saves]
    if not kept:
        return None

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        name = func.name().split(".", 1)[0]  # "aten::mm.default" -> "aten::mm"
        return CheckpointPolicy.MUST_SAVE if name in kept else CheckpointPolicy.PREFER_RECOMPUTE

    return partial(create_selective_checkpoint_contexts, policy)


def apply_activation_checkpointing(
    model: Any, sharded: bool, every: int = 1, saves: str = "nothing"
) -> None:
    """Recompute decoder layers in backward: layers 0, ``every``, 2·``every``, ... (all of them at 1), each
    keeping what ``saves`` names of its forward (:func:`checkpoint_context`).

    Under FSDP2, torch's ``checkpoint_wrapper`` goes around each such layer *before* ``fully_shard``:
    transformers' own switch skips FSDP2's mixed-precision input cast on recomputation with torch
    2.11/2.12 (fixed in 2.13; NVIDIA-NeMo/Automodel PR #3513). The wrapper's name prefix is stripped
    again by ``get_model_state_dict``. Unsharded models use transformers' switch, which each layer reads
    from its own ``gradient_checkpointing`` flag (so parameter names stay as they are).
    """
    context = checkpoint_context(saves)
    extra = {} if context is None else {"context_fn": context}
    layers = unwrap(model).model.layers
    if not sharded:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False, **extra})
        for i, layer in enumerate(layers):
            layer.gradient_checkpointing = i % every == 0
        return
    for i in range(0, len(layers), every):
        layers[i] = checkpoint_wrapper(layers[i], preserve_rng_state=False, **extra)


def inductor_for_varying_shapes() -> None:
    """Inductor settings for ``trainer.fabric.compile``, whose graphs see a new token count at each
    micro-batch (so they recompile once with symbolic shapes): torch 2.11's coalescing analysis of Triton
    tiles does not support symbolic shapes (its own config says so) and fails an assertion on our layers'
    backward (``tiling_utils.get_pw_red_splits``, pytorch/pytorch#181563); it only picks tile shapes, so it
    goes off."""
    inductor.triton.coalesce_tiling_analysis = False


def compile_layers(model: torch.nn.Module) -> None:
    """``torch.compile`` each decoder layer in place (``trainer.fabric.compile``), as torchtitan does: the
    layers share one compiled graph, and the embedding and head stay outside. ``Module.compile`` keeps the
    parameter names (``torch.compile(module)`` would prefix them with ``_orig_mod``). Under FSDP2 it goes
    after activation checkpointing and before ``fully_shard``, whose hooks Dynamo leaves out of the graph."""
    inductor_for_varying_shapes()
    for layer in decoder_layers(model):
        layer.compile()


def parallelize(model: torch.nn.Module, device_mesh, cfg: FabricConfig) -> torch.nn.Module:
    mesh = device_mesh["data_parallel"]
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if cfg.precision == "bf16-mixed"
        else MixedPrecisionPolicy()
    )
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(
            model,
            sharded=True,
            every=cfg.activation_checkpointing_every,
            saves=cfg.activation_checkpointing_saves,
        )
    if cfg.compile:
        compile_layers(model)
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # the last layer's parameters are needed again right away in backward: keep them gathered
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def build_strategy(cfg: FabricConfig):
    """The Fabric strategy and the precision Fabric itself should apply: a precision string, or for
    ``bf16-mixed`` without FSDP2 a plugin (:func:`mixed_precision_keeping_outputs`)."""
    if cfg.strategy == "fsdp2":
        world = cfg.devices * cfg.num_nodes
        strategy = ModelParallelStrategy(
            parallelize_fn=partial(parallelize, cfg=cfg),
            data_parallel_size=world,
            tensor_parallel_size=1,
            save_distributed_checkpoint=True,
        )
        return strategy, "32-true"  # FSDP2's MixedPrecisionPolicy does the casting
    if cfg.precision == "bf16-mixed":
        # as Fabric picks the autocast device: "auto" is CUDA only where there is one
        cuda = cfg.accelerator == "cuda" or (cfg.accelerator == "auto" and torch.cuda.is_available())
        return cfg.strategy, mixed_precision_keeping_outputs("cuda" if cuda else "cpu")
    return cfg.strategy, cfg.precision


def mixed_precision_keeping_outputs(device: str):
    """Fabric's ``bf16-mixed`` (autocast) whose model outputs keep the dtype they were computed in.

    Fabric's own plugin casts every floating output of the forward to fp32
    (``MixedPrecision.convert_output``): for a causal LM that is the whole ``[T, vocab]`` logits tensor, 10
    GB in fp32 for a 16k-token row and a 152k vocabulary, written, kept for the backward and cast back for
    the gradient, on every micro-batch. The logprob functions upcast it themselves (``compute_logprobs``,
    fused into one pass when compiled), from the same bf16 values, so the numbers do not change; FSDP2's
    policy never cast it either."""

    class KeepOutputs(MixedPrecision):
        def convert_output(self, data: Any) -> Any:
            return data

    return KeepOutputs("bf16-mixed", device)


def is_sharded(model: torch.nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in model.parameters())
