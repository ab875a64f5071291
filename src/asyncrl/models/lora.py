"""LoRA (``model.lora``) with peft: adapters on the trainer's model, and base + adapter merged into a plain
model.

The trainer wraps its model with :func:`apply_lora` and trains the adapters only; each published policy is an
adapter (:mod:`asyncrl.models.adapters`). :func:`merge_adapter` writes base + adapter as a plain HF model
(``asyncrl merge-lora``, and the final ``<run_dir>/model``), through peft's own ``merge_and_unload``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from peft import LoraConfig, PeftModel, get_peft_model

from asyncrl.config.model import LoRAConfig, ModelConfig
from asyncrl.models.adapters import ADAPTER_CONFIG, is_adapter_dir
from asyncrl.models.hf import TORCH_DTYPES, load_model, load_tokenizer, publish_weights


def apply_lora(model: Any, cfg: LoRAConfig) -> Any:
    """``model`` wrapped by peft with fresh adapters (B = 0: the policy starts as the base model); only the
    adapters require gradients. Raises ``ValueError`` naming the key when no module matches."""
    peft_cfg = LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, peft_cfg)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model"
        raise ValueError(f"model.lora.target_modules={list(cfg.target_modules)}: {e}") from None


def merge_adapter(
    model_cfg: ModelConfig, adapter_dir: str | Path, out_dir: str | Path, dtype: str | None = None
) -> Path:
    """Write ``model_cfg.name`` + the adapter at ``adapter_dir`` as a plain HF model at ``out_dir`` (atomic),
    with peft's ``merge_and_unload``, in ``dtype`` (default ``model_cfg.dtype``)."""
    if not is_adapter_dir(adapter_dir):
        raise FileNotFoundError(f"{adapter_dir} holds no {ADAPTER_CONFIG}: not a LoRA adapter")
    base = load_model(model_cfg, dtype="float32")
    merged = PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()
    merged = merged.to(TORCH_DTYPES[dtype or model_cfg.dtype])
    publish_weights(merged, load_tokenizer(model_cfg), Path(out_dir))
    return Path(out_dir)
