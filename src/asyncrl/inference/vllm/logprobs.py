"""Sample logprobs sent once per request instead of once per decode step (``inference.vllm.defer_logprobs``).

Asking vLLM 0.26 for the sampled token's logprob costs a large share of its decode throughput, and the cost
is per-request CPU work at every decode step: the engine core's loop, the critical path, slices each
request's row of the step's arrays (``LogprobsLists.slice_request``); its output thread msgpack-encodes three
numpy arrays per request, under the same GIL; the frontend decodes them and walks them position by position.
``python benchmarks/logprobs_transport.py --help`` replays that CPU work without a GPU;
``python benchmarks/rollouts.py --defer-logprobs 0 1`` compares end-to-end throughput on a GPU.

A request that returns only its final output (``RequestOutputKind.FINAL_ONLY``: every non-streaming OpenAI
request and ``LLM.generate``) needs its logprobs only then. :class:`Deferral` keeps each step's arrays whole
in the engine core (one copy a step, and vLLM's per-request slicing skipped: :class:`Rows`), notes a row
number per request and step, and attaches the request's rows, gathered, to the output that finishes it: one
message, one decode, one pass of the frontend's loop. The numbers are the same, moved later and cut to the
columns the request asked for, so what a client receives does not change (checked bit for bit against
per-step delivery). Streaming requests, those asking for chosen token ids' logprobs or with stop strings (the
frontend finds those and aborts the request) are left as vLLM sends them, and so are those asking for the
whole vocabulary's logprobs (-1); a step whose batch holds one of them, or speculative decoding's several
tokens a request, lets vLLM slice, and the deferred requests' slices go into the same rows. One difference
remains: an aborted request's final output, built by the frontend from what it received, has no logprobs, and
so no tokens (:mod:`asyncrl.inference.vllm.frontend`, which also reads a request's rows in bulk).

A step's arrays are appended whole (one copy a step) rather than sliced per request: per-request slices would
put work for every request back on the engine core's loop at every step, which is the cost this module
removes.

Installed by asyncrl's vLLM plugin (:mod:`asyncrl.inference.vllm.plugin`) in the engine-core process when
``ASYNCRL_DEFER_LOGPROBS=1`` (the sidecar sets it from the config). Written against vLLM 0.26.0's
``Scheduler.update_from_output`` / ``add_request`` / ``finish_requests`` / ``requests`` and
``ModelRunnerOutput`` (``req_ids``, ``req_id_to_index``, ``logprobs``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np

ENV = "ASYNCRL_DEFER_LOGPROBS"
LOG_LINE = "final-only requests get their sample logprobs once, when they finish"


def wanted() -> bool:
    """Whether this process defers logprobs (the sidecar exports :data:`ENV` to vLLM's processes)."""
    return os.environ.get(ENV) == "1"


class Rows:
    """Logprob rows in numpy buffers grown by doubling, appended a whole step at a time; a request's
    positions are absolute row numbers into them (:meth:`gather` reads them back). Rows before ``oldest()``
    (the first row any live request still needs) are dropped when the buffers fill, so a long-running server
    holds only what its live requests need. A step's arrays are as wide as the most top-logprobs any request
    of its batch asked for (the sampled token first); a request reads only the columns it asked for, which
    every step it took part in holds, so the buffers are as wide as the widest step since they were last
    refilled, or as live requests read."""

    __slots__ = ("cls", "ids", "logprobs", "ranks", "origin", "end")

    def __init__(self) -> None:
        self.cls: Any = None  # vLLM's LogprobsLists
        self.ids: Any = None
        self.logprobs: Any = None
        self.ranks: Any = None
        self.origin = 0  # absolute number of the buffers' first row
        self.end = 0  # absolute number of the next row appended

    def append(self, lists: Any, oldest: Callable[[], int], widest: Callable[[], int]) -> int:
        """Append every row of ``lists`` (a ``LogprobsLists``); the absolute number of its first row. Called
        only when the buffers are full or too narrow: ``oldest()``, the first absolute row still needed;
        ``widest()``, the most columns a live request reads (the buffers narrow to that, or to ``lists``'
        width if wider)."""
        ids, logprobs, ranks = lists[0], lists[1], lists[2]
        rows, width = ids.shape
        if self.ids is None:
            self.cls = type(lists)
            cap = max(1024, 2 * rows)
            self.ids = np.empty((cap, width), ids.dtype)
            self.logprobs = np.empty((cap, width), logprobs.dtype)
            self.ranks = np.empty(cap, ranks.dtype)
        if width > self.ids.shape[1] or self.end - self.origin + rows > len(self.ranks):
            start = oldest()  # first: it may forget requests, which widest() then leaves out
            self._make_room(rows, max(width, widest()), start)
        at = self.end - self.origin
        self.ids[at : at + rows, :width] = ids
        self.logprobs[at : at + rows, :width] = logprobs
        self.ranks[at : at + rows] = ranks
        first, self.end = self.end, self.end + rows
        return first

    def _make_room(self, rows: int, width: int, oldest: int) -> None:
        """Drop the rows before ``oldest``, make the buffers ``width`` columns wide (wider or narrower: no
        live request reads further), and grow them (doubling) where the kept rows and ``rows`` more do not
        fit: one copy of the kept rows."""
        keep_from = min(max(oldest, self.origin), self.end) - self.origin
        kept = self.end - self.origin - keep_from
        cap = len(self.ranks)
        while kept + rows > cap // 2:  # half full after the copy at most: amortised O(1) a row
            cap *= 2
        span = slice(keep_from, keep_from + kept)
        self.ids = _moved(self.ids[span, :width], cap, width)
        self.logprobs = _moved(self.logprobs[span, :width], cap, width)
        self.ranks = _moved(self.ranks[span], cap, None)
        self.origin += keep_from

    def gather(self, rows: list[int], width: int | None) -> Any:
        """The rows ``rows`` (absolute) as one ``LogprobsLists`` of contiguous copies, cut to ``width``
        columns (``None``: all)."""
        at = np.asarray(rows, dtype=np.int64) - self.origin
        cols = slice(None) if width is None else slice(0, width)
        return self.cls(self.ids[at, cols], self.logprobs[at, cols], self.ranks[at], None)


def _moved(a: np.ndarray, rows: int, width: int | None) -> np.ndarray:
    out = np.empty((rows,) if width is None else (rows, width), a.dtype)
    if width is None:
        out[: len(a)] = a
    else:
        out[: len(a), : a.shape[1]] = a
    return out


class Deferral:
    """One scheduler's deferred logprobs (engine-core process). Per decode step (:meth:`step`), when no
    request of the batch needs its logprobs every step (``undeferred``) and each produced one token (no
    speculative decoding), vLLM's per-request slicing is skipped: the step's arrays go into :class:`Rows`
    whole, and each deferred request that got a token notes one row number. Otherwise vLLM slices as usual
    and the deferred requests' slices go into the same rows. A deferred request's finishing output gets its
    rows gathered into one ``LogprobsLists``, cut to the columns it asked for: what the frontend would have
    read from the per-step slices, bit for bit."""

    __slots__ = ("deferred", "undeferred", "positions", "rows")

    def __init__(self) -> None:
        self.deferred: dict[str, int] = {}  # request id -> the columns it reads
        # requests that get their logprobs every step (streaming, token ids)
        self.undeferred: set[str] = set()
        self.positions: dict[str, list[int]] = {}  # deferred request id -> its rows, absolute, in order
        self.rows = Rows()

    def add(self, request_id: str, sampling_params: Any) -> None:
        """A new request: deferred if final-only (:func:`is_final_only`) and asking for a bounded number of
        top logprobs; one asking for the whole vocabulary's (-1) is sent per step, as vLLM does, rather than
        holding vocabulary-wide rows."""
        n = None if sampling_params is None else sampling_params.num_logprobs
        if n is None:
            return
        if n >= 0 and is_final_only(sampling_params):
            self.deferred[request_id] = n + 1  # the columns it reads: the sampled token and its top n
        else:
            self.undeferred.add(request_id)

    def forget(self, request_ids: Iterable[str] | None) -> None:
        """Requests gone (aborted): nothing of theirs is kept. ``None``: every request."""
        if request_ids is None:
            self.deferred.clear()
            self.undeferred.clear()
            self.positions.clear()
            return
        for rid in request_ids:
            self.deferred.pop(rid, None)
            self.undeferred.discard(rid)
            self.positions.pop(rid, None)

    def step(self, model_runner_output: Any, update: Callable[[], Any], live: Callable[[str], bool]) -> Any:
        """Run vLLM's ``update_from_output`` (``update()``) for one step's ``model_runner_output``, deferring
        as the class says; returns its result (``{client: EngineCoreOutputs}``). ``live(request_id)``:
        whether the scheduler still knows the request (rows of requests it no longer knows are dropped when
        the buffers fill)."""
        lp = getattr(model_runner_output, "logprobs", None)
        if lp is None or not self.deferred:
            result = update()
            self._finish_only(result, live)
            return result
        whole = lp.cu_num_generated_tokens is None and self.undeferred.isdisjoint(
            model_runner_output.req_ids
        )
        if whole:
            # before vLLM's update: every request still live is still in the scheduler, so the vanished can
            # go
            first = self.rows.append(lp, lambda: self._oldest(live), self._widest)
            index = model_runner_output.req_id_to_index
            model_runner_output.logprobs = None  # vLLM slices nothing this step
            try:
                result = update()
            finally:
                model_runner_output.logprobs = lp
            self._note_whole(result, first, index, live)
            return result
        result = update()
        deferred, positions = self.deferred, self.positions
        for eco in result.values():
            for out in eco.outputs:
                rid = out.request_id
                if rid not in deferred:
                    self._not_deferred(out, live)
                    continue
                at, n = -1, 0
                if out.new_logprobs is not None:
                    # after vLLM's update, requests finishing now have left the scheduler: prune nothing here
                    ids, lps, ranks, _ = out.new_logprobs
                    w = deferred[rid]
                    part = type(out.new_logprobs)(ids[:, :w], lps[:, :w], ranks, None)
                    at = self.rows.append(part, lambda: self._oldest(None), self._widest)
                    n, out.new_logprobs = len(ranks), None
                if n:
                    if (mine := positions.get(rid)) is None:
                        positions[rid] = mine = []
                    if n == 1:
                        mine.append(at)
                    else:
                        mine.extend(range(at, at + n))
                if out.finish_reason is not None:
                    self._finished(out)
        return result

    def _note_whole(
        self, result: Any, first: int, index: dict[str, int], live: Callable[[str], bool]
    ) -> None:
        """After a step appended whole (one token a request at most): each deferred request that got a token
        notes its row, ``first`` plus its index in the step (vLLM's ``slice_request(index, 1)``, as a row
        number). The engine core's loop runs this for every request at every step, so it does no more than
        that."""
        deferred, positions = self.deferred, self.positions
        for eco in result.values():
            for out in eco.outputs:
                rid = out.request_id
                mine = positions.get(rid)
                if mine is None:
                    if rid not in deferred:
                        self._not_deferred(out, live)
                        continue
                    positions[rid] = mine = []
                if out.new_token_ids:
                    mine.append(first + index[rid])
                if out.finish_reason is not None:
                    self._finished(out)

    def _not_deferred(self, out: Any, live: Callable[[str], bool]) -> None:
        # a finished chunk of a streaming-input session is not the end of its request
        if out.finish_reason is not None and not live(out.request_id):
            self.undeferred.discard(out.request_id)

    def _finished(self, out: Any) -> None:
        """A deferred request's finishing output gets its rows, gathered (none held: no logprobs)."""
        width = self.deferred.pop(out.request_id)
        rows = self.positions.pop(out.request_id, None)
        out.new_logprobs = self.rows.gather(rows, width) if rows else None

    def _finish_only(self, result: Any, live: Callable[[str], bool]) -> None:
        """A step without logprob arrays: its finishing deferred requests still get what they hold."""
        if not self.deferred and not self.undeferred:
            return
        for eco in result.values():
            for out in eco.outputs:
                if out.finish_reason is None:
                    continue
                if not live(out.request_id):
                    self.undeferred.discard(out.request_id)
                if out.request_id in self.deferred:  # vLLM sliced nothing: no step arrays
                    self._finished(out)

    def _widest(self) -> int:
        return max(self.deferred.values(), default=1)

    def _oldest(self, live: Callable[[str], bool] | None) -> int:
        """The first row a deferred request still needs; with ``live``, requests the scheduler no longer
        knows (gone without a finish or an abort) are forgotten first."""
        if live is not None:
            self.forget([rid for rids in (self.deferred, self.undeferred) for rid in rids if not live(rid)])
        return min((rows[0] for rows in self.positions.values() if rows), default=self.rows.end)


def is_final_only(sampling_params: Any) -> bool:
    """A request whose logprobs can wait: it asks for sample logprobs and returns only its final output, and
    neither asks for chosen token ids' logprobs (their columns are laid out per step) nor has stop
    strings."""
    return (
        sampling_params is not None
        and sampling_params.num_logprobs is not None
        and not getattr(sampling_params, "logprob_token_ids", None)
        # stop strings are found by the frontend, which then finishes the request itself and aborts it in the
        # engine core: logprobs held there would never arrive
        and not getattr(sampling_params, "stop", None)
        # vllm.sampling_params.RequestOutputKind, by name: this module imports no vLLM at import time
        and getattr(sampling_params.output_kind, "name", None) == "FINAL_ONLY"
    )


def install(scheduler: type | None = None) -> None:
    """Wrap vLLM's ``Scheduler`` (engine-core process; ``scheduler``: that class, or one with the same three
    methods and a ``requests`` dict): ``add_request`` notes final-only requests, ``update_from_output``
    defers their logprobs (:class:`Deferral`), ``finish_requests`` (aborts) forgets them."""
    if scheduler is None:  # vLLM is GPU-only, imported only when the real class is patched
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

    def state(self) -> Deferral:
        if not hasattr(self, "_asyncrl_deferral"):
            self._asyncrl_deferral = Deferral()
        return self._asyncrl_deferral

    def add_request_deferring(self, request, *args, **kwargs):
        # the next chunk of a streaming-input session: noted already
        known = request.request_id in self.requests
        result = add_request(self, request, *args, **kwargs)
        # (a session's last chunk may end it right away)
        if not known and request.request_id in self.requests:
            state(self).add(request.request_id, request.sampling_params)
        return result

    def update_from_output_deferring(self, scheduler_output, model_runner_output):
        return state(self).step(
            model_runner_output,
            lambda: update_from_output(self, scheduler_output, model_runner_output),
            self.requests.__contains__,
        )

    def finish_requests_deferring(self, request_ids, finished_status, *args, **kwargs):
        if request_ids is not None:
            request_ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)  # read once
        # an error finish (update_from_output's own, for a failed KV load) is followed by the request's
        # finishing output, which gets its rows as any other; an abort's output is the frontend's own, so
        # they go now
        if getattr(finished_status, "name", None) != "FINISHED_ERROR":
            state(self).forget(request_ids)
        return finish_requests(self, request_ids, finished_status, *args, **kwargs)

    cls.add_request = add_request_deferring
    cls.update_from_output = update_from_output_deferring
    cls.finish_requests = finish_requests_deferring
    cls._asyncrl_defer_logprobs = True
    # under vLLM's logger, so it lands in the sidecar's log with vLLM's own lines (the GPU test looks for it)
    logging.getLogger("vllm.asyncrl").info(f"asyncrl: {LOG_LINE} ({cls.__module__}.{cls.__name__})")
