"""The tokenizers ``asyncrl prepare`` builds offline: the byte-level BPE has exactly the ids asked for, every
one of them decodes, and text survives a round trip; too few ids is a config error naming the key."""

from __future__ import annotations

import json
import random

import pytest

from asyncrl.config.fields import ConfigError
from asyncrl.config.model import ModelConfig, TinyModelConfig
from asyncrl.models.hf import build_tiny_model, load_tokenizer, render_prompt
from asyncrl.models.local_tokenizers import SPECIAL_TOKENS, build_byte_bpe_tokenizer
from helpers.required import qwen3_tokenizer

QWEN3_VOCAB = 151_936


@pytest.mark.parametrize("size", [262, 5_000, QWEN3_VOCAB])
def test_the_byte_bpe_has_exactly_the_ids_asked_for_with_the_role_tokens_last(size):
    tok = build_byte_bpe_tokenizer(size)
    assert len(tok) == size
    assert tok.convert_ids_to_tokens(list(range(size - len(SPECIAL_TOKENS), size))) == SPECIAL_TOKENS
    assert (tok.pad_token, tok.eos_token) == ("<|pad|>", "<|end|>")


def test_every_id_decodes_and_text_round_trips():
    tok = build_byte_bpe_tokenizer(QWEN3_VOCAB)
    rng = random.Random(0)
    regular = QWEN3_VOCAB - len(SPECIAL_TOKENS)
    sampled = [rng.randrange(regular) for _ in range(2_000)] + [0, 255, 256, regular - 1]
    text = tok.decode(sampled)
    again = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(again) == text and max(again) < regular
    assert max(again) > 100_000  # long merged tokens come back as themselves: the ids span the vocabulary
    prose = "Reverse 'hello world', then add 12 + 30.\n\tTabs, unicode: é ü 漢字"
    assert tok.decode(tok(prose, add_special_tokens=False)["input_ids"]) == prose


def test_too_few_ids_for_a_byte_bpe_is_a_config_error_naming_the_key():
    with pytest.raises(
        ConfigError, match=r"model.init.vocab_size=100: model.init.tokenizer=byte_bpe needs at least 262"
    ):
        build_byte_bpe_tokenizer(100)


@pytest.mark.parametrize(
    "tokenizer, vocab_size, ids, eos, ends",
    [
        ("byte_bpe", 3_000, 3_000, 2_995, ["<|user|>", "<|assistant|>"]),
        ("qwen3", QWEN3_VOCAB, 151_669, 151_645, ["<|im_start|>", "Ċ"]),  # "<|im_start|>assistant\n"
    ],
)
def test_a_tiny_model_with_a_bpe_loads_like_a_hub_model(tmp_path, tokenizer, vocab_size, ids, eos, ends):
    if tokenizer == "qwen3":
        qwen3_tokenizer()  # written by make install; a skip where it is not (a failure under CI)
    init = TinyModelConfig(
        build=True, tokenizer=tokenizer, vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    out = build_tiny_model(init, tmp_path / "model", seed=0)
    tok = load_tokenizer(ModelConfig(name=str(out)))
    assert len(tok) == ids and tok.eos_token_id == eos
    prompt = render_prompt(tok, [{"role": "user", "content": "hi"}])
    assert tok.convert_ids_to_tokens([prompt[0], prompt[-1]]) == ends
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == vocab_size and config["eos_token_id"] == eos
