"""``trainer.profile_step``: one step of the trainer under torch's profiler, on every rank.

Writes ``<run_dir>/profile/step_<n>_rank<r>_ops.txt`` (op tables by device time and by CPU time), the Chrome
trace ``step_<n>_rank<r>_trace.json.gz`` (open it in Perfetto) and ``step_<n>_rank<r>.json``: the step's GPU
time split into computation and collectives, and how much of the collectives' time no computation hides.
FSDP2 gathers the next layer's parameters and reduces the last one's gradients on streams of their own so
they overlap the layers' kernels; ``exposed_comm_s`` is the time those transfers leave the GPU doing nothing
else, the number that says whether prefetch and overlap work at a given layout.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

log = logging.getLogger("asyncrl.trainer")

# NCCL's kernels are the collectives (FSDP2's all-gathers and reduce-scatters on streams of their own, the
# gradient norm's all-reduce on the compute stream); every other kernel, copy or memset is computation,
# FSDP2's copies into and out of its communication buffers included
_GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_COLLECTIVE_KERNELS = ("ncclDevKernel", "ncclKernel")  # the names of current and of older NCCL releases


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _minus(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the union ``a`` outside the union ``b`` (both sorted, disjoint)."""
    out, j = 0.0, 0
    for start, end in a:
        cur = start
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            if b[k][0] > cur:
                out += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        out += max(0.0, end - cur)
    return out


def overlap_summary(trace: dict) -> dict[str, float]:
    """From a Chrome trace of torch's profiler: seconds of GPU work (kernels, copies and memsets, their union
    over all streams), of computation, of collectives, and of collectives with no computation running beside
    them; the span from the first to the last GPU event."""
    gpu = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in _GPU_CATS]
    comp: list[tuple[float, float]] = []
    comm: list[tuple[float, float]] = []
    for e in gpu:
        span = (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        (comm if str(e.get("name", "")).startswith(_COLLECTIVE_KERNELS) else comp).append(span)
    comp, comm = _union(comp), _union(comm)
    busy = _union(comp + comm)
    return {
        "gpu_span_s": (busy[-1][1] - busy[0][0]) / 1e6 if busy else 0.0,
        "gpu_busy_s": _length(busy) / 1e6,
        "compute_s": _length(comp) / 1e6,
        "comm_s": _length(comm) / 1e6,
        "exposed_comm_s": _minus(comm, comp) / 1e6,
    }


@contextlib.contextmanager
def profiled(out_dir: Path, step: int, rank: int, cuda: bool) -> Iterator[None]:
    """Profile the enclosed step; on leaving, write its tables, trace and overlap summary under
    ``out_dir``."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = out_dir / f"step_{step}_rank{rank}"
    events = prof.key_averages()
    by_device = events.table(
        sort_by="self_device_time_total" if cuda else "self_cpu_time_total", row_limit=40
    )
    Path(f"{tag}_ops.txt").write_text(
        by_device + "\n\n" + events.table(sort_by="cpu_time_total", row_limit=40)
    )
    raw = Path(f"{tag}_trace.json.tmp")
    prof.export_chrome_trace(str(raw))
    trace = json.loads(raw.read_text())
    with gzip.open(f"{tag}_trace.json.gz.tmp", "wt") as f:
        json.dump(trace, f)
    os.replace(f"{tag}_trace.json.gz.tmp", f"{tag}_trace.json.gz")
    raw.unlink()
    summary = {"step": step, "rank": rank, **overlap_summary(trace)}
    Path(f"{tag}.json").write_text(json.dumps(summary, indent=1) + "\n")
    log.info(f"profiled step {step} (rank {rank}): {summary}")


def maybe_profiled(profile_step: int | None, step: int, out_dir: Path, rank: int, cuda: bool):
    """:func:`profiled` for the step ``trainer.profile_step`` names, a no-op context for every other."""
    return profiled(out_dir, step, rank, cuda) if profile_step == step else contextlib.nullcontext()
