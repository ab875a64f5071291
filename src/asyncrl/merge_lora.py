"""``asyncrl merge-lora ADAPTER OUT [--base MODEL] [--dtype D]``: a LoRA adapter merged into its base with
peft."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from asyncrl.config.model import DTYPES, ModelConfig
from asyncrl.models.adapters import ADAPTER_CONFIG, is_adapter_dir
from asyncrl.models.lora import merge_adapter


def cli(argv: list[str]) -> int:
    """``asyncrl merge-lora ADAPTER OUT [--base MODEL] [--dtype D]``: export base + adapter as one HF
    model."""
    p = argparse.ArgumentParser(
        prog="asyncrl merge-lora",
        description="merge a LoRA adapter (peft layout) into its base: a plain HF model",
    )
    p.add_argument("adapter", help="adapter directory (a run's weights/step_N or <run_dir>/adapter)")
    p.add_argument("out", help="where the merged model goes (written atomically)")
    p.add_argument(
        "--base", help="base model, hub id or directory (default: the adapter's base_model_name_or_path)"
    )
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the merged weights")
    args = p.parse_args(argv)
    adapter = Path(args.adapter)
    if not is_adapter_dir(adapter):
        p.error(f"{adapter} holds no {ADAPTER_CONFIG}: not a LoRA adapter")
    base = args.base or json.loads((adapter / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    if not base:
        p.error(f"{adapter / ADAPTER_CONFIG} names no base model: pass --base")
    out = merge_adapter(ModelConfig(name=base), adapter, args.out, args.dtype)
    print(f"merged {adapter} into {base}: {out}")
    return 0
