"""LoRA adapters as files and names, without peft: what the sidecars and the weight hand-off need.

A published LoRA policy (``weights/step_N``) is an adapter in peft's layout: :data:`ADAPTER_CONFIG` and
:data:`ADAPTER_WEIGHTS`, a few MB instead of the whole model. vLLM loads it as a LoRA adapter in place
(:mod:`asyncrl.inference.vllm.backend`, up to :func:`vllm_max_rank`); the built-in sidecar merges it into its
base weights on load (:class:`AdapterMerger`). The trainer's side, which needs peft:
:mod:`asyncrl.models.lora`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# vLLM's --max-lora-rank takes one of these (vllm/config/lora.py, MaxLoRARanks)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def unwrap(model: Any) -> Any:
    """The transformers model under a peft wrapper (the model itself otherwise)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def is_lora_model(model: Any) -> bool:
    """Whether ``model`` (bare, or under a Fabric/FSDP wrapper's ``.module``) carries peft adapters."""
    return hasattr(getattr(model, "module", model), "peft_config")


def is_adapter_name(name: str) -> bool:
    """Whether a state-dict name is a LoRA adapter tensor (what a hand-off and a LoRA checkpoint hold)."""
    return ".lora_A." in name or ".lora_B." in name


def is_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def vllm_max_rank(r: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM accepts that holds rank ``r``."""
    for rank in VLLM_RANKS:
        if rank >= r:
            return rank
    raise ValueError(f"model.lora.r={r} is above vLLM's largest LoRA rank {VLLM_RANKS[-1]}")


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``W0 + scale * B @ A`` (pure), computed in fp32 and returned in ``base``'s dtype: what a peft LoRA
    layer (``fan_in_fan_out=False``, no dropout) computes, folded into one weight."""
    delta = b.float() @ a.float()
    return (base.float() + scale * delta).to(base.dtype)


def adapter_scale(adapter_cfg: dict[str, Any]) -> float:
    """peft's scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    r, alpha = adapter_cfg["r"], adapter_cfg["lora_alpha"]
    return alpha / math.sqrt(r) if adapter_cfg.get("use_rslora") else alpha / r


class AdapterMerger:
    """Merge-on-load for the built-in sidecar: keeps the base weight of each adapted layer (captured at the
    first adapter load) and sets ``W = W0 + scale * B @ A`` for a new adapter, so adapters never
    accumulate."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}  # HF weight name -> W0

    def forget(self) -> None:
        """Full weights were loaded: they are the new base."""
        self.base = {}

    def merged_state(self, model: torch.nn.Module, path: Path) -> dict[str, torch.Tensor]:
        """The weights of ``model`` that the adapter at ``path`` changes, merged. Raises ``ValueError``
        naming what does not fit (the server answers 400); reads everything before anything changes."""
        try:
            cfg = json.loads((path / ADAPTER_CONFIG).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path / ADAPTER_CONFIG} is not readable JSON ({e})") from None
        if (
            cfg.get("peft_type", "LORA") != "LORA"
            or not isinstance(cfg.get("r"), int)
            or "lora_alpha" not in cfg
        ):
            raise ValueError(
                f"{path / ADAPTER_CONFIG} is not a LoRA adapter config (peft_type, r, lora_alpha)"
            )
        unsupported = [
            k for k in ("fan_in_fan_out", "use_dora", "rank_pattern", "alpha_pattern") if cfg.get(k)
        ]
        if unsupported:  # each changes the merge formula; asyncrl's trainer writes none of them
            raise ValueError(f"{path / ADAPTER_CONFIG}: {unsupported} are not supported by merge-on-load")
        try:
            tensors = load_file(path / ADAPTER_WEIGHTS, device="cpu")
        except (OSError, SafetensorError) as e:
            raise ValueError(f"{path / ADAPTER_WEIGHTS} is not a readable safetensors file ({e})") from None
        own, scale = model.state_dict(), adapter_scale(cfg)
        pairs: dict[str, dict[str, torch.Tensor]] = {}
        problems = []
        for key, t in tensors.items():
            # peft layout: base_model.model.<module>.lora_A.weight
            module, sep, rest = key.removeprefix("base_model.model.").rpartition(".lora_")
            if not sep or rest not in ("A.weight", "B.weight"):
                problems.append(f"unexpected tensor {key}")
                continue
            pairs.setdefault(f"{module}.weight", {})[rest[0]] = t
        out = {}
        for name, ab in pairs.items():
            if name not in own or set(ab) != {"A", "B"}:
                problems.append(
                    f"{name}: "
                    f"{'no such weight in the model' if name not in own else 'needs lora_A and lora_B'}"
                )
                continue
            w0 = self.base.get(name, own[name])
            a, b = ab["A"], ab["B"]
            if (
                a.ndim != 2
                or b.ndim != 2
                or (b.shape[0], a.shape[1]) != tuple(w0.shape)
                or a.shape[0] != b.shape[1]
            ):
                problems.append(
                    f"{name}: A {tuple(a.shape)} B {tuple(b.shape)} do not fit {tuple(w0.shape)}"
                )
                continue
            out[name] = merged_weight(w0, a.to(w0.device), b.to(w0.device), scale)
        if problems or not out:
            raise ValueError(
                f"adapter at {path} does not fit the model: {(problems or ['no LoRA tensors'])[:5]}"
            )
        for name in out:  # keep W0 of every layer this adapter touches, before it is overwritten
            self.base.setdefault(name, own[name].detach().clone())
        return out
