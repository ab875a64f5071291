"""inference.vllm.defer_logprobs: a final-only request's sample logprobs reach the client once, when it
finishes, and are the very numbers per-step delivery would have given (cut to the columns it asked for);
other requests are left alone; vLLM's per-request slicing is skipped where the batch allows; aborted and
vanished requests leave nothing held. Against a scheduler of the same shape as vLLM 0.26's, and against
vLLM's own structs where vLLM imports."""

from __future__ import annotations

import enum
import importlib.util
import sys
import types
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import pytest

from asyncrl.inference.vllm import frontend as vllm_frontend
from asyncrl.inference.vllm import logprobs as vllm_logprobs
from asyncrl.inference.vllm import plugin as vllm_plugin
from asyncrl.rollouts.answers import read_chat
from helpers.logprob_rows import byte_level_tokenizer, random_rows


class Kind(enum.Enum):  # vllm.sampling_params.RequestOutputKind
    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


class Lists(NamedTuple):  # vllm.v1.outputs.LogprobsLists
    logprob_token_ids: np.ndarray
    logprobs: np.ndarray
    sampled_token_ranks: np.ndarray
    cu_num_generated_tokens: list[int] | None = None

    def slice_request(self, req_idx: int, num_positions: int):  # vLLM 0.26's, verbatim
        if self.cu_num_generated_tokens is not None:
            req_idx = self.cu_num_generated_tokens[req_idx]
        end_idx = req_idx + num_positions
        return Lists(
            self.logprob_token_ids[req_idx:end_idx],
            self.logprobs[req_idx:end_idx],
            self.sampled_token_ranks[req_idx:end_idx],
            None,
        )


@dataclass
class Params:  # vllm.SamplingParams, the fields read here
    num_logprobs: int | None
    output_kind: Kind = Kind.FINAL_ONLY
    stop: list[str] = field(default_factory=list)


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


@dataclass
class MRO:  # vllm.v1.outputs.ModelRunnerOutput, the fields read here
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: Any


def scheduler_class():
    """A scheduler with vLLM 0.26's methods and its ``update_from_output`` logic for sampled tokens and
    logprobs: each scheduled request takes its tokens (cut at its max_tokens), and one that asks for logprobs
    gets ``logprobs.slice_request(req_index, len(new_token_ids))`` when the step has logprob arrays."""

    class Scheduler:
        def __init__(self):
            self.requests: dict[str, Req] = {}
            self.sliced = 0

        def add_request(self, request: Req) -> None:
            self.requests[request.request_id] = request

        def update_from_output(self, scheduler_output, model_runner_output: MRO) -> dict[int, Outs]:
            logprobs = model_runner_output.logprobs
            outs = Outs()
            for rid in model_runner_output.req_ids:
                req = self.requests.get(rid)
                if req is None:
                    continue
                index = model_runner_output.req_id_to_index[rid]
                tokens = model_runner_output.sampled_token_ids[index][: req.max_tokens - req.done]
                req.done += len(tokens)
                new_logprobs = None
                if req.sampling_params.num_logprobs is not None and logprobs:
                    new_logprobs = logprobs.slice_request(index, len(tokens))
                    self.sliced += 1
                finished = req.done >= req.max_tokens
                outs.outputs.append(Out(rid, tokens, new_logprobs, "length" if finished else None))
                if finished:
                    del self.requests[rid]
            return {0: outs}

        def finish_requests(self, request_ids, finished_status) -> list:
            if request_ids is None:
                ids = list(self.requests)
            else:
                ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
            return [self.requests.pop(r) for r in ids if r in self.requests]

    return Scheduler


def model_runner_output(rng, running: list[Req], tokens: int) -> MRO:
    """One step's output for the ``running`` requests, ``tokens`` each (2: speculative decoding's layout,
    with ``cu_num_generated_tokens``): logprob arrays as wide as the most top-logprobs asked for, if any
    request asks."""
    ids = [r.request_id for r in running]
    wanting = [r.sampling_params.num_logprobs for r in running if r.sampling_params.num_logprobs is not None]
    rows = len(running) * tokens
    width = 1 + max(wanting, default=0)
    lists = Lists(
        rng.integers(0, 1000, (rows, width)).astype(np.int32),
        rng.normal(size=(rows, width)).astype(np.float32),
        rng.integers(1, 50, rows).astype(np.int32),
        [i * tokens for i in range(len(running))] if tokens > 1 else None,
    )
    sampled = [
        [int(x) for x in lists.logprob_token_ids[i * tokens : (i + 1) * tokens, 0]]
        for i in range(len(running))
    ]
    return MRO(ids, {r: i for i, r in enumerate(ids)}, sampled, lists if wanting else None)


def drive(
    scheduler, arrivals: dict[int, list[Req]], seed=0, spec_steps=(), aborts=None, vanish=None
) -> dict:
    """Run requests arriving at given steps to the end; what the client receives, per request: the logprob
    messages, in order. ``aborts`` / ``vanish``: step -> request ids aborted (``finish_requests``) / dropped
    from the scheduler without a word."""
    rng = np.random.default_rng(seed)
    got: dict[str, list] = defaultdict(list)
    step, last = 0, max(arrivals)
    while step <= last or scheduler.requests:
        for req in arrivals.get(step, []):
            scheduler.add_request(Req(req.request_id, req.sampling_params, req.max_tokens))
        if scheduler.requests:
            mro = model_runner_output(rng, list(scheduler.requests.values()), 2 if step in spec_steps else 1)
            for eco in scheduler.update_from_output(None, mro).values():
                for out in eco.outputs:
                    if out.new_logprobs is not None:
                        got[out.request_id].append(out.new_logprobs)
        if aborts and step in aborts:
            scheduler.finish_requests(aborts[step], "aborted")
        if vanish and step in vanish:
            for rid in vanish[step]:
                scheduler.requests.pop(rid, None)
        step += 1
    return got


def deferring():
    cls = scheduler_class()
    vllm_logprobs.install(cls)
    # a second install (plugins load per process, maybe twice) wraps nothing again
    vllm_logprobs.install(cls)
    return cls()


def columns(messages: list, width: int | None) -> tuple:
    """Per-step messages joined, cut to the columns a request reads."""
    cut = slice(None) if width is None else slice(0, width)
    return (
        np.concatenate([m[0][:, cut] for m in messages]),
        np.concatenate([m[1][:, cut] for m in messages]),
        np.concatenate([m[2] for m in messages]),
    )


def same(a: tuple, b: Any) -> bool:
    pairs = zip(a[:3], b[:3], strict=True)
    return all(x.dtype == y.dtype and x.shape == y.shape and x.tobytes() == y.tobytes() for x, y in pairs)


MIX = {
    0: [
        Req("final", Params(0), 7),
        Req("final_top2", Params(2), 9),
        Req("final_short", Params(0), 1),
        Req("stream", Params(0, Kind.DELTA), 5),
        Req("stop_strings", Params(0, stop=["\n"]), 6),
        Req("no_logprobs", Params(None), 4),
        Req("aborted", Params(0), 50),
    ],
    4: [Req("late", Params(1), 8)],
}


def test_deferred_logprobs_are_the_per_step_numbers_sent_once():
    plain = drive(scheduler_class()(), MIX, spec_steps={2, 3}, aborts={3: ["aborted"]})
    s = deferring()
    got = drive(s, MIX, spec_steps={2, 3}, aborts={3: ["aborted"]})
    for rid, width in (("final", 1), ("final_top2", 3), ("final_short", 1), ("late", 2)):
        assert len(got[rid]) == 1 and len(plain[rid]) > 1 or rid == "final_short"
        assert same(columns(plain[rid], width), got[rid][0]), rid
    assert len(plain["final"]) == 5  # 7 tokens in 5 steps: two speculative steps of two tokens each
    for rid in ("stream", "stop_strings"):  # every step, as vLLM sends them
        assert len(got[rid]) == len(plain[rid]) > 1
        assert all(same(a, b) for a, b in zip(plain[rid], got[rid], strict=True))
    assert got["no_logprobs"] == [] and plain["no_logprobs"] == []
    assert got["aborted"] == []  # held, then dropped with the abort: no message and nothing left
    d = s._asyncrl_deferral
    assert d.deferred == {} and d.positions == {} and d.undeferred == set()


def test_vllm_slices_nothing_when_every_logprob_request_is_deferred():
    reqs = {0: [Req(f"r{i}", Params(0), 10) for i in range(6)] + [Req("none", Params(None), 10)]}
    plain, s = scheduler_class()(), deferring()
    a, b = drive(plain, reqs), drive(s, reqs)
    assert plain.sliced == 60 and s.sliced == 0
    assert all(same(columns(a[r], 1), b[r][0]) for r in a)
    mixed = deferring()  # a streaming request in the batch: vLLM slices for everyone while it runs
    drive(mixed, {0: [*reqs[0], Req("stream", Params(0, Kind.DELTA), 3)]})
    assert mixed.sliced == 3 * 7


def test_rows_are_dropped_once_no_live_request_needs_them():
    """Requests come and go for 600 steps: the buffers hold about what the live requests need, every request
    still gets exactly its numbers, and one that vanished from the scheduler is forgotten."""
    rng = np.random.default_rng(3)
    arrivals = {
        step: [
            Req(f"s{step}_{i}", Params(int(rng.integers(0, 3))), int(rng.integers(3, 30))) for i in range(3)
        ]
        for step in range(0, 600, 4)
    }
    plain = drive(scheduler_class()(), arrivals, seed=1, vanish={10: ["s8_0"]})
    s = deferring()
    got = drive(s, arrivals, seed=1, vanish={10: ["s8_0"]})
    widths = {r.request_id: r.sampling_params.num_logprobs + 1 for reqs in arrivals.values() for r in reqs}
    for rid in plain:
        if rid != "s8_0":
            assert len(got[rid]) == 1 and same(columns(plain[rid], widths[rid]), got[rid][0]), rid
    assert got["s8_0"] == [] and len(plain["s8_0"]) == 3  # 3 steps of it, then gone
    rows = s._asyncrl_deferral.rows
    assert rows.end > 5 * len(rows.ranks) and rows.origin > 0  # rows were dropped, many times over
    assert s._asyncrl_deferral.positions == {} and s._asyncrl_deferral.deferred == {}


def test_final_only_means_logprobs_asked_no_streaming_no_stop_strings():
    assert vllm_logprobs.is_final_only(Params(0, Kind.FINAL_ONLY))
    assert not vllm_logprobs.is_final_only(Params(None, Kind.FINAL_ONLY))
    assert not vllm_logprobs.is_final_only(Params(0, Kind.DELTA))
    assert not vllm_logprobs.is_final_only(Params(0, Kind.CUMULATIVE))
    assert not vllm_logprobs.is_final_only(Params(0, Kind.FINAL_ONLY, stop=["</answer>"]))
    assert not vllm_logprobs.is_final_only(None)
    assert not vllm_logprobs.is_final_only(type("P", (), {"num_logprobs": 0, "output_kind": Kind.FINAL_ONLY,
                                                          "logprob_token_ids": [3]})())  # fmt: skip


def test_aborting_every_request_forgets_every_held_logprob():
    s = deferring()
    for req in MIX[0]:
        s.add_request(Req(req.request_id, req.sampling_params, 100))
    s.update_from_output(None, model_runner_output(np.random.default_rng(0), list(s.requests.values()), 1))
    assert s._asyncrl_deferral.positions  # the final-only requests' first step is held
    s.finish_requests(None, "aborted")
    d = s._asyncrl_deferral
    assert d.deferred == {} and d.positions == {} and d.undeferred == set()


def test_buffers_narrow_to_what_live_requests_read():
    """A top-3 request widens the rows; once it is gone they narrow again at the next refill, and the
    requests left still read their column."""
    wide = {0: [Req("top3", Params(3), 3)] + [Req(f"a{i}", Params(0), 400) for i in range(4)]}
    plain = drive(scheduler_class()(), wide, seed=2)
    s = deferring()
    got = drive(s, wide, seed=2)
    assert all(same(columns(plain[r], 4 if r == "top3" else 1), got[r][0]) for r in plain)
    # 400 steps x 5 rows filled the buffers after top3 ended
    assert s._asyncrl_deferral.rows.ids.shape[1] == 1


def test_whole_vocabulary_requests_and_session_chunks_are_left_to_vllm():
    s = deferring()
    s.add_request(Req("all", Params(-1), 3))
    s.add_request(Req("r", Params(0), 3))
    s.add_request(Req("r", Params(0, Kind.DELTA), 3))  # a second chunk of a known request: not noted again
    d = s._asyncrl_deferral
    assert d.undeferred == {"all"} and d.deferred == {"r": 1}


def test_an_error_finish_keeps_the_rows_for_the_finishing_output():
    """vLLM finishes a request with FINISHED_ERROR inside update_from_output (a failed KV load), then sends
    its finishing output: that output still gets the request's logprobs."""
    s = deferring()
    s.add_request(Req("r", Params(0), 10))
    mro = model_runner_output(np.random.default_rng(0), list(s.requests.values()), 1)
    assert s.update_from_output(None, mro)[0].outputs[0].new_logprobs is None  # held
    s.finish_requests(["r"], type("Status", (), {"name": "FINISHED_ERROR"})())
    nxt = MRO(
        ["x"], {"x": 0}, [[1]], Lists(np.zeros((1, 1), np.int32), np.zeros((1, 1), np.float32), np.ones(1))
    )
    error = Out("r", [], None, "error")
    s._asyncrl_deferral.step(nxt, lambda: {0: Outs([error])}, lambda r: False)
    assert same(mro.logprobs, error.new_logprobs)  # its one position, from the step before
    d = s._asyncrl_deferral
    assert d.positions == {} and d.deferred == {}


def test_the_whole_vocabulary_keeps_every_column():
    rows = vllm_logprobs.Rows()
    lists = Lists(np.arange(8, dtype=np.int32).reshape(2, 4), np.ones((2, 4), np.float32), np.array([1, 2]))
    first = rows.append(lists, lambda: 0, lambda: 1)
    assert rows.gather([first + 1], None).logprob_token_ids.tolist() == [[4, 5, 6, 7]]
    assert rows.gather([first + 1, first], 1).logprob_token_ids.tolist() == [[4], [0]]


def test_the_plugin_installs_deferral_only_when_the_sidecar_asks(monkeypatch):
    cls = scheduler_class()
    for name in ("vllm", "vllm.v1", "vllm.v1.core", "vllm.v1.core.sched"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sched = types.ModuleType("vllm.v1.core.sched.scheduler")
    sched.Scheduler = cls
    monkeypatch.setitem(sys.modules, "vllm.v1.core.sched.scheduler", sched)
    frontend = type("LogprobsProcessor", (), {"from_new_request": classmethod(lambda cls, tok, req: cls())})
    state = type(
        "RequestState",
        (),
        {"_new_completion_output": lambda self, *a: Completion([5, 6], "ab", [], "abort")},
    )
    for name, attrs in (
        ("vllm.logprobs", {"append_logprobs_for_next_position": None, "create_sample_logprobs": None}),
        ("vllm.tokenizers", {}),
        ("vllm.tokenizers.detokenizer_utils", {"convert_ids_list_to_tokens": None}),
        ("vllm.v1.engine", {}),
        ("vllm.v1.engine.logprobs", {"LogprobsProcessor": frontend}),
        ("vllm.v1.engine.output_processor", {"RequestState": state}),
    ):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        for k, v in attrs.items():
            setattr(sys.modules[name], k, v)
    monkeypatch.setenv("ASYNCRL_NUMERICS", "fast")  # the bitwise half of the plugin stays out
    monkeypatch.delenv(vllm_logprobs.ENV, raising=False)
    monkeypatch.delenv("ASYNCRL_LOGPROBS_KERNEL", raising=False)  # its own test: test_logprobs_kernel.py
    vllm_plugin.register()
    assert not getattr(cls, "_asyncrl_defer_logprobs", False) and not hasattr(
        frontend, "_asyncrl_bulk_logprobs"
    )
    monkeypatch.setenv(vllm_logprobs.ENV, "1")
    vllm_plugin.register()
    assert frontend._asyncrl_bulk_logprobs and hasattr(frontend, "_update_sample_logprobs")
    # an abort's output: scored only
    assert state()._new_completion_output([], "abort", None).token_ids == []
    assert cls._asyncrl_defer_logprobs and len(drive(cls(), {0: [Req("r", Params(0), 5)]})["r"]) == 1


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (GPU environments)"
)
def test_with_vllms_structs_and_its_message_codec():
    """vLLM's own LogprobsLists, RequestOutputKind and SamplingParams; the gathered message through the
    engine core's msgpack encoder and the frontend's decoder; the frontend's processor given it once == per
    step."""
    from vllm.logprobs import create_sample_logprobs
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine import EngineCoreOutput, EngineCoreOutputs
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    assert vllm_logprobs.is_final_only(SamplingParams(logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY))
    assert not vllm_logprobs.is_final_only(SamplingParams(logprobs=0, output_kind=RequestOutputKind.DELTA))
    assert not vllm_logprobs.is_final_only(
        SamplingParams(logprobs=0, stop=["x"], output_kind=RequestOutputKind.FINAL_ONLY)
    )
    steps = [
        LogprobsLists(
            np.array([[i, 9], [i + 1, 8]], dtype=np.int32),
            np.array([[-0.5 * i, -3.0], [-0.25 * i, -4.0]], dtype=np.float32),
            np.array([i, i + 1], dtype=np.int32),
        )
        for i in range(4)
    ]
    rows = vllm_logprobs.Rows()
    at = [rows.append(step, lambda: 0, lambda: 1) for step in steps]
    gathered = rows.gather([a + 1 for a in at], 1)  # the second request of each step, the sampled column
    assert type(gathered) is LogprobsLists
    out = EngineCoreOutput("r", [3], new_logprobs=gathered, finish_reason=None)
    back = MsgpackDecoder(EngineCoreOutputs).decode(
        MsgpackEncoder().encode(EngineCoreOutputs(outputs=[out]))
    )
    lp = back.outputs[0].new_logprobs
    assert lp.logprobs[:, 0].tolist() == [0.0, -0.25, -0.5, -0.75] and lp.sampled_token_ranks.tolist() == [
        1,
        2,
        3,
        4,
    ]
    for flat in (False, True):
        per_step, once = (
            LogprobsProcessor(None, create_sample_logprobs(flat), None, 0.0, 0, None) for _ in range(2)
        )
        for step in steps:
            per_step._update_sample_logprobs(step.slice_request(1, 1))
        once._update_sample_logprobs(gathered)
        assert once.cumulative_logprob == per_step.cumulative_logprob
        assert [dict(x) for x in once.logprobs] == [dict(x) for x in per_step.logprobs] and len(
            once.logprobs
        ) == 4


def test_bulk_frontend_calls_the_context_correction_only_where_vllm_would_change_something():
    """Without vLLM: the stand-ins of its two helpers; each id's text asked for once; a row whose texts end
    in U+FFFD goes through the processor's ``_verify_tokens``, the others do not."""
    asked: list[list[int]] = []

    def convert(tokenizer, ids):
        asked.append(list(ids))
        return ["\ufffd" if i % 10 == 0 else f"t{i}" for i in ids]

    class Tok:
        pass

    class Proc:
        def __init__(self):
            self.tokenizer, self.num_logprobs, self.logprobs, self.cumulative_logprob = Tok(), 1, [], 0.0
            self.verified: list[list[int]] = []
            self.contexts: list[list[int]] = []

        def _verify_tokens(self, decoded_tokens_list, tokens, context_token_ids):
            self.verified.append(tokens)
            self.contexts.append(context_token_ids)
            return [t.replace("\ufffd", "fixed") for t in decoded_tokens_list]

        @staticmethod
        def _get_sampled_context_ids(store):
            return [ids[0] for ids, *_ in store[-4:]]

    def append(store, token_ids, logprobs, decoded, rank, num_logprobs):
        store.append((token_ids, logprobs, list(decoded), rank))

    ids = np.array([[1, 2], [10, 3], [1, 2], [4, 20]], dtype=np.int32)
    lps = np.array([[-0.5, -1.0], [-0.25, -2.0], [-0.125, -3.0], [-1.0, -4.0]], dtype=np.float32)
    p = Proc()
    vllm_frontend.update_sample_logprobs(p, Lists(ids, lps, np.array([1, 2, 3, 4])), convert, append)
    assert p.verified == [[10, 3], [4, 20]] and p.contexts == [[1], [1, 10, 1]]  # the positions before each
    assert [d for _, _, d, _ in p.logprobs] == [["t1", "t2"], ["fixed", "t3"], ["t1", "t2"], ["t4", "fixed"]]
    assert p.cumulative_logprob == -0.5 - 0.25 - 0.125 - 1.0 and [r for *_, r in p.logprobs] == [1, 2, 3, 4]
    assert sorted(i for a in asked for i in a) == [1, 2, 3, 4, 10, 20]  # each id once, kept on the tokenizer
    vllm_frontend.update_sample_logprobs(Proc(), Lists(ids, lps, np.array([1, 2, 3, 4])), convert, append)
    assert len(asked) == 6  # a new tokenizer object: its rows' ids asked again


@dataclass
class Completion:  # the fields of vLLM's CompletionOutput that scored_only reads
    token_ids: list[int]
    text: str
    logprobs: list[dict] | None
    finish_reason: str | None


@pytest.mark.parametrize(
    "given, kept",
    [
        # held in the engine core, dropped
        (Completion([5, 6], "ab", [], "abort"), Completion([], "", [], "abort")),
        # sent per step: every logprob is here
        (Completion([5, 6], "ab", [{5: -1.0}, {6: -2.0}], "abort"), None),
        (Completion([5, 6], "ab", None, "abort"), None),  # no logprobs asked
        (Completion([5, 6], "ab", [], "length"), None),  # not an abort: its logprobs come with this output
        (Completion([], "", [], "abort"), None),  # aborted before its first token
    ],
)
def test_an_aborted_output_keeps_only_the_tokens_it_has_logprobs_for(given, kept):
    """vLLM's handlers read one logprob per token (an IndexError, a 500, otherwise): an abort's output built
    by the frontend while the engine core held the request's logprobs answers no tokens, finish reason
    ``abort``."""
    expected = Completion(**vars(given)) if kept is None else kept
    assert vllm_frontend.scored_only(given) == expected


def test_the_rollout_client_refuses_an_aborted_answer_by_name():
    """What the sidecar answers for an aborted request (no tokens, finish reason ``abort``) is never trained
    on."""
    choice = {"index": 0, "token_ids": [], "logprobs": {"content": []}, "message": {"content": ""}}
    with pytest.raises(RuntimeError, match="aborted the request"):
        read_chat({"choices": [{**choice, "finish_reason": "abort"}]}, "http://sidecar", 0)
    assert (
        read_chat({"choices": [{**choice, "finish_reason": "length"}]}, "http://sidecar", 0).choices[0].text
        == ""
    )


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (GPU environments)"
)
@pytest.mark.parametrize("flat", [False, True])
def test_bulk_frontend_gives_what_vllms_own_loop_gives(flat):
    """vLLM's LogprobsProcessor fed per step (its own ``_update_sample_logprobs``) against the bulk one fed a
    request's rows at once and fed per step, on random ids of a byte-level tokenizer (U+FFFD and its
    correction included): the same Logprob entries, decoded texts and cumulative logprob."""
    from vllm.logprobs import create_sample_logprobs
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    tok = byte_level_tokenizer()
    n = 300
    lists = random_rows(LogprobsLists, len(tok), n, seed=5)

    def processor():
        return LogprobsProcessor(tok, create_sample_logprobs(flat), None, 0.0, 2, None)

    vllms = processor()
    for i in range(n):
        vllms._update_sample_logprobs(lists.slice_request(i, 1))
    raw = {i: tok.decode([i]) for i in range(len(tok))}
    corrected = [
        k
        for pos in vllms.logprobs
        for k, e in pos.items()
        if raw[k].endswith("\ufffd") != e.decoded_token.endswith("\ufffd")
    ]
    assert len(corrected) > 5  # vLLM's context correction changed some texts: the case is exercised

    bulk_cls = type("Bulk", (LogprobsProcessor,), {})
    vllm_frontend.install_bulk_logprobs(bulk_cls)
    once, per_step = (
        bulk_cls(tok, create_sample_logprobs(flat), None, 0.0, 2, None),
        bulk_cls(tok, create_sample_logprobs(flat), None, 0.0, 2, None),
    )
    once._update_sample_logprobs(lists)
    for i in range(n):
        per_step._update_sample_logprobs(lists.slice_request(i, 1))

    def entries(p):
        return [[(k, v.logprob, v.rank, v.decoded_token) for k, v in pos.items()] for pos in p.logprobs]

    assert entries(once) == entries(vllms) == entries(per_step)
    assert once.cumulative_logprob == vllms.cumulative_logprob == per_step.cumulative_logprob
