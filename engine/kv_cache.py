"""Static, preallocated K/V storage for a fixed number of sequence slots.

Layout per layer is [slots, capacity + 1, kv_heads, head_dim] (the layout `flash_attn_with_kvcache`
takes, so a fused path can use these tensors as they are). The extra last position is a scratch
column: writes that would land at or past `capacity` (right padding of a prefill batch) go there, so
padding never touches a position a row will read.

The cache holds no lengths: the caller (the runner) owns per-slot lengths and passes each forward the
start position of every row. Two access patterns:
  * decode: rows 0..B-1 are slots 0..B-1 (`slots=None`); reads are views of the cache, no gather;
  * prefill: any slots (`slots` LongTensor [B]); reads gather those slots.
"""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str):
        shape = (num_layers, num_slots, capacity + 1, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.num_slots = num_slots

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
              slots: torch.Tensor | None = None) -> None:
        """Store k, v [B,T,kv_heads,head_dim] at positions start[b]..start[b]+T-1 of slot slots[b].

        Positions >= capacity are redirected to the scratch column, so right-padded rows may run past
        the end. A row's padding lands after its real tokens, never before them.
        """
        b, t = k.shape[:2]
        rows = torch.arange(b, device=k.device) if slots is None else slots
        pos = (start[:, None] + torch.arange(t, device=k.device)).clamp(max=self.capacity)
        self.k[layer][rows[:, None], pos] = k
        self.v[layer][rows[:, None], pos] = v

    def read(self, layer: int, batch: int, kmax: int, slots: torch.Tensor | None = None):
        """Keys and values [B, kmax, kv_heads, head_dim] of slots 0..batch-1 (a view) or of `slots`."""
        if kmax > self.capacity:
            raise ValueError(f"kmax {kmax} exceeds the cache capacity {self.capacity}")
        if slots is None:
            return self.k[layer, :batch, :kmax], self.v[layer, :batch, :kmax]
        return self.k[layer][slots, :kmax], self.v[layer][slots, :kmax]
