"""Paged K/V storage for a fixed number of sequence slots, taken as the sequences grow.

A slot's positions live in pages of `page_size` positions; a page holds K and V of every layer,
[2, layers, page_size, kv_heads, head_dim]. `table` [slots, capacity // page_size + 1] says where
each of a slot's pages is, as an element offset from `anchor`, the cache's permanent scratch page.
Entries a slot has not reserved are 0, the scratch page: what a forward writes outside a row's
reservation (right padding of a prefill, past the capacity, rows a decode step computes without
advancing them, free slots) lands there, where no row reads.

The caller reserves a slot's positions before a forward writes them (`reserve`) and releases the
slot when its sequence ends (`release`). Two storages behind the one table:
  * on CUDA with Triton, pages live in chunk tensors of ~CHUNK_BYTES, allocated when a slot needs
    a page and none is free (one allocation for many pages: a burst of admissions does not wait on
    an allocator call per page); a released page waits on a free list for the next slot, and `trim`
    hands back chunks whose pages are all free, so the memory follows the load. CUDA graphs stay
    valid as chunks come and go: they capture `anchor` and `table`, which never move. Reads and
    writes are Triton kernels that follow the offsets.
  * elsewhere (CPU), the pages are one pool tensor, grown by reallocation (there are no graphs to
    keep valid), and reads and writes are torch indexing (offsets are multiples of a page).
The cache holds no lengths: the caller (the runner) owns them and passes each forward the start
position of every row. Reads are gathers: rows 0..B-1 (decode, `slots=None`) or any `slots`.
"""
from __future__ import annotations

import collections

import numpy as np
import torch

from .host import to_device
from .model import kernels

CHUNK_BYTES = 128 << 20          # device memory allocated at once for pages (separate storage)


class CacheFull(torch.OutOfMemoryError):
    """The cache holds its most pages (`max_pages`): pages come back only as slots release theirs."""


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, page_size: int = 64,
                 reserve_all: bool = False, separate_pages: bool | None = None, chunk_pages: int | None = None):
        """capacity: positions per slot. reserve_all: every slot's whole capacity is reserved now (a
        static cache: tests, benchmarks, the code predictor's one-frame cache). separate_pages: pages in
        chunk tensors of their own, addressed by offset (default on CUDA when Triton is there), or in
        one pool. chunk_pages: pages a chunk (default: CHUNK_BYTES' worth, at most what every slot's
        capacity needs)."""
        device = torch.device(device)
        self.num_layers, self.num_slots, self.capacity = num_layers, num_slots, capacity
        self.kv_heads, self.head_dim, self.page_size = kv_heads, head_dim, page_size
        self.page_shape = (2, num_layers, page_size, kv_heads, head_dim)
        self.page_elems = int(np.prod(self.page_shape))
        if separate_pages is None:
            separate_pages = device.type == "cuda" and kernels.triton is not None
        self.separate_pages = separate_pages
        self.anchor = torch.zeros(self.page_shape, dtype=dtype, device=device)     # the scratch page
        self.pool = self.anchor[None]          # one-pool storage: page i is pool[i] (0: scratch)
        self._chunks: dict[int, torch.Tensor] = {}  # separate storage: chunk id -> [pages, *page_shape]
        self._chunk_of: dict[int, int] = {}         # separate storage: page offset -> chunk id
        self._free: list[int] = []             # offsets of pages no slot holds
        self._pool_used = 1
        self.max_pages: int | None = None     # most pages held at once (None: what the device gives)
        self.table = torch.zeros(num_slots, capacity // page_size + 1, dtype=torch.long, device=device)
        self.chunk_pages = chunk_pages or max(1, min(CHUNK_BYTES // self.page_bytes,
                                                     num_slots * -(-capacity // page_size)))
        self._slot_pages: list[list[int]] = [[] for _ in range(num_slots)]
        self.page_counts = np.zeros(num_slots, dtype=np.int64)    # pages each slot holds
        if reserve_all:
            self.reserve(list(range(num_slots)), [capacity] * num_slots)

    # -- pages -----------------------------------------------------------------------------------

    @property
    def pages_in_use(self) -> int:
        return int(self.page_counts.sum())

    @property
    def pages_free(self) -> int:
        return len(self._free)

    @property
    def pages_held(self) -> int:
        """Pages allocated (in use or free), not counting the scratch page."""
        return len(self._chunk_of) if self.separate_pages else self._pool_used - 1

    @property
    def chunks_held(self) -> int:
        """Chunk tensors of separate storage (each one device allocation)."""
        return len(self._chunks)

    @property
    def page_bytes(self) -> int:
        return self.page_elems * self.anchor.element_size()

    def bytes_held(self) -> int:
        """Device memory of the pages, the scratch page and (one pool) its unused room included."""
        return (self.pages_held + 1 if self.separate_pages else self.pool.shape[0]) * self.page_bytes

    def reserve(self, slots: list[int], positions: list[int]) -> None:
        """Make positions 0..positions[i]-1 of slot slots[i] writable (pages it lacks are taken from
        the free list or allocated). Raises CacheFull past `max_pages`, torch.OutOfMemoryError when
        the device has no room; the pages taken before that stay with their slots."""
        rows, cols, offsets = [], [], []
        try:
            for slot, n in zip(slots, positions):
                held = self._slot_pages[slot]
                for col in range(len(held), -(-min(n, self.capacity) // self.page_size)):
                    offset = self._take_page()
                    held.append(offset)
                    self.page_counts[slot] += 1
                    rows.append(slot)
                    cols.append(col)
                    offsets.append(offset)
        finally:
            if rows:       # one host-to-device copy for the new table entries
                r, c, o = to_device([rows, cols, offsets], self.table.device, torch.long)
                self.table[r, c] = o

    def reserved(self, slots) -> np.ndarray:
        """Positions of each of `slots` (indices into the slots) that are writable."""
        return np.minimum(self.capacity, self.page_counts[slots] * self.page_size)

    def release(self, slots: list[int]) -> None:
        """Give `slots`' pages back to the free list; their table rows point at the scratch page."""
        for slot in slots:
            self._free.extend(self._slot_pages[slot])
            self._slot_pages[slot] = []
            self.page_counts[slot] = 0
        if slots:
            self.table.index_fill_(0, to_device(slots, self.table.device, torch.long), 0)   # no pageable upload

    def trim(self, keep: int = 0) -> int:
        """Free chunks whose pages no slot holds while more than `keep` pages are free (separate
        storage; the pool keeps its size); returns the bytes freed (back to PyTorch's allocator)."""
        if not self.separate_pages or len(self._free) <= keep:
            return 0
        free_in = collections.Counter(self._chunk_of[offset] for offset in self._free)
        dropped, free = set(), len(self._free)
        for chunk, n in free_in.items():
            if free <= keep:
                break
            if n == self._chunks[chunk].shape[0]:
                dropped.add(chunk)
                free -= n
        self._free = [offset for offset in self._free if self._chunk_of[offset] not in dropped]
        self._chunk_of = {offset: c for offset, c in self._chunk_of.items() if c not in dropped}
        freed = sum(self._chunks.pop(chunk).shape[0] for chunk in dropped)
        return freed * self.page_bytes

    def _take_page(self) -> int:
        if self._free:
            return self._free.pop()
        if self.max_pages is not None and self.pages_held >= self.max_pages:
            raise CacheFull(f"the KV cache holds its most pages ({self.max_pages})")
        if self.separate_pages:
            n = self.chunk_pages
            if self.max_pages is not None:
                n = min(n, self.max_pages - self.pages_held)
            # zeros: attention over a bucket of keys reads positions no step wrote yet, masked out; a
            # NaN left in fresh device memory would still reach the output through 0 * NaN
            chunk = torch.zeros((n, *self.page_shape), dtype=self.anchor.dtype, device=self.anchor.device)
            chunk_id = max(self._chunks, default=-1) + 1
            self._chunks[chunk_id] = chunk
            base = (chunk.data_ptr() - self.anchor.data_ptr()) // chunk.element_size()
            offsets = [base + i * self.page_elems for i in range(n)]
            self._chunk_of.update((offset, chunk_id) for offset in offsets)
            self._free.extend(reversed(offsets[1:]))
            return offsets[0]
        if self._pool_used == self.pool.shape[0]:
            grown = torch.zeros((2 * self.pool.shape[0], *self.page_shape), dtype=self.pool.dtype, device=self.pool.device)
            grown[:self._pool_used] = self.pool
            self.pool, self.anchor = grown, grown[0]
        self._pool_used += 1
        return (self._pool_used - 1) * self.page_elems

    # -- reads and writes ------------------------------------------------------------------------

    def layer_offsets(self, layer: int) -> tuple[int, int]:
        """Element offsets of the layer's K and V within a page."""
        per = self.page_size * self.kv_heads * self.head_dim
        return layer * per, (self.num_layers + layer) * per

    def _rows(self, batch: int, slots: torch.Tensor | None) -> torch.Tensor:
        return torch.arange(batch, device=self.table.device) if slots is None else slots

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
              slots: torch.Tensor | None = None) -> None:
        """Store k, v [B,T,kv_heads,head_dim] at positions start[b]..start[b]+T-1 of slot slots[b]
        (row b when None). Positions >= capacity go to the scratch page, so right-padded rows may run
        past the end; a row's padding lands after its real tokens, never before them."""
        b, t = k.shape[:2]
        rows = self._rows(b, slots)
        if self.separate_pages:
            kernels.kv_write(self, layer, k, v, start, rows)
            return
        pos = (start[:, None] + torch.arange(t, device=k.device)).clamp(max=self.capacity)
        page = self.table[rows[:, None], pos // self.page_size] // self.page_elems
        self.pool[page, 0, layer, pos % self.page_size] = k
        self.pool[page, 1, layer, pos % self.page_size] = v

    def read(self, layer: int, batch: int, kmax: int, slots: torch.Tensor | None = None):
        """Keys and values [B, kmax, kv_heads, head_dim] of slots 0..batch-1 or of `slots`."""
        if kmax > self.capacity:
            raise ValueError(f"kmax {kmax} exceeds the cache capacity {self.capacity}")
        rows = self._rows(batch, slots)
        if self.separate_pages:
            return kernels.kv_read(self, layer, rows, kmax)
        page = self.table[rows, :-(-kmax // self.page_size)] // self.page_elems
        k, v = self.pool[page, 0, layer], self.pool[page, 1, layer]     # [B, pages, page_size, H, D]
        return k.flatten(1, 2)[:, :kmax], v.flatten(1, 2)[:, :kmax]
