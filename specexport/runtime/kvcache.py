"""The KV cache: one preallocated buffer per layer and kind, written in place by the graph.

The graph writes the K/V of the T new tokens at rows [length, length + T). After verification the
caller either keeps all of them (`advance`), keeps an accepted subset (`commit`, which copies the
accepted rows down so they are contiguous), or drops rows (`rewind`). No call copies the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


class CacheRows(ABC):
    """What every KV cache keeps the same way, wherever its buffers live: `capacity` rows, the first `length`
    committed. A subclass writes `move(src)`: copy the rows at absolute offsets `src` down to
    [length, length + len(src)) (only called for a path that is not a prefix)."""

    capacity: int
    length: int

    def room(self) -> int:
        return self.capacity - self.length

    def advance(self, n: int) -> None:
        """Keep all n rows written by the last step."""
        if self.length + n > self.capacity:
            raise ValueError(f"KV cache overflow: {self.length} + {n} > capacity {self.capacity}")
        self.length += n

    def commit(self, rows) -> None:
        """Keep the new rows at these offsets (relative to `length`, ascending), in order."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or self.length + rows.max() >= self.capacity):
            raise ValueError(f"commit rows {rows.tolist()} outside the cache")
        if not np.array_equal(rows, np.arange(rows.size)):  # only a non-prefix path needs a copy
            self.move(self.length + rows)
        self.length += int(rows.size)

    @abstractmethod
    def move(self, src: np.ndarray) -> None:
        """Copy the rows at absolute offsets `src` down to [length, length + len(src))."""

    def rewind(self, length: int) -> None:
        """Forget everything after `length` rows (the buffer is not cleared; rows are overwritten later)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind to {length} (cache holds {self.length})")
        self.length = length


class KVCache(CacheRows):
    def __init__(self, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, dtype=np.float32):
        shape = (batch, kv_heads, capacity, head_dim)
        self.buffers = [np.zeros(shape, dtype=dtype) for _ in range(2 * layers)]  # k0, v0, k1, v1, ...
        self.capacity = capacity
        self.batch = batch
        self.length = 0  # committed rows
        self.handle = None  # the backend's binding of these buffers, made on first use

    def move(self, src: np.ndarray) -> None:
        for buf in self.buffers:
            buf[:, :, self.length:self.length + src.size] = buf[:, :, src]
