"""What the orchestrator needs from a tokenizer (the padding id, the vocabulary), read from its files.

The orchestrator sends text and token ids to the sidecar and never tokenizes, so loading a transformers
tokenizer there would cost it torch and transformers at every start (about 3 s of CPU of a 4 s start-up:
``python -X importtime -c "import asyncrl.orchestrator.orchestrate"``). ``tokenizer.json`` and
``tokenizer_config.json`` answer both questions with the ``tokenizers`` library alone. Where the files leave
room for a tokenizer class's own defaults (no ``tokenizer.json``, no ``pad_token`` key, remote code), the
answer comes from transformers itself, as the trainer and the sidecar load it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from asyncrl.config.model import ModelConfig, check_model_source, is_local_path


def _file(source: str, name: str) -> Path | None:
    """``name`` in the tokenizer's directory, or in the local hub cache for a hub id; None where absent."""
    if is_local_path(source):
        path = Path(source).expanduser() / name
        return path if path.is_file() else None
    from huggingface_hub import try_to_load_from_cache  # lazy: only hub ids need it

    found = try_to_load_from_cache(source, name)
    return Path(found) if isinstance(found, str) else None


def _special(config: dict[str, Any], key: str) -> str | None:
    value = config.get(key)
    return value.get("content") if isinstance(value, dict) else value


def _core(cfg: ModelConfig) -> Tokenizer | None:
    """The tokenizer's ``tokenizers`` object, or None where transformers builds it (remote code, no
    ``tokenizer.json``)."""
    core = _file(cfg.tokenizer or cfg.name, "tokenizer.json")
    return None if cfg.trust_remote_code or core is None else Tokenizer.from_file(str(core))


def _special_tokens(cfg: ModelConfig) -> dict[str, Any] | None:
    """The special-token settings transformers applies, or None where the tokenizer class's own defaults
    may decide (no ``tokenizer_config.json``, or no ``pad_token`` key in it)."""
    source = cfg.tokenizer or cfg.name
    config_file = _file(source, "tokenizer_config.json")
    if config_file is None:
        return None
    config = json.loads(config_file.read_text())
    legacy_map = _file(source, "special_tokens_map.json")
    # transformers merges it over the config
    if "added_tokens_decoder" not in config and legacy_map is not None:
        config |= json.loads(legacy_map.read_text())
    return config if "pad_token" in config else None


def pad_token_id(cfg: ModelConfig) -> int:
    """The id that pads packed rows: the tokenizer's pad token, else its EOS (as ``hf.load_tokenizer``
    sets)."""
    check_model_source(cfg)
    core, config = _core(cfg), _special_tokens(cfg)
    if core is not None and config is not None:
        token = _special(config, "pad_token") or _special(config, "eos_token")
        token_id = core.token_to_id(token) if token else None
        if token_id is not None:
            return token_id
    # lazy: torch and transformers, for what the files leave open
    from asyncrl.models.hf import load_tokenizer

    return int(load_tokenizer(cfg).pad_token_id)


def vocabulary(cfg: ModelConfig) -> dict[str, int]:
    """Every token and its id, added tokens included."""
    check_model_source(cfg)
    core = _core(cfg)
    if core is not None:
        return core.get_vocab(with_added_tokens=True)
    # lazy: torch and transformers, for what the files leave open
    from asyncrl.models.hf import load_tokenizer

    return dict(load_tokenizer(cfg).get_vocab())
