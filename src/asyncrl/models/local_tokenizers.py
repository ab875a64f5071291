"""Tokenizers built offline for the random-init models ``asyncrl prepare`` makes (``model.init.tokenizer``).

- ``char``: one token per character of ``model.init.charset``; the CPU default, where a short vocabulary
  keeps the micro model small enough to learn in minutes.
- ``byte_bpe``: a byte-level BPE of exactly ``model.init.vocab_size`` ids (151,936 for Qwen3's shape), with
  merges made up deterministically rather than learned: what the GPU shapes need, since the engine, the
  logprob head and the weight transfer care about the number of ids, not what they mean. Every id decodes to
  text and text re-encodes, so a model that samples anywhere in the vocabulary produces ordinary completions.

Both carry the same role tokens and chat template, so every code path renders prompts alike.
"""

from __future__ import annotations

import string

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from asyncrl.config.fields import ConfigError

SPECIAL_TOKENS = ["<|pad|>", "<|end|>", "<|unk|>", "<|system|>", "<|user|>", "<|assistant|>"]
# One token per role marker keeps prompts short for a character-level model.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CHARSETS = {
    "ascii_lowercase": string.ascii_lowercase + " ",
    "ascii_printable": string.printable[:95] + "\n\t",
}
# the byte-level symbols that merges are built from: letters, digits and the space ("Ġ" in byte-level form)
_MERGEABLE = string.ascii_letters + string.digits + "Ġ"


def _fast(core: Tokenizer) -> PreTrainedTokenizerFast:
    core.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<|pad|>",
        eos_token="<|end|>",
        unk_token="<|unk|>",
        chat_template=CHAT_TEMPLATE,
    )


def build_char_tokenizer(charset: str) -> PreTrainedTokenizerFast:
    """A character-level ``PreTrainedTokenizerFast``: one token per character, specials for chat roles."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + list(CHARSETS[charset]))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<|unk|>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return _fast(core)


def byte_bpe_vocabulary(size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The vocabulary (byte-level symbols, then merged tokens, then the role tokens last, as Qwen3 places its
    specials) and the merges of a byte-level BPE of exactly ``size`` ids. Merges join each token of the last
    round with one letter, digit or space, shortest tokens first."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    budget = size - len(SPECIAL_TOKENS)
    if budget < len(alphabet):
        raise ConfigError(
            f"invalid config:\n  model.init.vocab_size={size}: model.init.tokenizer=byte_bpe needs at least "
            f"{len(alphabet) + len(SPECIAL_TOKENS)} ids (256 bytes and {len(SPECIAL_TOKENS)} role tokens)"
        )
    vocab = {tok: i for i, tok in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    last = list(_MERGEABLE)
    while len(vocab) < budget:
        grown = []
        for left in last:
            for right in _MERGEABLE:
                if len(vocab) == budget:
                    break
                if (token := left + right) not in vocab:
                    vocab[token] = len(vocab)
                    merges.append((left, right))
                    grown.append(token)
        last = grown
    for tok in SPECIAL_TOKENS:
        vocab[tok] = len(vocab)
    return vocab, merges


def build_byte_bpe_tokenizer(size: int) -> PreTrainedTokenizerFast:
    """A byte-level BPE ``PreTrainedTokenizerFast`` of exactly ``size`` ids (see
    :func:`byte_bpe_vocabulary`)."""
    vocab, merges = byte_bpe_vocabulary(size)
    core = Tokenizer(models.BPE(vocab, merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    return _fast(core)
