"""Inputs of the tests that hold asyncrl's logprob paths against vLLM's own processor: a tokenizer whose
bytes decode to U+FFFD mid-character, and random sampled rows."""

from __future__ import annotations

import numpy as np


def byte_level_tokenizer():
    """A byte-level BPE tokenizer trained here: single bytes of a multi-byte character decode to U+FFFD, the
    case vLLM corrects from the sampled context."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<eos>"]
    )
    tok.train_from_iterator(["hello world, 你好世界, ünïcödé 🙂"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def random_rows(cls, vocab: int, n: int, seed: int):
    """``n`` positions of a sampled token and its top 2 (``cls``: vLLM's ``LogprobsLists``) over ``vocab``
    ids."""
    rng = np.random.default_rng(seed)
    return cls(
        rng.integers(0, vocab, (n, 3)).astype(np.int32),
        rng.normal(-2, 1, (n, 3)).astype(np.float32),
        rng.integers(1, 40, n).astype(np.int32),
    )
