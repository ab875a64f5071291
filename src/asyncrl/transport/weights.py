"""``weights/step_N/``: policy N as a standard HF directory (config, safetensors, tokenizer).

Published atomically by the trainer (:func:`asyncrl.transport.gather.export_model`: the filesystem
transport's every version, a streamed transport's files, a checkpoint's model); the sidecar loads it in
place (``/update_weights``) and any HF or vLLM loader can open it as a model. Old steps are pruned, keeping
those that checkpoints refer to. Torch-free at import (the config checks import the transports, which
import this).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any

from asyncrl.paths import list_steps
from asyncrl.utils.atomic import remove_dir


def export_items(model) -> Iterator[tuple[str, Any]]:
    """``(HF name, tensor)`` of what a policy export holds, in ``state_dict`` order (possibly sharded
    DTensors): tied weights once, as ``save_pretrained`` stores them (vLLM re-ties them), and names without
    the activation-checkpointing wrapper's prefix."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    for name, tensor in model.state_dict().items():
        name = name.replace("_checkpoint_wrapped_module.", "")
        if name not in tied:
            yield name, tensor


def prune(parent: Path, keep_last: int, protect: Collection[int] = frozenset()) -> list[int]:
    """Delete ``parent/step_N`` except the newest ``keep_last`` and those in ``protect``."""
    steps = list_steps(parent, require_stable=False)
    doomed = [s for s in steps[:-keep_last] if s not in protect] if keep_last else []
    for s in doomed:
        remove_dir(parent / f"step_{s}")
    return doomed
