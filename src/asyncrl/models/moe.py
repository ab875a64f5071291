"""Mixture-of-experts models: expert weights between the checkpoint layout and transformers' fused one, and
the router's choices, recorded (the sampler) or replayed (the trainer).

transformers 5 holds a Qwen3-MoE layer's experts fused, ``mlp.experts.gate_up_proj`` ``[E, 2I, H]`` (each
expert's gate rows, then its up rows) and ``mlp.experts.down_proj`` ``[E, H, I]``, and ``save_pretrained``
writes them back in the checkpoint layout every loader reads, vLLM's included:
``mlp.experts.{e}.gate_proj.weight`` ``[I, H]``, ``up_proj``, ``down_proj`` ``[H, I]``, one tensor per
expert. The router is ``mlp.gate.weight`` ``[E, H]`` in both. A policy hand-off as files is in the checkpoint
layout, which :func:`fuse_experts` turns into the model's own for an in-place load; the streamed transports
send the fused tensors as they are, which vLLM's MoE loader also reads (:mod:`asyncrl.transport.streamed`).

The routers of a model (:func:`routers`) are the modules that pick each token's ``top_k`` experts; a
:class:`Routing` on them records those picks (``[tokens, top_k]`` per MoE layer, in the router's order) and,
when given routes, makes the layer use them instead (:meth:`Routing.given`).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor

EXPERT_NAME = re.compile(
    r"^(?P<prefix>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate|up|down)_proj\.weight$"
)


def fuse_experts(state: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each layer's per-expert tensors (checkpoint layout) stacked into the model's fused
    ones, where the model (``own``: its state dict) holds them fused; everything else as it is. A layer whose
    experts are incomplete keeps its per-expert names, which the caller then reports as not matching the
    model."""
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


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """A model's MoE routers in layer order: the modules whose forward answers
    ``(router_logits, top-k weights, top-k expert ids)`` (transformers' ``*TopKRouter``); empty for a dense
    model."""
    return [
        m
        for m in model.modules()
        if all(hasattr(m, a) for a in ("top_k", "num_experts", "norm_topk_prob"))
        and isinstance(m.weight, Tensor)
    ]


class Routing:
    """Hooks on a model's routers. Records each forward's picks (:meth:`record`), and with routes given
    (:meth:`given`, ``[tokens, MoE layers, top_k]`` expert ids, ``-1``: none given) compares them with the
    router's own and, with ``replay``, routes every token that has them to those experts instead.

    A replayed token's routing weights are the router's softmax probabilities of the given experts,
    renormalised when the model renormalises its top-k (``norm_topk_prob``): the same function of the
    router's weights as the model's own routing, so the router still learns; where the given experts are the
    router's own picks in its order, they are the router's own weights. The routes stay set until the next
    :meth:`given`, for the recomputation of activation checkpointing in backward; the counts only come from
    the forward within :meth:`given`.
    """

    def __init__(self, model: torch.nn.Module, replay: bool = False):
        self.routers, self.replay = routers(model), replay
        self.recorded: list[Tensor] | None = None
        self.routes: Tensor | None = None
        self.counting = False
        self.per_token: dict[str, Tensor] = {}
        self.counts = {"moe_tokens": 0.0, "moe_routes_differ": 0.0, "moe_router_disagrees": 0.0}
        self.handles = [r.register_forward_hook(partial(self._hook, i)) for i, r in enumerate(self.routers)]

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self.handles:
            handle.remove()

    @contextmanager
    def record(self) -> Iterator[list[Tensor]]:
        """Within: each router's picks of each forward, appended in layer order (``[tokens, top_k]``
        each)."""
        out: list[Tensor] = []
        self.recorded = out
        try:
            yield out
        finally:
            self.recorded = None

    @contextmanager
    def given(self, routes: Tensor | None) -> Iterator[None]:
        """Within: ``routes`` (``[..., MoE layers, top_k]``, flattened to the forward's tokens) are the
        sampler's; ``None`` leaves the model's own routing."""
        if routes is not None and routes.shape[-2] != len(self.routers):
            # vLLM answers a row per decoder layer: its routes fit a model whose every layer is a MoE layer
            raise ValueError(
                f"the sampler's routes cover {routes.shape[-2]} layers, the model has "
                f"{len(self.routers)} MoE layers"
            )
        self.routes = (
            None if routes is None else routes.reshape(-1, len(self.routers), routes.shape[-1]).long()
        )
        self.counting, self.per_token = routes is not None, {}
        try:
            yield
        finally:
            self.counting = False
            if self.per_token:
                self.counts["moe_tokens"] += float((self.routes[:, 0, 0] >= 0).sum())  # type: ignore[index]
                self.counts["moe_routes_differ"] += float(self.per_token["used"].sum())
                self.counts["moe_router_disagrees"] += float(self.per_token["own"].sum())

    def take(self) -> dict[str, float]:
        """The counts since the last call: tokens with given routes, and those whose experts (the set, in any
        layer) differ from the given ones, as used (0 under replay) and as the router itself picks them."""
        out, self.counts = self.counts, dict.fromkeys(self.counts, 0.0)
        return out

    def _hook(self, layer: int, module: torch.nn.Module, args: tuple, output: tuple) -> tuple | None:
        logits, weights, picks = output
        if self.recorded is not None:
            self.recorded.append(picks.detach())
        if self.routes is None:
            return None
        given = self.routes[:, layer].to(picks.device)
        has = given[:, :1] >= 0
        differs = (given.sort(-1).values != picks.sort(-1).values).any(-1) & has[:, 0]
        use = torch.where(has, given, picks) if self.replay else picks
        if self.counting:
            used = torch.zeros_like(differs) if self.replay else differs
            for key, value in (("own", differs), ("used", used)):
                self.per_token[key] = self.per_token[key] | value if key in self.per_token else value
        if not self.replay:
            return None
        probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1).gather(-1, use)
        if module.norm_topk_prob:
            probs = probs / probs.sum(dim=-1, keepdim=True)
        # where the given experts are the router's own in its order, its own weights: a kernel's softmax
        # (numerics=bitwise routes with vLLM's) may differ from this one in the last bit
        own = (use == picks).all(-1, keepdim=True)
        return logits, torch.where(own, weights, probs.to(weights.dtype)), use
