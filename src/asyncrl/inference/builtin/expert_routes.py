"""The experts a mixture of experts routed each token of a request to, recorded by the CPU engine when the
request asks (``routed_experts``): the routes of its prompt from the prefill, then those of each sampled
token from the forward that reads it (the last token, never read, has none).
``[prompt + completion - 1, MoE layers, top_k]`` expert ids, each layer's in the router's order; the trainer
replays them (:class:`asyncrl.models.moe.Routing`)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import numpy as np
import torch

from asyncrl.models.moe import Routing


def recording(routing: Routing | None, rows: list[Any]) -> AbstractContextManager[list[torch.Tensor] | None]:
    """Within: each router's picks of the forward, when the model has routers and a row's request asks for
    them."""
    if routing is None or not any(r.req.routed_experts for r in rows):
        return nullcontext(None)
    return routing.record()


def add_prompt_routes(
    picks: list[torch.Tensor] | None, rows: list[Any], prompt_of: list[int], width: int
) -> None:
    """The prefill's routes of each row's prompt (``prompt_of[i]``: row ``i``'s prompt in the padded batch of
    ``width`` positions, its prompt at the end)."""
    if picks is None:
        return
    per_prompt = torch.stack(picks, dim=1).view(-1, width, len(picks), picks[0].shape[-1])
    for row, p in zip(rows, prompt_of, strict=True):
        row.routes.append(per_prompt[p, width - len(row.req.prompt_ids) :])


def add_step_routes(
    picks: list[torch.Tensor] | None, rows: list[Any], batch: list[int], live: list[bool]
) -> None:
    """A decode step's routes of the token each live batch row read (``rows[batch[k]]``: batch row ``k``'s
    row)."""
    if picks is None:
        return
    step = torch.stack(picks, dim=1)
    for k, (b, ok) in enumerate(zip(batch, live, strict=True)):
        if ok:
            rows[b].routes.append(step[k : k + 1])


def routes_array(row: Any) -> np.ndarray | None:
    """A finished row's routes, int16 (as rollouts store them); ``None`` if its request did not ask."""
    return torch.cat(row.routes).to(torch.int16).numpy() if row.req.routed_experts and row.routes else None
