"""inference.vllm.defer_logprobs: a final-only request's sample logprobs reach the client once, when it finishes,
and are the very arrays per-step delivery would have given; other requests are left alone; aborts leave nothing
held. Against a scheduler of the same shape as vLLM 0.26's, and against vLLM's own structs where vLLM imports."""

from __future__ import annotations

import enum
import importlib.util
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pytest

from asyncrl.inference import vllm_logprobs


class Kind(enum.Enum):  # vllm.sampling_params.RequestOutputKind
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class Lists(NamedTuple):  # vllm.v1.outputs.LogprobsLists
    logprob_token_ids: np.ndarray
    logprobs: np.ndarray
    sampled_token_ranks: np.ndarray
    cu_num_generated_tokens: list[int] | None = None


@dataclass
class Params:
    num_logprobs: int | None
    output_kind: Kind


@dataclass
class Req:
    request_id: str
    sampling_params: Params
    max_tokens: int
    done: int = 0


@dataclass
class Out:  # vllm.v1.engine.EngineCoreOutput
    request_id: str
    new_token_ids: list[int]
    new_logprobs: Any = None
    finish_reason: str | None = None


@dataclass
class Outs:  # vllm.v1.engine.EngineCoreOutputs
    outputs: list[Out] = field(default_factory=list)


def scheduler_class(make_lists=Lists):
    """A scheduler with vLLM's three methods: each step, every running request samples one token, and those that
    ask for logprobs get their one-row slice of the step's arrays, as vLLM's ``slice_request`` gives it."""

    class Scheduler:
        def __init__(self, seed: int = 0):
            self.requests: dict[str, Req] = {}
            self.rng = np.random.default_rng(seed)

        def add_request(self, request: Req) -> None:
            self.requests[request.request_id] = request

        def update_from_output(self, scheduler_output, model_runner_output) -> dict[int, Outs]:
            outs = Outs()
            for rid, req in list(self.requests.items()):
                req.done += 1
                token = int(self.rng.integers(0, 100))
                row = make_lists(
                    np.array([[token]], dtype=np.int32),
                    self.rng.normal(size=(1, 1)).astype(np.float32),
                    np.array([int(self.rng.integers(1, 5))], dtype=np.int32),
                    None,
                )
                lp = row if req.sampling_params.num_logprobs is not None else None
                finished = req.done == req.max_tokens
                outs.outputs.append(Out(rid, [token], lp, "length" if finished else None))
                if finished:
                    del self.requests[rid]
            return {0: outs}

        def finish_requests(self, request_ids, finished_status) -> list:
            ids = (
                self.requests.keys()
                if request_ids is None
                else [request_ids]
                if isinstance(request_ids, str)
                else request_ids
            )
            return [self.requests.pop(r) for r in list(ids) if r in self.requests]

    return Scheduler


REQUESTS = [
    ("final", Params(0, Kind.FINAL_ONLY), 7),
    ("final_short", Params(0, Kind.FINAL_ONLY), 1),
    ("stream", Params(0, Kind.DELTA), 5),
    ("no_logprobs", Params(None, Kind.FINAL_ONLY), 4),
    ("aborted", Params(0, Kind.FINAL_ONLY), 50),
]


def drive(scheduler) -> dict[str, list]:
    """Run the requests to the end (aborting one after 3 steps); what the client receives, per request: the
    logprob messages, in order."""
    for rid, params, n in REQUESTS:
        scheduler.add_request(Req(rid, params, n))
    got: dict[str, list] = {rid: [] for rid, _, _ in REQUESTS}
    step = 0
    while scheduler.requests:
        step += 1
        for eco in scheduler.update_from_output(None, None).values():
            for out in eco.outputs:
                if out.new_logprobs is not None:
                    got[out.request_id].append(out.new_logprobs)
        if step == 3:
            scheduler.finish_requests(["aborted"], "aborted")
    return got


def joined(messages: list) -> tuple:
    return tuple(np.concatenate([m[i] for m in messages]) for i in range(3))


def check_deferred(make_lists=Lists) -> None:
    plain = drive(scheduler_class(make_lists)())
    cls = scheduler_class(make_lists)
    vllm_logprobs.install(cls)
    vllm_logprobs.install(cls)  # a second install (plugins load per process, maybe twice) wraps nothing again
    deferring = cls()
    got = drive(deferring)

    for rid in ("final", "final_short"):  # one message at the end, the same arrays bit for bit
        assert len(plain[rid]) == dict((r, n) for r, _, n in REQUESTS)[rid]
        assert len(got[rid]) == 1
        for a, b in zip(joined(plain[rid]), got[rid][0][:3], strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    assert len(got["stream"]) == 5 and all(  # a streaming request still gets its logprobs every step
        a[1].tobytes() == b[1].tobytes() for a, b in zip(plain["stream"], got["stream"], strict=True)
    )
    assert got["no_logprobs"] == [] and plain["no_logprobs"] == []
    assert got["aborted"] == []  # held, then dropped with the abort: no message and nothing left
    assert deferring._asyncrl_deferred == set() and deferring._asyncrl_held == {}


def test_deferred_logprobs_are_the_per_step_arrays_sent_once():
    check_deferred()


def test_final_only_means_logprobs_asked_and_no_streaming():
    assert vllm_logprobs.is_final_only(Params(0, Kind.FINAL_ONLY))
    assert not vllm_logprobs.is_final_only(Params(None, Kind.FINAL_ONLY))
    assert not vllm_logprobs.is_final_only(Params(0, Kind.DELTA))
    assert not vllm_logprobs.is_final_only(Params(0, Kind.CUMULATIVE))
    assert not vllm_logprobs.is_final_only(None)


def test_aborting_every_request_forgets_every_held_logprob():
    cls = scheduler_class()
    vllm_logprobs.install(cls)
    s = cls()
    for rid, params, _ in REQUESTS:
        s.add_request(Req(rid, params, 100))
    s.update_from_output(None, None)
    assert s._asyncrl_held  # the final-only requests' first step is held
    s.finish_requests(None, "aborted")
    assert s._asyncrl_deferred == set() and s._asyncrl_held == {}


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (GPU environments)")
def test_with_vllms_structs_and_its_message_codec():
    """vLLM's own LogprobsLists, RequestOutputKind and SamplingParams, and the concatenated message through the
    engine core's msgpack encoder and the frontend's decoder."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.outputs import LogprobsLists
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    assert vllm_logprobs.is_final_only(SamplingParams(logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY))
    assert not vllm_logprobs.is_final_only(SamplingParams(logprobs=0, output_kind=RequestOutputKind.DELTA))
    check_deferred(LogprobsLists)
    parts = [
        LogprobsLists(
            np.array([[i]], dtype=np.int32), np.array([[-0.5 * i]], dtype=np.float32), np.array([i], dtype=np.int32)
        )
        for i in range(4)
    ]
    out = EngineCoreOutput("r", [3], new_logprobs=vllm_logprobs.concat(parts), finish_reason=None)
    bufs = MsgpackEncoder().encode(EngineCoreOutputs(outputs=[out]))
    back = MsgpackDecoder(EngineCoreOutputs).decode(bufs).outputs[0].new_logprobs
    assert back.logprobs[:, 0].tolist() == [0.0, -0.5, -1.0, -1.5] and back.sampled_token_ranks.tolist() == [0, 1, 2, 3]

    # the frontend's per-request processor: one call with every position == one call per position
    from vllm.logprobs import create_sample_logprobs
    from vllm.v1.engine.logprobs import LogprobsProcessor

    for flat in (False, True):
        per_step, once = (LogprobsProcessor(None, create_sample_logprobs(flat), None, 0.0, 0, None) for _ in range(2))
        for p in parts:
            per_step._update_sample_logprobs(p)
        once._update_sample_logprobs(vllm_logprobs.concat(parts))
        assert once.cumulative_logprob == per_step.cumulative_logprob
        assert [dict(x) for x in once.logprobs] == [dict(x) for x in per_step.logprobs] and len(once.logprobs) == 4


def test_the_plugin_installs_deferral_only_when_the_sidecar_asks(monkeypatch):
    import sys
    import types

    from asyncrl.inference import vllm_plugin

    cls = scheduler_class()
    for name in ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sched = types.ModuleType("vllm.v1.core.sched.scheduler")
    sched.Scheduler = cls
    monkeypatch.setitem(sys.modules, "vllm.v1.core.sched.scheduler", sched)
    monkeypatch.setenv("ASYNCRL_NUMERICS", "fast")  # the bitwise half of the plugin stays out
    monkeypatch.delenv(vllm_logprobs.ENV, raising=False)
    vllm_plugin.register()
    assert not getattr(cls, "_asyncrl_defer_logprobs", False)
    monkeypatch.setenv(vllm_logprobs.ENV, "1")
    vllm_plugin.register()
    assert cls._asyncrl_defer_logprobs and len(drive(cls())["final"]) == 1


def test_steps_of_different_widths_join_at_the_columns_every_step_holds():
    """A step whose batch held a request asking for top-3 logprobs is 4 columns wide, the others 1: the sampled
    token's column (the first, all this request asked for) survives whole."""
    narrow = Lists(np.array([[5]]), np.array([[-1.0]], dtype=np.float32), np.array([2]))
    wide = Lists(np.array([[7, 1, 2, 3]]), np.array([[-2.0, -0.1, -0.2, -0.3]], dtype=np.float32), np.array([4]))
    joined_ = vllm_logprobs.concat([narrow, wide, narrow])
    assert joined_.logprob_token_ids.tolist() == [[5], [7], [5]]
    assert joined_.logprobs[:, 0].tolist() == [-1.0, -2.0, -1.0] and joined_.sampled_token_ranks.tolist() == [2, 4, 2]
    assert not vllm_logprobs.is_final_only(type("P", (), {"num_logprobs": 0, "output_kind": Kind.FINAL_ONLY,
                                                          "logprob_token_ids": [3]})())  # fmt: skip


def test_held_buffers_grow_and_narrow_without_losing_a_position():
    rng = np.random.default_rng(1)
    parts = [
        Lists(
            rng.integers(0, 9, (k, w)).astype(np.int32),
            rng.normal(size=(k, w)).astype(np.float32),
            rng.integers(1, 9, k).astype(np.int32),
        )
        for k, w in [(1, 3)] * 70 + [(2, 1)] + [(1, 2)] * 200  # past the first buffer, then narrower, then more
    ]
    got = vllm_logprobs.concat(parts)
    assert got.logprobs.shape == (272, 1) and got.logprobs.flags.c_contiguous
    assert got.logprobs[:, 0].tobytes() == np.concatenate([p.logprobs[:, 0] for p in parts]).tobytes()
    assert got.logprob_token_ids[:, 0].tolist() == np.concatenate([p.logprob_token_ids[:, 0] for p in parts]).tolist()
    assert got.sampled_token_ranks.tolist() == np.concatenate([p.sampled_token_ranks for p in parts]).tolist()
