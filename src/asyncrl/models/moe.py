"""Mixture-of-experts models: expert weights between the checkpoint layout and transformers' fused one, and the
router's choices, recorded (the sampler) or replayed (the trainer).

transformers 5 holds a Qwen3-MoE layer's experts fused, ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (each expert's
gate rows, then its up rows) and ``mlp.experts.down_proj`` ``[E, H, I]``, and ``save_pretrained`` writes them back in
the checkpoint layout every loader reads, vLLM's included: ``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``,
``up_proj``, ``down_proj`` ``[H, I]``, one tensor per expert. The router is ``mlp.gate.weight`` ``[E, H]`` in both.
A policy hand-off is in the checkpoint layout; :func:`fuse_experts` turns it into the model's own for an in-place
load.

The routers of a model (:func:`routers`) are the modules that pick each token's ``top_k`` experts; a
:class:`Routing` on them records those picks (``[tokens, top_k]`` per MoE layer, in the router's order) and, when
given routes, makes the layer use them instead (:func:`replayed_routing`).
"""

from __future__ import annotations

import re

import torch

EXPERT_NAME = re.compile(r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$")


def fuse_experts(state: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each layer's per-expert tensors (checkpoint layout) stacked into the model's fused ones,
    where the model (``own``: its state dict) holds them fused; everything else as it is. A layer whose experts are
    incomplete keeps its per-expert names, which the caller then reports as not matching the model."""
    per_layer: dict[str, dict[tuple[str, int], torch.Tensor]] = {}
    out = {}
    for name, tensor in state.items():
        m = EXPERT_NAME.match(name)
        if m and f"{m['prefix']}.gate_up_proj" in own:
            per_layer.setdefault(m["prefix"], {})[(m["proj"], int(m["expert"]))] = tensor
        else:
            out[name] = tensor
    for prefix, parts in per_layer.items():
        experts = own[f"{prefix}.gate_up_proj"].shape[0]
        if set(parts) != {(p, e) for p in ("gate", "up", "down") for e in range(experts)}:
            out.update({f"{prefix}.{e}.{p}_proj.weight": t for (p, e), t in parts.items()})
            continue
        gate, up, down = ([parts[(p, e)] for e in range(experts)] for p in ("gate", "up", "down"))
        out[f"{prefix}.gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
        out[f"{prefix}.down_proj"] = torch.stack(down)
    return out


def fused_expert_names(model: torch.nn.Module) -> list[str]:
    """The parameters that hold a layer's experts fused (transformers' layout, not a checkpoint's)."""
    return [
        n for n, _ in model.named_parameters() if n.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj"))
    ]


def check_streamable(model: torch.nn.Module, transport: str) -> None:
    """Refuse a streamed hand-off (``weights.transport`` nccl or ipc) of fused experts: those send the trainer's
    parameter names as they are, and vLLM's Qwen3-MoE loader knows the checkpoint layout's per-expert names
    (``mlp.experts.{e}.gate_proj.weight``); the files of ``filesystem`` are in that layout."""
    fused = fused_expert_names(model)
    if transport != "filesystem" and fused:
        raise ValueError(
            f"weights.transport={transport!r} cannot hand off this mixture of experts ({fused[0]} holds its experts "
            "fused, and vLLM loads one tensor per expert): use weights.transport=filesystem"
        )
