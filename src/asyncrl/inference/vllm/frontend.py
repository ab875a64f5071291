"""The frontend half of deferred logprobs (:mod:`asyncrl.inference.vllm.logprobs`), in vLLM's API-server
process, and asyncrl's compact chat logprobs.

A final-only request's logprobs arrive in one message when it finishes. Its processor keeps them as they came
(:class:`SampleRows`) and builds vLLM's per-position entries (a dict, a ``Logprob`` and a token text per
token) only when something reads them: the chat handler, asked by asyncrl's client for the compact form
(``logprobs_encoding``, :func:`install_compact_answers`), reads the sampled column as one array and answers
it base64, so neither side builds an object per token; other readers get what vLLM's own loop gives
(:func:`append_positions`, in bulk). The per-token objects of OpenAI's form cost the sidecar several
microseconds a token, the largest share of its time per answer at RL batch sizes:
`python benchmarks/logprobs_cost.py --help` splits a round into decode steps and the frontend's tail.

An aborted request's final output is built by the frontend from what it received (a client gone, vLLM's own
aborts when paused with ``mode="abort"`` or shut down): its tokens, and none of the logprobs the engine core
held for it, dropped with the abort. vLLM's handlers read one logprob per token and would answer 500 (an
``IndexError`` in ``_create_chat_logprobs``), so :func:`scored_only` keeps the tokens that have logprobs
(none) and the finish reason ``abort`` says why. asyncrl's client refuses such an answer by name
(:func:`asyncrl.rollouts.answers.read_chat`); it pauses with ``mode="keep"`` and aborts nothing itself.
Written against vLLM 0.26.0's ``LogprobsProcessor`` (``from_new_request``, ``_update_sample_logprobs``),
``RequestState._new_completion_output`` and ``OpenAIServingChat`` (``create_chat_completion``,
``_create_chat_logprobs``).
"""

from __future__ import annotations

import contextvars
import inspect
import itertools
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

import numpy as np

from asyncrl.inference.vllm.logprobs import is_final_only
from asyncrl.rollouts.answers import LOGPROBS_ENCODING, LOGPROBS_ENCODING_FIELD, encode_logprobs


def token_texts(
    tokenizer: Any, convert: Callable[[Any, list[int]], list[str]]
) -> Callable[[list[int]], list[str]]:
    """``convert(tokenizer, ids)`` (vLLM's ``convert_ids_list_to_tokens``: each id decoded on its own, so a
    pure function of the id) with each id's text kept on the tokenizer: a fresh list per call (vLLM corrects
    entries in place)."""
    cache: dict[int, str] | None = getattr(tokenizer, "_asyncrl_token_texts", None)
    if cache is None:
        cache = {}
        try:
            tokenizer._asyncrl_token_texts = cache
        except AttributeError:  # a tokenizer that takes no new attribute: a cache for this call only
            pass

    def texts(ids: list[int]) -> list[str]:
        missing = [i for i in ids if i not in cache]
        if missing:
            cache.update(zip(missing, convert(tokenizer, missing), strict=True))
        return [cache[i] for i in ids]

    return texts


def append_positions(
    processor: Any,
    store: Any,
    logprobs_lists: Any,
    convert: Callable[[Any, list[int]], list[str]],
    append: Callable,
) -> None:
    """vLLM 0.26's ``LogprobsProcessor._update_sample_logprobs`` (frontend) for every position of
    ``logprobs_lists`` at once, appending to ``store`` (vLLM's list or ``FlatLogprobs``); :func:`add_sampled`
    does its ``cumulative_logprob``. The arrays are turned into lists once, not per position; each token's
    text comes from :func:`token_texts`; the sampled-context correction of a token whose text ends in U+FFFD
    (``_verify_tokens``, with the context of ``store``'s last positions) runs only where one does, as vLLM's
    own loop changes nothing elsewhere. ``convert`` / ``append``: vLLM's ``convert_ids_list_to_tokens`` /
    ``append_logprobs_for_next_position``."""
    token_ids_lst, logprobs_lst, ranks_lst, _ = logprobs_lists
    texts = None if processor.tokenizer is None else token_texts(processor.tokenizer, convert)
    # as vLLM zips
    rows = zip(ranks_lst.tolist(), logprobs_lst.tolist(), token_ids_lst.tolist(), strict=False)
    for rank, logprobs, token_ids in rows:
        decoded: Iterable[str | None]
        if texts is None:
            decoded = itertools.repeat(None)
        else:
            decoded = texts(token_ids)
            if any(t.endswith("\ufffd") for t in decoded):
                context = processor._get_sampled_context_ids(store)
                decoded = processor._verify_tokens(
                    decoded_tokens_list=decoded, tokens=token_ids, context_token_ids=context
                )
        append(store, token_ids, logprobs, decoded, rank, processor.num_logprobs)


def update_sample_logprobs(
    processor: Any, logprobs_lists: Any, convert: Callable[[Any, list[int]], list[str]], append: Callable
) -> None:
    """vLLM 0.26's ``LogprobsProcessor._update_sample_logprobs`` with the same result. A final-only request's
    rows (:class:`SampleRows`) are kept as they came; others go through :func:`append_positions`."""
    assert processor.num_logprobs is not None and processor.logprobs is not None
    assert processor.cumulative_logprob is not None
    add_sampled(processor, logprobs_lists)
    if isinstance(processor.logprobs, SampleRows):
        processor.logprobs.add(logprobs_lists)
    else:
        append_positions(processor, processor.logprobs, logprobs_lists, convert, append)


def add_sampled(processor: Any, logprobs_lists: Any) -> None:
    """The sampled tokens' logprobs (first column) added to ``cumulative_logprob`` one position at a time, in
    order: vLLM's float sum."""
    for x in logprobs_lists[1][:, 0].tolist():
        processor.cumulative_logprob += x


class SampleRows(Sequence):
    """A final-only request's sample logprobs as the engine core sent them (its ``LogprobsLists``, once when
    deferred), turned into vLLM's per-position entries only when something indexes them. The frontend then
    does no per-token work for them when it receives them; asyncrl's compact chat answer
    (:func:`compact_logprobs`) reads the sampled column and nothing else, and any other reader gets the
    entries vLLM's own loop builds (:func:`append_positions`, on first access)."""

    def __init__(
        self, processor: Any, empty: Callable[[], Any], convert: Callable, append: Callable
    ) -> None:
        self._processor, self._empty, self._convert, self._append = processor, empty, convert, append
        self._parts: list[Any] = []
        self._entries: Any = None
        self._built = 0  # parts appended to the entries
        self._len = 0

    def add(self, logprobs_lists: Any) -> None:
        self._parts.append(logprobs_lists)
        self._len += len(logprobs_lists[2])

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, i: Any) -> Any:
        return self.entries()[i]

    def sampled(self) -> np.ndarray:
        """The sampled tokens' logprobs, float32 as the engine core computed them, in order."""
        if not self._parts:
            return np.empty(0, np.float32)
        return np.concatenate([np.asarray(p[1])[:, 0] for p in self._parts])

    def entries(self) -> Any:
        """vLLM's container of per-position entries (list or ``FlatLogprobs``), built from the rows not built
        yet."""
        if self._entries is None:
            self._entries = self._empty()
        for part in self._parts[self._built :]:
            append_positions(self._processor, self._entries, part, self._convert, self._append)
        self._built = len(self._parts)
        return self._entries


def scored_only(output: Any) -> Any:
    """``output`` (a ``CompletionOutput``) with no tokens when it is an abort's that asked for logprobs and
    holds none of them; any other output as it is. Under deferral the frontend holds either every logprob of
    a request (sent per step) or none (held in the engine core), so there is no partial case to cut."""
    if (
        output.finish_reason == "abort"
        and output.logprobs is not None
        and not output.logprobs
        and output.token_ids
    ):
        output.token_ids, output.text = [], ""
    return output


# whether the chat request being answered asked for the compact form (set per request by
# install_compact_answers)
COMPACT: contextvars.ContextVar[bool] = contextvars.ContextVar("asyncrl_compact_logprobs", default=False)


def compact_logprobs(token_ids: Sequence[int], top_logprobs: Any) -> dict[str, Any] | None:
    """A chat choice's ``logprobs`` in asyncrl's compact form
    (:func:`asyncrl.rollouts.answers.encode_logprobs`): the sampled tokens' logprobs as float32, clamped at
    -9999 as vLLM's per-token form clamps them, so that a client reads the same numbers either way. ``None``
    where they cannot all be read (a position without its token's entry): the caller answers vLLM's own form
    then."""
    if isinstance(top_logprobs, SampleRows):
        values = top_logprobs.sampled()
    else:
        picked = []
        for t, entry in zip(token_ids, top_logprobs, strict=False):
            if entry is None or entry.get(t) is None:
                return None
            picked.append(entry[t].logprob)
        # vLLM's logprobs are float32 numbers, so this is exact
        values = np.asarray(picked, dtype=np.float32)
    if len(values) != len(token_ids):
        return None
    return encode_logprobs(np.maximum(values, np.float32(-9999.0)))


def install_frontend() -> None:
    """The frontend's changes that go with deferred logprobs (:func:`install_bulk_logprobs`,
    :func:`install_scored_only`)."""
    install_bulk_logprobs()
    install_scored_only()


def install_compact_answers(serving: type | None = None, logprobs_model: type | None = None) -> None:
    """vLLM's chat handler (``OpenAIServingChat``, or a class of the same shape) answers a request that sets
    ``logprobs_encoding`` to ``"base64"`` with each choice's sampled logprobs in one array
    (:func:`compact_logprobs`) instead of an object per token, when it asks for no top logprobs; any other
    value of the field is refused with a 400 naming it. ``logprobs_model``: vLLM's
    ``ChatCompletionLogProbs``."""
    # vLLM is GPU-only, imported only when the real class is patched
    if serving is None or logprobs_model is None:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionLogProbs
        from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat

        serving, logprobs_model = OpenAIServingChat, ChatCompletionLogProbs
    cls: Any = serving
    if getattr(cls, "_asyncrl_compact_logprobs", False):
        return
    create_chat_completion, create_logprobs = cls.create_chat_completion, cls._create_chat_logprobs
    signature = inspect.signature(create_logprobs)  # its arguments come by keyword or position
    model: Any = logprobs_model

    async def create_chat_completion_compact(self, request, raw_request=None):
        encoding = (getattr(request, "model_extra", None) or {}).get(LOGPROBS_ENCODING_FIELD)
        if encoding is not None and encoding != LOGPROBS_ENCODING:
            return self.create_error_response(
                f"{LOGPROBS_ENCODING_FIELD} must be {LOGPROBS_ENCODING!r} or left out, not {encoding!r}",
                param=LOGPROBS_ENCODING_FIELD,
            )
        token = COMPACT.set(encoding == LOGPROBS_ENCODING)  # the full answer is built in this task, under it
        try:
            return await create_chat_completion(self, request, raw_request)
        finally:
            COMPACT.reset(token)

    def _create_chat_logprobs(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs).arguments
        if COMPACT.get() and not bound.get("num_output_top_logprobs") and not bound.get("logprob_token_ids"):
            compact = compact_logprobs(bound["token_ids"], bound["top_logprobs"])
            if compact is not None:
                return model(**compact)
        return create_logprobs(self, *args, **kwargs)

    cls.create_chat_completion = create_chat_completion_compact
    cls._create_chat_logprobs = _create_chat_logprobs
    cls._asyncrl_compact_logprobs = True


def install_bulk_logprobs(processor: type | None = None) -> None:
    """Put :func:`update_sample_logprobs` in place of vLLM's ``LogprobsProcessor._update_sample_logprobs``,
    and give a final-only request's processor a :class:`SampleRows` for its logprobs (``processor``: that
    class, or one of the same shape)."""
    # vLLM is GPU-only: the CPU install has none, and this module's pure parts are tested there
    from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    if processor is None:
        from vllm.v1.engine.logprobs import LogprobsProcessor

        processor = LogprobsProcessor
    cls: Any = processor
    if getattr(cls, "_asyncrl_bulk_logprobs", False):
        return

    def _update_sample_logprobs(self, logprobs_lists):
        update_sample_logprobs(
            self, logprobs_lists, convert_ids_list_to_tokens, append_logprobs_for_next_position
        )

    new = inspect.getattr_static(cls, "from_new_request").__func__

    def from_new_request(klass, tokenizer, request):
        made = new(klass, tokenizer, request)
        sp = request.sampling_params
        if made.logprobs is not None and is_final_only(sp):
            empty = partial(create_sample_logprobs, getattr(sp, "flat_logprobs", False))
            made.logprobs = SampleRows(
                made, empty, convert_ids_list_to_tokens, append_logprobs_for_next_position
            )
        return made

    cls._update_sample_logprobs = _update_sample_logprobs
    cls.from_new_request = classmethod(from_new_request)
    cls._asyncrl_bulk_logprobs = True


def install_scored_only(state: type | None = None) -> None:
    """Pass vLLM's ``RequestState._new_completion_output``'s outputs through :func:`scored_only` (``state``:
    that class, or one of the same shape)."""
    if state is None:  # vLLM is GPU-only, imported only when the real class is patched
        from vllm.v1.engine.output_processor import RequestState

        state = RequestState
    cls: Any = state
    if getattr(cls, "_asyncrl_scored_only", False):
        return
    new_completion_output = cls._new_completion_output

    def _new_completion_output(self, *args, **kwargs):
        return scored_only(new_completion_output(self, *args, **kwargs))

    cls._new_completion_output = _new_completion_output
    cls._asyncrl_scored_only = True
