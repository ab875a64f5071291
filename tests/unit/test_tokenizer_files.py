"""The orchestrator's torch-free reads of a tokenizer's files agree with the transformers tokenizer that the
trainer and the sidecar load, for each way a tokenizer's files name its special tokens."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config.model import ModelConfig
from asyncrl.models.hf import load_tokenizer
from asyncrl.models.tokenizer_files import pad_token_id, vocabulary


def edited(micro_model: Path, tmp_path: Path, config: dict, special_map: dict | None = None) -> ModelConfig:
    """A copy of the micro model whose ``tokenizer_config.json`` is ``config`` (plus a legacy
    ``special_tokens_map.json``)."""
    model = tmp_path / "model"
    shutil.copytree(micro_model, model)
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (model / "special_tokens_map.json").write_text(json.dumps(special_map))
    return ModelConfig(name=str(model))


BASE = {"backend": "tokenizers", "tokenizer_class": "TokenizersBackend", "unk_token": "<|unk|>"}
CASES = {
    "a pad token": {**BASE, "eos_token": "<|end|>", "pad_token": "<|pad|>"},
    "no pad token: EOS pads": {**BASE, "eos_token": "<|end|>", "pad_token": None},
    "another pad token": {**BASE, "eos_token": "<|end|>", "pad_token": "<|assistant|>"},
    "no pad_token key: the class decides": {**BASE, "eos_token": "<|end|>"},
}


@pytest.mark.parametrize("case", CASES)
def test_the_padding_id_and_vocabulary_are_the_transformers_tokenizers(micro_model, tmp_path, case):
    cfg = edited(micro_model, tmp_path, CASES[case])
    tokenizer = load_tokenizer(cfg)
    assert pad_token_id(cfg) == tokenizer.pad_token_id
    assert vocabulary(cfg) == tokenizer.get_vocab()


def test_a_legacy_special_tokens_map_overrides_the_config_as_transformers_does(micro_model, tmp_path):
    cfg = edited(
        micro_model,
        tmp_path,
        {**BASE, "eos_token": "<|end|>", "pad_token": "<|pad|>"},
        special_map={"pad_token": {"content": "<|system|>", "lstrip": False, "rstrip": False}},
    )
    assert pad_token_id(cfg) == load_tokenizer(cfg).pad_token_id != 0  # not <|pad|>, id 0


def test_reading_the_files_loads_neither_torch_nor_transformers(micro_model):
    code = (
        "import sys; from asyncrl.config.model import ModelConfig; "
        "from asyncrl.models.tokenizer_files import pad_token_id, vocabulary; "
        f"cfg = ModelConfig(name={str(micro_model)!r}); pad_token_id(cfg); vocabulary(cfg); "
        "print(sorted({'torch', 'transformers'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
