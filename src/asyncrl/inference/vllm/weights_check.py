"""What a weights update holds, read before any served parameter changes (torch-free: the sidecar's HTTP
side).

An update is all or nothing: the sidecar first lists what it would load as ``(name, dtype, shape)`` entries
(the safetensors headers of a weights directory, or the manifest of a GPU-to-GPU transfer), refuses what
cannot be read, then checks the entries against the served model (:func:`signature_problems` here against the
files the sidecar started from; vLLM's workers then load them on the meta device,
``asyncrl.inference.vllm.worker``). Only an update that passes every check reaches the parameters.

The header checks are the ones the safetensors format itself defines (an 8-byte header length, a JSON header,
each tensor's byte range inside the file and as long as its dtype and shape say), made without reading the
data: a truncated or overwritten file is refused here, before a loader fails on it half-way through a model.
"""

from __future__ import annotations

import json
import math
import struct
from collections import Counter
from pathlib import Path
from typing import Any

Entry = tuple[str, str, list[int]]  # (name, dtype as torch names it, shape): the manifests' columns

# safetensors' dtype codes: (torch's name, bytes per element)
DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
FLOATING = {"float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"}
MAX_HEADER = 100 << 20  # the safetensors library's own bound on a header


def header_entries(path: Path) -> list[Entry]:
    """The tensors one safetensors file holds, checked against its size; ``ValueError`` naming the file and
    what is wrong when it is not a whole safetensors file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path.name}: {size} bytes, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > min(MAX_HEADER, size - 8):
            raise ValueError(f"{path.name}: its header claims {n} bytes, the file has {size}")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise ValueError(f"{path.name}: the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path.name}: the header is not a JSON object")
    header.pop("__metadata__", None)
    entries, end = [], 0
    for name, info in header.items():
        entries.append(_entry(path.name, name, info))
        dtype, shape = info["dtype"], info["shape"]
        begin, stop = info["data_offsets"]
        if stop - begin != math.prod(shape) * DTYPES[dtype][1] or begin < 0:
            raise ValueError(
                f"{path.name}: {name} spans bytes {begin}..{stop}, its dtype and shape need another span"
            )
        end = max(end, stop)
    if 8 + n + end != size:
        raise ValueError(
            f"{path.name}: the tensors end at byte {8 + n + end}, the file has {size} (truncated?)"
        )
    return entries


def _entry(file: str, name: str, info: Any) -> Entry:
    """One header record as an entry; ``ValueError`` when its fields are not what the format defines."""
    ok = (
        isinstance(info, dict)
        and info.get("dtype") in DTYPES
        and isinstance(info.get("shape"), list)
        and all(isinstance(d, int) and d >= 0 for d in info["shape"])
        and isinstance(info.get("data_offsets"), list)
        and len(info["data_offsets"]) == 2
        and all(isinstance(d, int) for d in info["data_offsets"])
    )
    if not ok:
        raise ValueError(f"{file}: the header's record of {name!r} is not dtype, shape and data_offsets")
    return name, DTYPES[info["dtype"]][0], list(info["shape"])


def directory_entries(path: Path) -> list[Entry]:
    """Every tensor of the ``*.safetensors`` files in ``path``; ``ValueError`` on an unreadable file or a
    name held twice."""
    entries: list[Entry] = []
    for f in sorted(path.glob("*.safetensors")):
        entries += header_entries(f)
    return _unique(entries)


def manifest_entries(manifest: dict[str, Any]) -> list[Entry]:
    """The entries of a GPU-to-GPU transfer's manifest (``names``, ``dtype_names``, ``shapes``)."""
    names, dtypes, shapes = (manifest.get(k) for k in ("names", "dtype_names", "shapes"))
    if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)) or not (
        len(names) == len(dtypes) == len(shapes)
    ):
        raise ValueError("the manifest's names, dtype_names and shapes are not lists of one length")
    known = {torch_name for torch_name, _ in DTYPES.values()}
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        if (
            dtype not in known
            or not isinstance(shape, list)
            or not all(isinstance(d, int) and d >= 0 for d in shape)
        ):
            raise ValueError(f"the manifest's record of {name!r}: dtype {dtype!r}, shape {shape!r}")
    return _unique([(n, d, list(s)) for n, d, s in zip(names, dtypes, shapes, strict=True)])


def _unique(entries: list[Entry]) -> list[Entry]:
    if twice := [name for name, n in Counter(name for name, _, _ in entries).items() if n > 1]:
        raise ValueError(f"tensors held twice: {twice[:5]}")
    return entries


def reference_entries(model_dir: str | Path) -> dict[str, Entry] | None:
    """The entries of the model the sidecar started from, by name, less a tied output layer (loaders re-tie
    it from the embeddings, so an update need not hold it); ``None`` when it is not a local directory of
    safetensors (a hub id: the workers' checks alone then apply)."""
    path = Path(model_dir)
    if not path.is_dir() or not any(path.glob("*.safetensors")):
        return None
    entries = {e[0]: e for e in directory_entries(path)}
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if config.get("tie_word_embeddings", (config.get("text_config") or {}).get("tie_word_embeddings")):
        entries.pop("lm_head.weight", None)
    return entries


def signature_problems(entries: list[Entry], reference: dict[str, Entry] | None) -> list[str]:
    """What in ``entries`` cannot be the served model's: a tensor whose shape differs from the starting
    model's tensor of that name, a floating-point tensor given as integers (or the reverse), and, when every
    name is one of the starting model's (the same layout), a tensor of it left out. Other names are left to
    the workers' check (a mixture of experts' hand-off may fuse its experts' tensors)."""
    problems = []
    if reference is not None and {e[0] for e in entries} <= reference.keys():
        if missing := sorted(reference.keys() - {e[0] for e in entries}):
            problems.append(
                f"{len(missing)} tensors of the served model are not in the update (first: {missing[:5]})"
            )
    for name, dtype, shape in entries:
        if reference is None or name not in reference:
            continue
        _, ref_dtype, ref_shape = reference[name]
        if shape != ref_shape:
            problems.append(f"{name} has shape {shape}, the served model's is {ref_shape}")
        elif (dtype in FLOATING) != (ref_dtype in FLOATING):
            problems.append(f"{name} is {dtype}, the served model's is {ref_dtype}")
    return problems
