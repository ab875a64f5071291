"""Sample logprobs sent once per request instead of once per decode step (``inference.vllm.defer_logprobs``).

Why (issue 16, item 1; ``benchmarks/results/README.md``, "Where vLLM's logprobs cost goes"): asking vLLM 0.26
for the sampled token's logprob cost 40% of its decode throughput on a 0.6B model (a 103-token vocabulary, so
little of it can be GPU work; by a reading of vLLM's code, most is per-request work on the CPU). Per decode step
and per request the engine core slices the step's logprob arrays (``LogprobsLists.slice_request``), serialises
three numpy arrays into the message to the frontend (``serial_utils`` encode hooks, on a thread that competes
with the engine loop for the GIL), and the frontend decodes them and updates the request's logprobs position by
position.

A request that returns only its final output (``RequestOutputKind.FINAL_ONLY``: every non-streaming OpenAI
request and ``LLM.generate``) needs its logprobs only then. Here the scheduler's outputs keep each such
request's step logprobs in the engine core and attach them, concatenated, to the output that finishes the
request: one message, one decode, one pass of the frontend's loop. The numbers are the same arrays, moved
later, so the logprobs a client receives do not change (:func:`defer` is checked bit for bit against per-step
delivery). Streaming requests and those without logprobs are left as vLLM sends them.

Installed by asyncrl's vLLM plugin (:mod:`asyncrl.inference.vllm_plugin`) in the engine-core process when
``ASYNCRL_DEFER_LOGPROBS=1`` (the sidecar sets it from the config). Written against vLLM 0.26.0's
``Scheduler.update_from_output`` / ``add_request`` / ``finish_requests``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable
from typing import Any

import numpy as np

ENV = "ASYNCRL_DEFER_LOGPROBS"
LOG_LINE = "final-only requests get their sample logprobs once, when they finish"


def wanted() -> bool:
    """Whether this process defers logprobs (the sidecar exports :data:`ENV` to vLLM's processes)."""
    return os.environ.get(ENV) == "1"


class Held:
    """A request's held positions in numpy buffers grown by doubling: a copy of a few numbers per step and no new
    Python object, so the engine core's heap (and its garbage collector's work) does not grow with every token.
    A step's arrays are as wide as the most top-logprobs any request of that step's batch asked for, the sampled
    token first; the frontend reads only the columns its request asked for, which every step holds, so the
    buffers keep the narrowest width seen."""

    __slots__ = ("cls", "ids", "logprobs", "ranks", "n")

    def __init__(self, part: Any) -> None:
        rows, width = part[0].shape
        cap = max(64, rows)
        self.cls = type(part)  # vLLM's LogprobsLists
        self.ids = np.empty((cap, width), part[0].dtype)
        self.logprobs = np.empty((cap, width), part[1].dtype)
        self.ranks = np.empty(cap, part[2].dtype)
        self.n = 0
        self.add(part)

    def add(self, part: Any) -> None:
        """Append a slice (a ``LogprobsLists`` of one or more positions)."""
        rows, width = part[0].shape
        width = min(width, self.ids.shape[1])
        need = self.n + rows
        if need > len(self.ranks) or width < self.ids.shape[1]:
            cap = max(2 * len(self.ranks), need) if need > len(self.ranks) else len(self.ranks)
            self.ids = _resized(self.ids[:, :width], cap, self.n)
            self.logprobs = _resized(self.logprobs[:, :width], cap, self.n)
            self.ranks = _resized(self.ranks, cap, self.n)
        self.ids[self.n : need] = part[0][:, :width]
        self.logprobs[self.n : need] = part[1][:, :width]
        self.ranks[self.n : need] = part[2]
        self.n = need

    def lists(self) -> Any:
        """The held positions as one ``LogprobsLists`` (contiguous copies)."""
        n = self.n
        return self.cls(self.ids[:n].copy(), self.logprobs[:n].copy(), self.ranks[:n].copy(), None)


def _resized(a: np.ndarray, rows: int, keep: int) -> np.ndarray:
    out = np.empty((rows, *a.shape[1:]), a.dtype)
    out[:keep] = a[:keep]
    return out


def concat(parts: list[Any]) -> Any:
    """One ``LogprobsLists`` of the positions of ``parts`` (each a request's slice: ``cu_num_generated_tokens``
    None), in order, cut to the columns every part holds (:class:`Held`)."""
    held = Held(parts[0])
    for part in parts[1:]:
        held.add(part)
    return held.lists()


def defer(outputs: Iterable[Any], deferred: set[str], held: dict[str, Held]) -> None:
    """Hold the ``new_logprobs`` of the ``EngineCoreOutput``s in ``outputs`` whose request is in ``deferred``
    (in ``held``, by request id) and attach them, as one ``LogprobsLists``, to the request's finishing output;
    the request then leaves ``deferred``. Other outputs are left as they are."""
    for out in outputs:
        rid = out.request_id
        if rid not in deferred:
            continue
        if out.new_logprobs is not None:
            if (h := held.get(rid)) is None:
                held[rid] = Held(out.new_logprobs)
            else:
                h.add(out.new_logprobs)
            out.new_logprobs = None
        if out.finish_reason is not None:
            deferred.discard(rid)
            if (h := held.pop(rid, None)) is not None:
                out.new_logprobs = h.lists()


def is_final_only(sampling_params: Any) -> bool:
    """A request whose logprobs can wait: it asks for sample logprobs and returns only its final output (and no
    logprobs of chosen token ids, whose columns are laid out per step)."""
    return (
        sampling_params is not None
        and sampling_params.num_logprobs is not None
        and not getattr(sampling_params, "logprob_token_ids", None)
        # vllm.sampling_params.RequestOutputKind, by name: this module imports no vLLM at import time
        and getattr(sampling_params.output_kind, "name", None) == "FINAL_ONLY"
    )


def install(scheduler: type | None = None) -> None:
    """Wrap vLLM's ``Scheduler`` (engine-core process; ``scheduler``: that class, or one with the same three
    methods): ``add_request`` notes final-only requests, ``update_from_output`` defers their logprobs
    (:func:`defer`), ``finish_requests`` (aborts) forgets them."""
    if scheduler is None:
        from vllm.v1.core.sched.scheduler import Scheduler

        scheduler = Scheduler
    cls: Any = scheduler
    if getattr(cls, "_asyncrl_defer_logprobs", False):
        return
    add_request, update_from_output, finish_requests = (
        cls.add_request,
        cls.update_from_output,
        cls.finish_requests,
    )

    def state(self) -> tuple[set[str], dict[str, Held]]:
        if not hasattr(self, "_asyncrl_deferred"):
            self._asyncrl_deferred, self._asyncrl_held = set(), {}
        return self._asyncrl_deferred, self._asyncrl_held

    def add_request_deferring(self, request, *args, **kwargs):
        result = add_request(self, request, *args, **kwargs)
        if is_final_only(request.sampling_params):
            state(self)[0].add(request.request_id)
        return result

    def update_from_output_deferring(self, scheduler_output, model_runner_output):
        outputs = update_from_output(self, scheduler_output, model_runner_output)
        deferred, held = state(self)
        if deferred:
            defer((o for eco in outputs.values() for o in eco.outputs), deferred, held)
        return outputs

    def finish_requests_deferring(self, request_ids, finished_status, *args, **kwargs):
        deferred, held = state(self)
        if request_ids is None:  # vLLM: every request
            deferred.clear()
            held.clear()
        else:
            request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)  # read once
            for rid in request_ids:
                deferred.discard(rid)
                held.pop(rid, None)
        return finish_requests(self, request_ids, finished_status, *args, **kwargs)

    cls.add_request = add_request_deferring
    cls.update_from_output = update_from_output_deferring
    cls.finish_requests = finish_requests_deferring
    cls._asyncrl_defer_logprobs = True
    # under vLLM's logger, so it lands in the sidecar's log with vLLM's own lines (the GPU test looks for it)
    logging.getLogger("vllm.asyncrl").info(f"asyncrl: {LOG_LINE} ({cls.__module__}.{cls.__name__})")
