"""Packing samples into training micro-batches (pure functions, numpy only).

Samples are placed first-fit-decreasing into rows of ``seq_len`` tokens. Each row restarts
``position_ids`` at 0 for every sample: transformers then builds a block-diagonal causal mask from the
position resets, so no token attends across samples. Arrays are aligned to input positions: entry ``i``
describes token ``input_ids[i]`` (its inference logprob, advantage, sampling temperature, and whether
it is a trained completion token). The trainer shifts them by one to line up with next-token logits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

MICRO_BATCH_KEYS = ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs", "temperatures")


@dataclass
class Sample:
    """One completion, in token ids, with what the trainer needs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    advantage: float
    temperature: float = 1.0
    meta: dict = field(default_factory=dict)  # env, reward, policy version... (not packed)

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)


def truncate(sample: Sample, seq_len: int) -> Sample | None:
    """Cut the completion so the sample fits one row; ``None`` if even the prompt plus one token does not."""
    room = seq_len - len(sample.prompt_ids)
    if room < 1:
        return None
    if len(sample.completion_ids) <= room:
        return sample
    return Sample(sample.prompt_ids, sample.completion_ids[:room], sample.completion_logprobs[:room],
                  sample.advantage, sample.temperature, {**sample.meta, "truncated": True})


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of indices whose lengths sum to <= ``capacity``; longest items are placed first."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > capacity:
            raise ValueError(f"item {i} of length {lengths[i]} exceeds capacity {capacity}")
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(capacity - lengths[i])
    return bins


def build_row(samples: Sequence[Sample], seq_len: int, pad_id: int, pad_multiple: int = 1) -> dict[str, np.ndarray]:
    """One packed row holding ``samples``, padded (``loss_mask`` False) up to a multiple of ``pad_multiple``
    tokens, at most ``seq_len``: a half-empty last row costs half the compute, not a full row's."""
    used = sum(len(s) for s in samples)
    seq_len = min(seq_len, max(-(-used // pad_multiple) * pad_multiple, pad_multiple))
    row = {
        "input_ids": np.full(seq_len, pad_id, dtype=np.int64),
        "position_ids": np.zeros(seq_len, dtype=np.int64),
        "loss_mask": np.zeros(seq_len, dtype=bool),
        "advantages": np.zeros(seq_len, dtype=np.float32),
        "inference_logprobs": np.zeros(seq_len, dtype=np.float32),
        "temperatures": np.ones(seq_len, dtype=np.float32),
    }
    at = 0
    for s in samples:
        n_p, n = len(s.prompt_ids), len(s)
        row["input_ids"][at:at + n] = s.prompt_ids + s.completion_ids
        row["position_ids"][at:at + n] = np.arange(n)
        row["loss_mask"][at + n_p:at + n] = True
        row["advantages"][at:at + n] = s.advantage
        row["inference_logprobs"][at + n_p:at + n] = s.completion_logprobs
        row["temperatures"][at:at + n] = s.temperature
        at += n
    row["position_ids"][at:] = np.arange(seq_len - at)  # padding forms its own (masked) sequence
    return row


def pack_samples(samples: Sequence[Sample], seq_len: int, pad_id: int, multiple_of: int = 1,
                 pad_multiple: int = 64) -> list[dict[str, np.ndarray]]:
    """Micro-batches (each one packed row ``[1, <= seq_len]``), padded with empty rows to a multiple of
    ``multiple_of`` so every data-parallel rank gets the same number of micro-batches."""
    bins = first_fit_decreasing([len(s) for s in samples], seq_len)
    rows = [build_row([samples[i] for i in b], seq_len, pad_id, pad_multiple) for b in bins]
    while len(rows) % multiple_of:
        rows.append(build_row([], seq_len, pad_id, pad_multiple))
    return [{k: v[None] for k, v in r.items()} for r in rows]
