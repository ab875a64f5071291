"""Policies and tokenizers: load any HF model id or directory, or build the embedded tiny default offline.

``build_tiny_model`` makes a real transformers architecture (Qwen3 by default) with random weights and a
tokenizer built offline that has a chat template (:mod:`asyncrl.models.local_tokenizers`), and saves both as
a standard HF directory, so every other code path (trainer, sidecar, eval, vLLM later) loads it exactly like
a hub model.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.config.model import ModelConfig, TinyModelConfig, check_model_source
from asyncrl.models import attention
from asyncrl.models.fa4 import check_installed
from asyncrl.models.local_tokenizers import build_byte_bpe_tokenizer, build_char_tokenizer
from asyncrl.models.qwen_tokenizer import load_qwen3_tokenizer
from asyncrl.models.tool_calls import render_chat
from asyncrl.utils.atomic import atomic_dir

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def build_tiny_model(init: TinyModelConfig, out_dir: str | Path, seed: int) -> Path:
    """Randomly initialise ``init.architecture`` with the tokenizer ``init.tokenizer`` names; save both to
    ``out_dir`` (HF layout)."""
    if init.tokenizer == "byte_bpe":
        tokenizer = build_byte_bpe_tokenizer(init.vocab_size)
    elif init.tokenizer == "qwen3":
        tokenizer = load_qwen3_tokenizer()
    else:
        tokenizer = build_char_tokenizer(init.charset)
    config_cls = getattr(transformers, init.architecture.replace("ForCausalLM", "Config"))
    moe = (
        {
            "num_experts": init.num_experts,
            "num_experts_per_tok": init.num_experts_per_tok,
            "moe_intermediate_size": init.moe_intermediate_size,
            "norm_topk_prob": init.norm_topk_prob,
        }
        if init.is_moe
        else {}
    )
    config = config_cls(
        vocab_size=max(len(tokenizer), init.vocab_size),
        hidden_size=init.hidden_size,
        intermediate_size=init.intermediate_size,
        num_hidden_layers=init.num_hidden_layers,
        num_attention_heads=init.num_attention_heads,
        num_key_value_heads=init.num_key_value_heads,
        head_dim=init.head_dim,
        max_position_embeddings=init.max_position_embeddings,
        tie_word_embeddings=init.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **moe,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, init.architecture)(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def load_tokenizer(cfg: ModelConfig):
    check_model_source(cfg)
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer or cfg.name, trust_remote_code=cfg.trust_remote_code)
    if tok.pad_token_id is None:  # many chat models ship without one; padding is always masked anyway
        tok.pad_token = tok.eos_token
    return tok


def load_model(
    cfg: ModelConfig,
    device: str | torch.device = "cpu",
    weights_dir: str | Path | None = None,
    dtype: str | None = None,
    runs_on: str | torch.device | None = None,
    training: bool = True,
    context_parallel: int = 1,
):
    """Load the policy from ``cfg.name`` (hub id or directory), optionally with weights from ``weights_dir``,
    in ``dtype`` (default ``cfg.dtype``). ``runs_on`` (default ``device``), ``training`` and
    ``context_parallel`` say where and how the model will run, for ``attn_implementation=auto``
    (:func:`attention.resolve`)."""
    if weights_dir is None:
        check_model_source(cfg)
    attn = attention.resolve(cfg.attn_implementation, runs_on or device, training, context_parallel)
    if attn != cfg.attn_implementation:
        log.info("model.attn_implementation=%s: %s here", cfg.attn_implementation, attn)
    if attn in (attention.NAME, attention.FA4):
        attention.register()
        if attn == attention.FA4:
            check_installed()
    model = AutoModelForCausalLM.from_pretrained(
        weights_dir or cfg.name,
        dtype=TORCH_DTYPES[dtype or cfg.dtype],
        attn_implementation=attn,
        trust_remote_code=cfg.trust_remote_code,
    )
    return model.to(device)


def eos_token_ids(tokenizer, model_config: Any = None) -> list[int]:
    """Every token that ends a completion: the tokenizer's EOS plus the model's generation EOS ids."""
    ids = {tokenizer.eos_token_id}
    extra = getattr(getattr(model_config, "generation_config", None), "eos_token_id", None)
    if extra is not None:
        ids.update(extra if isinstance(extra, list) else [extra])
    return sorted(i for i in ids if i is not None)


def render_prompt(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a chat prompt ending where the assistant's reply starts."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def render_conversation(
    tokenizer,
    prompt: list[dict],
    continuation: list[dict],
    end_ids: list[int] | None = None,
    tools: list[dict] | None = None,
) -> tuple[list[int], list[int], list[bool]]:
    """``(prompt_ids, completion_ids, completion_mask)`` of a supervised (possibly multi-turn) example: the
    ``prompt`` messages, then ``continuation``, whose assistant messages are the model's turns.

    The mask marks exactly what the sampler would produce at inference: each assistant message's tokens after
    the template's generation prompt, up to and including its first end token (``end_ids``, default the
    tokenizer's EOS: generation stops there, so a separator the template writes after it, ChatML's newline,
    is context). Everything else (the generation prompts, the user or tool messages between turns) is
    context, as in an RL trace of the same episode; context after the last reply is dropped. The template
    must render each turn as a prefix of the next (``ValueError`` otherwise). ``renderers``'
    ``build_training_sample`` with its template-based ``DefaultRenderer`` would also train the assistant
    opener, which the model never samples. ``tools`` and assistant ``tool_calls`` render as the built-in
    sidecar renders them for an agent (:func:`asyncrl.models.tool_calls.render_chat`).
    """
    if not continuation or continuation[0]["role"] != "assistant" or continuation[-1]["role"] != "assistant":
        raise ValueError("a demonstration starts and ends with an assistant message (the model's turns)")

    def rendered(messages: list[dict], generation_prompt: bool) -> list[int]:
        text = render_chat(tokenizer, messages, tools, generation_prompt)
        return tokenizer(text, add_special_tokens=False).input_ids

    ends = set(end_ids if end_ids is not None else [tokenizer.eos_token_id])
    prompt_ids = rendered(prompt, True)
    ids, mask, conversation = list(prompt_ids), [], list(prompt)
    for k, message in enumerate(continuation):
        conversation.append(message)
        model_turn = message["role"] == "assistant"
        if not model_turn and continuation[k + 1]["role"] != "assistant":
            # several context messages in a row: rendered together, up to the next generation prompt
            continue
        target = rendered(conversation, not model_turn)
        if target[: len(ids)] != ids:
            raise ValueError(
                "the chat template does not render each turn as a prefix of the next; supervised (and "
                "multi-turn) training needs prefix-preserving templates"
            )
        turn = target[len(ids) :]
        if model_turn:
            stop = next((i + 1 for i, t in enumerate(turn) if t in ends), len(turn))
            mask += [True] * stop + [False] * (len(turn) - stop)
        else:
            mask += [False] * len(turn)
        ids = target
    while mask and not mask[-1]:  # nothing after the last reply is trained or needed
        mask.pop()
    return prompt_ids, ids[len(prompt_ids) : len(prompt_ids) + len(mask)], mask


def publish_weights(model, tokenizer, path: Path, state_dict: dict | None = None) -> None:
    """Write ``model`` (or the given full ``state_dict``) and ``tokenizer`` to ``path`` atomically."""
    with atomic_dir(path) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
