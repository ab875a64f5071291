"""On the lent GPU: the GPU shapes with a real vocabulary's size (``model.init.tokenizer=byte_bpe``, Qwen3's
151,936 ids) serve through vLLM like a hub model: sampled ids reach the top of the vocabulary, each decodes
to the text vLLM returns, and every logprob is finite."""

from __future__ import annotations

import math

import httpx
import pytest
from transformers import AutoTokenizer

from asyncrl.utils.children import stop
from gpu.test_gpu import start_vllm
from helpers.launch import asyncrl

pytestmark = pytest.mark.gpu

QWEN3_VOCAB = 151_936


def test_vllm_samples_the_whole_real_vocabulary(tmp_path):
    model = tmp_path / "model"
    real = ["model=gpu_small", "model.init.tokenizer=byte_bpe", f"model.init.vocab_size={QWEN3_VOCAB}"]
    asyncrl(
        "prepare", f"data_dir={tmp_path / 'data'}", *real, f"model.name={model}", check=True, timeout=300
    )
    tok = AutoTokenizer.from_pretrained(model)
    assert len(tok) == QWEN3_VOCAB
    proc, url = start_vllm(model, tmp_path / "vllm.log", "model.init.tokenizer=byte_bpe")
    try:
        body = {
            "model": str(model),
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 64,
            "n": 16,
            "temperature": 1.0,
            "logprobs": True,
            "return_token_ids": True,
        }
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
    finally:
        stop([proc], timeout_s=30)
    ids = [i for c in choices for i in c["token_ids"]]
    # a random-init model samples near-uniformly: 1,024 draws from 151,936 ids land far above a char
    # vocabulary
    assert len(ids) > 500 and max(ids) > 100_000, (len(ids), max(ids))
    for c in choices:
        end = [i for i in c["token_ids"] if i != tok.eos_token_id]
        assert c["message"]["content"] == tok.decode(end, skip_special_tokens=True)
        assert all(math.isfinite(x["logprob"]) for x in c["logprobs"]["content"])
    print(f"RESULT real_vocabulary ids={len(ids)} max_id={max(ids)}")
