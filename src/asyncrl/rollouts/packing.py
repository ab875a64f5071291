"""Packing samples into training micro-batches (pure functions, numpy only).

Samples are placed first-fit-decreasing into rows of ``seq_len`` tokens; ``rows_per_micro_batch`` rows are
stacked into one ``[rows, length]`` micro-batch (one forward pass). Each row restarts ``position_ids`` at 0
for every sample: transformers then builds a block-diagonal causal mask from the position resets, so no token
attends across samples. Arrays are aligned to input positions: entry ``i`` describes token ``input_ids[i]``
(its inference logprob, advantage, sampling temperature, and whether it is a trained completion token; under
top-k / top-p / min-p sampling, its ``top_ks``, ``top_ps``, ``min_ps`` too). The trainer shifts them by one
to line up with next-token logits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np

MICRO_BATCH_KEYS = (
    "input_ids",
    "position_ids",
    "loss_mask",
    "advantages",
    "inference_logprobs",
    "temperatures",
)
# each token's truncation of the distribution it was sampled from, packed when a sample has one (neutral: 0,
# 1, 0); asyncrl.models.truncation.KEYS reads them
TRUNCATION_KEYS = ("top_ks", "top_ps", "min_ps")


@dataclass
class Sample:
    """One completion, in token ids, with what the trainer needs.

    ``completion_mask`` marks the completion tokens the policy sampled (trained on); ``False`` marks tokens
    an environment or a tool wrote between a multi-turn episode's model turns: context, never trained on
    (their logprobs are ignored). ``None``: every completion token was sampled.
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    completion_logprobs: list[float]
    advantage: float
    temperature: float = 1.0
    meta: dict = field(default_factory=dict)  # env, reward, policy version... (not packed)
    completion_mask: list[bool] | None = None
    # online distillation (packed as teacher_logprobs when any has them)
    teacher_logprobs: list[float] | None = None
    # the truncation the completion was sampled under, for the trainer to score under (neutral: off)
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    # a mixture of experts: each token's experts at the sampler, int16 [<= len(self), MoE layers, top_k]
    # (packed as routed_experts when any has them; -1 where none is known)
    routed_experts: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.completion_ids)
        if (
            len(self.completion_logprobs) != n
            or (self.completion_mask is not None and len(self.completion_mask) != n)
            or (self.teacher_logprobs is not None and len(self.teacher_logprobs) != n)
        ):
            raise ValueError(
                f"a sample's completion has {n} tokens but {len(self.completion_logprobs)} logprobs"
                + ("" if self.completion_mask is None else f" and {len(self.completion_mask)} mask entries")
            )
        if self.routed_experts is not None and len(self.routed_experts) > len(self):
            raise ValueError(
                f"a sample of {len(self)} tokens has routes of {len(self.routed_experts)} tokens"
            )

    def __len__(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def truncated(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0

    def trained(self) -> list[bool]:
        return (
            [True] * len(self.completion_ids) if self.completion_mask is None else list(self.completion_mask)
        )


def truncate(sample: Sample, seq_len: int) -> Sample | None:
    """Cut the completion so the sample fits one row; ``None`` if even the prompt plus one token does not."""
    room = seq_len - len(sample.prompt_ids)
    if room < 1:
        return None
    if len(sample.completion_ids) <= room:
        return sample
    return replace(
        sample,
        completion_ids=sample.completion_ids[:room],
        completion_logprobs=sample.completion_logprobs[:room],
        meta={**sample.meta, "truncated": True},
        completion_mask=None if sample.completion_mask is None else sample.completion_mask[:room],
        teacher_logprobs=None if sample.teacher_logprobs is None else sample.teacher_logprobs[:room],
        routed_experts=None if sample.routed_experts is None else sample.routed_experts[:seq_len],
    )


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


def build_row(
    samples: Sequence[Sample],
    length: int,
    pad_id: int,
    teacher: bool = False,
    truncation: bool = False,
    routes: tuple[int, ...] = (),
) -> dict[str, np.ndarray]:
    """One packed row of exactly ``length`` tokens holding ``samples``; the tail is padding (``loss_mask``
    False). ``teacher``: with a ``teacher_logprobs`` array too (online distillation; 0 where a sample has
    none). ``truncation``: with the :data:`TRUNCATION_KEYS` arrays too (neutral where a sample has none).
    ``routes`` (``(MoE layers, top_k)``): with a ``routed_experts`` array ``[length, layers, top_k]`` too (-1
    where unknown)."""
    row = {
        "input_ids": np.full(length, pad_id, dtype=np.int64),
        "position_ids": np.zeros(length, dtype=np.int64),
        "loss_mask": np.zeros(length, dtype=bool),
        "advantages": np.zeros(length, dtype=np.float32),
        "inference_logprobs": np.zeros(length, dtype=np.float32),
        "temperatures": np.ones(length, dtype=np.float32),
    }
    if teacher:
        row["teacher_logprobs"] = np.zeros(length, dtype=np.float32)
    if truncation:
        row["top_ks"] = np.zeros(length, dtype=np.int64)
        row["top_ps"] = np.ones(length, dtype=np.float32)
        row["min_ps"] = np.zeros(length, dtype=np.float32)
    if routes:
        row["routed_experts"] = np.full((length, *routes), -1, dtype=np.int16)
    at = 0
    for s in samples:
        n_p, n = len(s.prompt_ids), len(s)
        row["input_ids"][at : at + n] = s.prompt_ids + s.completion_ids
        row["position_ids"][at : at + n] = np.arange(n)
        row["loss_mask"][at + n_p : at + n] = s.trained()
        row["advantages"][at : at + n] = s.advantage
        row["inference_logprobs"][at + n_p : at + n] = s.completion_logprobs
        row["temperatures"][at : at + n] = s.temperature
        if teacher and s.teacher_logprobs is not None:
            row["teacher_logprobs"][at + n_p : at + n] = s.teacher_logprobs
        if truncation:
            for key, value in zip(TRUNCATION_KEYS, (s.top_k, s.top_p, s.min_p), strict=True):
                row[key][at : at + n] = value
        if routes and s.routed_experts is not None:
            row["routed_experts"][at : at + len(s.routed_experts)] = s.routed_experts
        at += n
    row["position_ids"][at:] = np.arange(length - at)  # padding forms its own (masked) sequence
    return row


def pack_samples(
    samples: Sequence[Sample],
    seq_len: int,
    pad_id: int,
    rows_per_micro_batch: int = 1,
    multiple_of: int = 1,
    pad_multiple: int = 64,
    one_per_row: bool = False,
) -> list[dict[str, np.ndarray]]:
    """Micro-batches of shape ``[rows, length]``: samples packed first-fit-decreasing into rows of at most
    ``seq_len`` tokens, ``rows_per_micro_batch`` rows stacked per forward pass, each micro-batch padded to a
    multiple of ``pad_multiple`` tokens (a half-empty micro-batch costs half the compute). The list is padded
    with empty micro-batches to a multiple of ``multiple_of`` (one share per data-parallel rank).
    ``one_per_row``: each sample alone in its row, longest first (context parallelism attends over a whole
    row with a plain causal mask, which would let packed samples see each other).
    """
    lengths = [len(s) for s in samples]
    if one_per_row:
        bins = [[i] for i in sorted(range(len(samples)), key=lambda i: -lengths[i])]
    else:
        bins = first_fit_decreasing(lengths, seq_len)
    teacher = any(s.teacher_logprobs is not None for s in samples)
    truncation = any(s.truncated() for s in samples)
    routed = [s.routed_experts for s in samples if s.routed_experts is not None]
    routes = tuple(routed[0].shape[1:]) if routed else ()
    keys = (
        *MICRO_BATCH_KEYS,
        *(("teacher_logprobs",) if teacher else ()),
        *(TRUNCATION_KEYS if truncation else ()),
        *(("routed_experts",) if routes else ()),
    )
    micro_batches = []
    for i in range(0, len(bins), rows_per_micro_batch):
        chunk = bins[i : i + rows_per_micro_batch]
        used = max(sum(len(samples[j]) for j in b) for b in chunk)
        length = min(seq_len, -(-used // pad_multiple) * pad_multiple)
        rows = [
            build_row([samples[j] for j in b], length, pad_id, teacher, truncation, routes) for b in chunk
        ]
        micro_batches.append({k: np.stack([r[k] for r in rows]) for k in keys})
    while len(micro_batches) % multiple_of:
        empty = build_row([], min(seq_len, pad_multiple), pad_id, teacher, truncation, routes)
        micro_batches.append({k: v[None] for k, v in empty.items()})
    return micro_batches
