"""A KV cache that preallocates its capacity, for decoding on CPU.

transformers' ``DynamicCache`` concatenates every new token onto the whole cache (O(L) copies per token
per layer: a quarter of the decode time of the tiny default). This layer writes into a buffer sized for
the longest request and returns views of the filled part, so attention sees exactly the same key
length as with ``DynamicCache`` (and therefore the same numbers).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer


class PreallocatedLayer(DynamicLayer):
    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        b, h, _, d = key_states.shape
        self.k_buf = key_states.new_zeros((b, h, self.capacity, d))
        self.v_buf = value_states.new_zeros(
            (b, value_states.shape[1], self.capacity, value_states.shape[-1])
        )
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        if self.length + n > self.capacity:
            raise RuntimeError(f"KV cache capacity {self.capacity} exceeded")
        self.k_buf[:, :, self.length : self.length + n] = key_states
        self.v_buf[:, :, self.length : self.length + n] = value_states
        self.length += n
        self.keys, self.values = self.k_buf[:, :, : self.length], self.v_buf[:, :, : self.length]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            self.k_buf, self.v_buf = self.k_buf[indices], self.v_buf[indices]
            self.keys, self.values = self.k_buf[:, :, : self.length], self.v_buf[:, :, : self.length]


def preallocated_cache(config, capacity: int) -> DynamicCache:
    """A ``DynamicCache`` whose layers preallocate ``capacity`` positions (sliding-window models keep the
    default)."""
    cache = DynamicCache(config=config)
    if all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.layers = [PreallocatedLayer(capacity) for _ in cache.layers]
    return cache
