"""asyncrl's compact chat logprobs: the wire form (one base64 array a choice) read back to the same numbers,
the frontend's final-only rows kept as the engine core sent them until read, and vLLM's chat handler patched
on stand-ins of its shape (vLLM itself in the GPU environment: the last test, and tests/gpu/test_gpu.py)."""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import types
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import pytest

from asyncrl.inference.vllm import frontend
from asyncrl.rollouts.answers import LOGPROBS_ENCODING_FIELD, encode_logprobs, logprob_values, read_chat
from helpers.logprob_rows import byte_level_tokenizer, random_rows


class Lists(NamedTuple):  # vllm.v1.outputs.LogprobsLists
    logprob_token_ids: np.ndarray
    logprobs: np.ndarray
    sampled_token_ranks: np.ndarray
    cu_num_generated_tokens: list[int] | None = None


def lists(rng, n: int, width: int = 1) -> Lists:
    return Lists(
        rng.integers(0, 500, (n, width)).astype(np.int32),
        rng.normal(-3, 2, (n, width)).astype(np.float32),
        rng.integers(1, 50, n).astype(np.int32),
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_the_compact_form_reads_back_to_the_same_numbers(dtype):
    rng = np.random.default_rng(0)
    values = np.concatenate([rng.normal(-5, 4, 1000), [-9999.0, -0.0, -1e-30, -3e38]]).astype(dtype)
    encoded = encode_logprobs(values)
    assert encoded["content"] is None and encoded["dtype"] == np.dtype(dtype).newbyteorder("<").str
    back = logprob_values(encoded, len(values))
    assert back == values.astype(np.float64).tolist() and all(type(x) is float for x in back)
    big_endian = encode_logprobs(values.astype(np.dtype(dtype).newbyteorder(">")))
    assert logprob_values(big_endian, len(values)) == back  # sent little-endian whatever the array's order


@pytest.mark.parametrize(
    "logprobs, n, match",
    [
        ({"base64": base64.b64encode(b"\0" * 8).decode(), "dtype": "<f2"}, 4, "dtype '<f2'"),
        ({"base64": "not base64!", "dtype": "<f4"}, 1, "not base64"),
        ({"base64": base64.b64encode(b"\0" * 7).decode(), "dtype": "<f4"}, 1, "not base64"),
        (encode_logprobs(np.zeros(3, np.float32)), 4, "3 logprobs for 4 tokens"),
        ({"content": [{"logprob": -1.0}]}, 2, "1 logprobs for 2 tokens"),
    ],
)
def test_a_malformed_compact_answer_is_refused_by_name(logprobs, n, match):
    with pytest.raises(RuntimeError, match=match):
        logprob_values(logprobs, n, "http://sidecar")


def test_the_client_reads_either_form_to_the_same_choice():
    lps = [-0.5, -1.25, -9999.0]
    openai_form = {
        "content": [{"token": f"token_id:{t}", "logprob": lp} for t, lp in zip([4, 5, 6], lps, strict=True)]
    }
    compact = encode_logprobs(np.asarray(lps, np.float32))
    for form in (openai_form, compact):
        choice = {"index": 0, "token_ids": [4, 5, 6], "logprobs": form, "message": {"content": "x"}}
        out = read_chat({"choices": [{**choice, "finish_reason": "length"}]}, "http://sidecar", 0)
        assert out.choices[0].logprobs == lps and out.choices[0].token_ids == [4, 5, 6]


class Proc:  # the fields of vLLM's LogprobsProcessor that the frontend reads
    def __init__(self, num_logprobs: int = 0):
        self.tokenizer, self.num_logprobs, self.logprobs, self.cumulative_logprob = (
            None,
            num_logprobs,
            [],
            0.0,
        )


def recorder():
    calls: list[int] = []

    def append(store, token_ids, logprobs, decoded, rank, num_logprobs):
        calls.append(1)
        store.append((token_ids[0], logprobs[0], rank))

    return calls, append


def test_final_only_rows_are_built_into_entries_only_when_read():
    """The processor of a final-only request keeps the engine core's arrays: no per-token work when they
    arrive, the same cumulative logprob as vLLM's position-by-position sum, the sampled column as it came,
    and vLLM's entries (here the stand-in's) built in order on first access, then for parts that arrive
    later."""
    rng = np.random.default_rng(1)
    calls, append = recorder()
    p = Proc(num_logprobs=2)
    p.logprobs = rows = frontend.SampleRows(p, list, None, append)
    first, second = lists(rng, 70, 3), lists(rng, 30, 3)
    frontend.update_sample_logprobs(p, first, None, append)
    assert calls == [] and len(rows) == 70 and rows.sampled().tolist() == first.logprobs[:, 0].tolist()
    expected = 0.0
    for x in first.logprobs[:, 0].tolist():
        expected += x
    assert p.cumulative_logprob == expected
    assert rows[69] == (first.logprob_token_ids[69, 0], first.logprobs[69, 0], first.sampled_token_ranks[69])
    assert len(calls) == 70
    frontend.update_sample_logprobs(p, second, None, append)
    assert len(calls) == 70 and len(rows) == 100 and rows.sampled().dtype == np.float32
    assert [e[1] for e in rows[:]] == np.concatenate([first.logprobs[:, 0], second.logprobs[:, 0]]).tolist()
    assert len(calls) == 100 and len(rows.entries()) == 100  # each part built once
    assert (
        not frontend.SampleRows(p, list, None, append)
        and frontend.SampleRows(p, list, None, append).sampled().size == 0
    )


@dataclass
class Logprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def test_compact_logprobs_from_rows_or_vllms_entries():
    rng = np.random.default_rng(2)
    got = lists(rng, 5)
    got.logprobs[2, 0] = -np.inf  # vLLM's per-token form clamps at -9999
    p = Proc()
    p.logprobs = rows = frontend.SampleRows(p, list, None, recorder()[1])
    rows.add(got)
    ids = got.logprob_token_ids[:, 0].tolist()
    expected = np.maximum(got.logprobs[:, 0], -9999.0).tolist()
    assert logprob_values(frontend.compact_logprobs(ids, rows), 5) == expected
    entries = [{t: Logprob(float(lp))} for t, lp in zip(ids, got.logprobs[:, 0].tolist(), strict=True)]
    assert logprob_values(frontend.compact_logprobs(ids, entries), 5) == expected
    assert frontend.compact_logprobs(ids, [*entries[:4], None]) is None  # a position without its entry
    assert frontend.compact_logprobs(ids, [*entries[:4], {ids[4] + 1: Logprob(-1.0)}]) is None
    assert frontend.compact_logprobs(ids[:4], rows) is None  # not one a token


def chat_classes():
    """Stand-ins of vLLM's ``OpenAIServingChat`` (the two methods patched, a handler calling them as vLLM's
    does) and ``ChatCompletionLogProbs`` (extra fields allowed)."""

    class LogProbsModel(dict):
        def __init__(self, **fields):
            super().__init__(fields)

    class Serving:
        def create_error_response(self, message, err_type="BadRequestError", status_code=400, param=None):
            return {"error": message, "code": status_code, "param": param}

        def _create_chat_logprobs(self, token_ids, top_logprobs, tokenizer, num_output_top_logprobs=None,
                                  logprob_token_ids=None, return_as_token_id=None):  # fmt: skip
            pairs = zip(token_ids, top_logprobs, strict=True)
            return LogProbsModel(content=[{"logprob": e[t].logprob} for t, e in pairs])

        async def create_chat_completion(self, request, raw_request=None):
            await asyncio.sleep(0)
            return self._create_chat_logprobs(
                token_ids=request.token_ids,
                top_logprobs=request.entries,
                num_output_top_logprobs=request.top_logprobs,
                logprob_token_ids=None,
                tokenizer=None,
                return_as_token_id=True,
            )

    return Serving, LogProbsModel


def test_the_chat_handler_answers_compact_only_when_asked():
    serving, model = chat_classes()
    frontend.install_compact_answers(serving, model)
    frontend.install_compact_answers(serving, model)  # once only
    entries = [{4: Logprob(-0.5)}, {5: Logprob(-1.5)}]

    def ask(top_logprobs=0, **extra):
        request = types.SimpleNamespace(
            token_ids=[4, 5], entries=entries, top_logprobs=top_logprobs, model_extra=extra
        )
        return asyncio.run(serving().create_chat_completion(request))

    compact = ask(**{LOGPROBS_ENCODING_FIELD: "base64"})
    assert compact["content"] is None and logprob_values(compact, 2) == [-0.5, -1.5]
    assert (
        ask()
        == ask(**{LOGPROBS_ENCODING_FIELD: None})
        == {"content": [{"logprob": -0.5}, {"logprob": -1.5}]}
    )
    # top logprobs: vLLM's own form
    assert ask(top_logprobs=2, **{LOGPROBS_ENCODING_FIELD: "base64"})["content"]
    refused = ask(**{LOGPROBS_ENCODING_FIELD: "json"})
    assert (
        refused["code"] == 400
        and refused["param"] == LOGPROBS_ENCODING_FIELD
        and "'json'" in refused["error"]
    )
    assert not frontend.COMPACT.get()  # set for the request's own task only


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed (GPU environments)"
)
@pytest.mark.parametrize("flat", [False, True])
def test_final_only_rows_read_as_vllms_own_entries(flat):
    """vLLM's LogprobsProcessor fed per step against the patched one made for a final-only request and fed
    the rows at once: the same entries (texts and context corrections included), cumulative logprob and
    sampled column."""
    from vllm.logprobs import create_sample_logprobs
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.logprobs import LogprobsProcessor
    from vllm.v1.outputs import LogprobsLists

    tok = byte_level_tokenizer()
    n = 300
    got = random_rows(LogprobsLists, len(tok), n, seed=3)
    vllms = LogprobsProcessor(tok, create_sample_logprobs(flat), None, 0.0, 2, None)
    for i in range(n):
        vllms._update_sample_logprobs(got.slice_request(i, 1))
    patched = type("Patched", (LogprobsProcessor,), {})
    frontend.install_bulk_logprobs(patched)
    sp = SamplingParams(logprobs=2, output_kind=RequestOutputKind.FINAL_ONLY, flat_logprobs=flat)
    once = patched.from_new_request(tok, types.SimpleNamespace(sampling_params=sp))
    assert isinstance(once.logprobs, frontend.SampleRows)
    once._update_sample_logprobs(got)

    def entries(logprobs):
        return [[(k, v.logprob, v.rank, v.decoded_token) for k, v in pos.items()] for pos in logprobs]

    assert once.cumulative_logprob == vllms.cumulative_logprob
    assert once.logprobs.sampled().tolist() == got.logprobs[:, 0].tolist()
    assert entries(once.logprobs) == entries(vllms.logprobs)
    streamed = SamplingParams(logprobs=2, output_kind=RequestOutputKind.DELTA)
    assert not isinstance(
        patched.from_new_request(tok, types.SimpleNamespace(sampling_params=streamed)).logprobs,
        frontend.SampleRows,
    )
