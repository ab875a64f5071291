"""Read W&B's offline run files (``run-<id>.wandb``) back: what a test can check without a W&B server.

The file is a LevelDB-style log (W&B's datastore): a 7-byte header (``:W&B``, magic 0xBEE1, version 0), then
32 KiB blocks of records, each with a 7-byte header (crc32, length, type: full, first, middle, last), whose
payloads are protobuf ``Record`` messages (``wandb.proto.wandb_internal_pb2``). wandb 0.31 no longer ships a
Python reader (its core is in Go), so this is the few lines it takes.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> list[Any]:
    """Every protobuf ``Record`` of one ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1 and version == 0, (ident, magic, version)
    out, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 and length == 0:  # zero padding at the end of the last block
            break
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        pending = chunk if kind in (FULL, FIRST) else pending + chunk
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
    return out


def history(path: Path) -> list[dict[str, Any]]:
    """The history rows (``run.log`` calls) of one ``.wandb`` file, values decoded from JSON."""
    rows = []
    for rec in records(path):
        if rec.WhichOneof("record_type") == "history":
            rows.append(
                {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            )
    return rows


def run_ids(path: Path) -> list[str]:
    return [rec.run.run_id for rec in records(path) if rec.WhichOneof("record_type") == "run"]
