"""The frontend half of deferred logprobs (:mod:`asyncrl.inference.vllm.logprobs`), in vLLM's API-server process.

A deferred request's logprobs arrive in one message when it finishes; :func:`update_sample_logprobs` reads them
in bulk, with the numbers and token texts vLLM's own per-position loop gives. An aborted request's final output is
built by the frontend from what it received (a client gone, vLLM's own aborts when paused with ``mode="abort"``
or shut down): its tokens, and none of the logprobs the engine core held for it, dropped with the abort. vLLM's
handlers read one logprob per token and would answer 500 (an ``IndexError`` in ``_create_chat_logprobs``), so
:func:`scored_only` keeps the tokens that have logprobs (none) and the finish reason ``abort`` says why. asyncrl's
client refuses such an answer by name (:func:`asyncrl.rollouts.answers.read_chat`); it pauses with ``mode="keep"``
and aborts nothing itself. Written against vLLM 0.26.0's ``LogprobsProcessor._update_sample_logprobs`` and
``RequestState._new_completion_output``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from typing import Any


def token_texts(tokenizer: Any, convert: Callable[[Any, list[int]], list[str]]) -> Callable[[list[int]], list[str]]:
    """``convert(tokenizer, ids)`` (vLLM's ``convert_ids_list_to_tokens``: each id decoded on its own, so a pure
    function of the id) with each id's text kept on the tokenizer: a fresh list per call (vLLM corrects entries
    in place)."""
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


def update_sample_logprobs(
    processor: Any, logprobs_lists: Any, convert: Callable[[Any, list[int]], list[str]], append: Callable
) -> None:
    """vLLM 0.26's ``LogprobsProcessor._update_sample_logprobs`` (frontend) for every position of
    ``logprobs_lists`` at once, with the same result: the arrays turned into lists once, not per position; each
    token's text from :func:`token_texts`; the sampled-context correction of a token whose text ends in U+FFFD
    (``_verify_tokens``, which reads the positions appended so far) only where one does, as vLLM's own loop
    changes nothing elsewhere. ``convert`` / ``append``: vLLM's ``convert_ids_list_to_tokens`` /
    ``append_logprobs_for_next_position``."""
    assert processor.num_logprobs is not None and processor.logprobs is not None
    assert processor.cumulative_logprob is not None
    token_ids_lst, logprobs_lst, ranks_lst, _ = logprobs_lists
    texts = None if processor.tokenizer is None else token_texts(processor.tokenizer, convert)
    rows = zip(ranks_lst.tolist(), logprobs_lst.tolist(), token_ids_lst.tolist(), strict=False)  # as vLLM zips
    for rank, logprobs, token_ids in rows:
        decoded: Iterable[str | None]
        if texts is None:
            decoded = itertools.repeat(None)
        else:
            decoded = texts(token_ids)
            if any(t.endswith("\ufffd") for t in decoded):
                decoded = processor._verify_tokens(decoded_tokens_list=decoded, tokens=token_ids)
        processor.cumulative_logprob += logprobs[0]  # the sampled token's, first (vLLM's sampler)
        append(processor.logprobs, token_ids, logprobs, decoded, rank, processor.num_logprobs)


def scored_only(output: Any) -> Any:
    """``output`` (a ``CompletionOutput``) with no tokens when it is an abort's that asked for logprobs and holds none
    of them; any other output as it is. Under deferral the frontend holds either every logprob of a request (sent
    per step) or none (held in the engine core), so there is no partial case to cut."""
    if output.finish_reason == "abort" and output.logprobs is not None and not output.logprobs and output.token_ids:
        output.token_ids, output.text = [], ""
    return output


def install_frontend() -> None:
    """Both of this module's changes to vLLM's frontend (:func:`install_bulk_logprobs`, :func:`install_scored_only`)."""
    install_bulk_logprobs()
    install_scored_only()


def install_bulk_logprobs(processor: type | None = None) -> None:
    """Put :func:`update_sample_logprobs` in place of vLLM's ``LogprobsProcessor._update_sample_logprobs``
    (``processor``: that class, or one of the same shape)."""
    # vLLM is GPU-only: the CPU install has none, and this module's pure parts are tested there
    from vllm.logprobs import append_logprobs_for_next_position
    from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

    if processor is None:
        from vllm.v1.engine.logprobs import LogprobsProcessor

        processor = LogprobsProcessor
    cls: Any = processor
    if getattr(cls, "_asyncrl_bulk_logprobs", False):
        return

    def _update_sample_logprobs(self, logprobs_lists):
        update_sample_logprobs(self, logprobs_lists, convert_ids_list_to_tokens, append_logprobs_for_next_position)

    cls._update_sample_logprobs = _update_sample_logprobs
    cls._asyncrl_bulk_logprobs = True


def install_scored_only(state: type | None = None) -> None:
    """Pass vLLM's ``RequestState._new_completion_output``'s outputs through :func:`scored_only` (``state``: that
    class, or one of the same shape)."""
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
