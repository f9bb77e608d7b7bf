"""The KV cache: one preallocated buffer per layer and kind, written in place by the graph.

The graph writes the K/V of the T new tokens at rows [length, length + T), or, for a step the backend laid out
in lanes (runtime/backends/layout.py), where it `place`d them. After verification the caller either keeps all of
them (`advance`), keeps an accepted subset (`commit`, which copies the accepted rows down so they are
contiguous), or drops rows (`rewind`), by their rows in the step. No call copies the cache.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod

import numpy as np


class CacheRows(ABC):
    """What every KV cache keeps the same way, wherever its buffers live: `capacity` rows, the first `length`
    committed. A subclass writes `move(src)`: copy the rows at absolute offsets `src` down to
    [length, length + len(src)) (only called for a path that is not a prefix)."""

    capacity: int
    length: int
    batch: int

    @property
    def keeps_rows(self) -> bool:
        """Whether its rows can be read and written by offset (`rows_at`, `put_rows`: one sequence's cache whose
        kind implements them; runtime/prefix.py keeps prompts' beginnings this way)."""
        return False

    def room(self) -> int:
        return self.capacity - self.length

    @property
    def places_rows(self) -> bool:
        """Whether a step's rows may be written out of order (`place`): each batch row commits on its own."""
        return self.batch == 1

    def place(self, k: int, slots: np.ndarray | None) -> None:
        """Where the last step wrote batch row k's rows: row i at offset slots[i] from its length (None: in order),
        read by the next commit or advance of that row."""
        placed = self._placed()
        if slots is None:
            placed.pop(self._slot_key(k), None)
        else:
            placed[self._slot_key(k)] = slots

    def _placed(self) -> dict:
        if "placed" not in self.__dict__:
            self.placed = {}
        return self.placed

    def _slot_key(self, k: int) -> int:
        return k

    def _where(self, rows):
        """The step's rows `rows` as written (`place`)."""
        slots = self._placed().pop(self._slot_key(0), None)
        return rows if slots is None else slots[np.asarray(rows, np.int64)]

    def past_lengths(self, batch: int) -> np.ndarray:
        """Each batch row's committed length, what a step's `past_len` takes (one cache: the same for all)."""
        return np.full(batch, self.length, np.int64)

    def advance(self, n: int) -> None:
        """Keep all n rows written by the last step."""
        if self._placed().get(self._slot_key(0)) is not None:
            return self.commit(np.arange(n))
        if self.length + n > self.capacity:
            raise ValueError(f"KV cache overflow: {self.length} + {n} > capacity {self.capacity}")
        self.length += n

    def commit(self, rows) -> None:
        """Keep the new rows at these offsets (relative to `length`, ascending), in order: a prefix (most steps'
        path) stays where it is, any other path is copied down."""
        rows = self._where(rows)
        if not (isinstance(rows, list) and rows == list(range(len(rows)))):  # given as a list, a prefix is quick
            rows = np.asarray(rows, dtype=np.int64)
            if rows.size and (rows.min() < 0 or self.length + rows.max() >= self.capacity):
                raise ValueError(f"commit rows {rows.tolist()} outside the cache")
            if not np.array_equal(rows, np.arange(rows.size)):
                self.move(self.length + rows)
        elif self.length + len(rows) > self.capacity:
            raise ValueError(f"commit rows {rows} outside the cache")
        self.length += len(rows)

    @abstractmethod
    def move(self, src: np.ndarray) -> None:
        """Copy the rows at absolute offsets `src` down to [length, length + len(src))."""

    def rewind(self, length: int) -> None:
        """Forget everything after `length` rows (the buffer is not cleared; rows are overwritten later)."""
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind to {length} (cache holds {self.length})")
        self._placed().pop(self._slot_key(0), None)
        self.length = length


class HostRows(CacheRows):
    """A cache of one sequence whose buffers are host arrays [1, kv_heads, capacity, head_dim]: its rows can be read
    and written by offset (runtime/prefix.py keeps prompts' beginnings this way)."""

    buffers: list[np.ndarray]

    @property
    def keeps_rows(self) -> bool:
        return self.batch == 1

    def rows_at(self, start: int, n: int) -> list[np.ndarray]:
        """Copies of rows [start, start + n) of every buffer."""
        return [buf[0, :, start:start + n].copy() for buf in self.buffers]

    def put_rows(self, start: int, rows: list[np.ndarray]) -> None:
        """Write `rows_at`'s copies back at rows [start, start + n) (the length is the caller's to advance)."""
        if start + rows[0].shape[1] > self.capacity:
            raise ValueError(f"rows [{start}, {start + rows[0].shape[1]}) outside a cache of {self.capacity}")
        for buf, r in zip(self.buffers, rows):
            buf[0, :, start:start + r.shape[1]] = r


class KVCache(HostRows):
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


class SlotPool(ABC):
    """The KV cache of a batch by slots, wherever its rows live (`KVPool` on the host; on a device,
    runtime/backends/iobinding.DevicePool): `slots` sequences of `capacity` rows, each slot with its own committed
    length (`lengths`, on the host). The scheduler keeps its running sequences in a prefix of the slots, so that a
    batched call binds `rows(n)`: the first n slots, a view (no copy) of the rows; `slot(j)` views one slot alone, for
    a prompt's prefill and for the proposers' own calls. A slot freed in the middle is refilled by moving the last one
    down (`move_slot`, rarely)."""

    def __init__(self, slots: int, capacity: int):
        self.slots, self.capacity = slots, capacity
        self.lengths = np.zeros(slots, np.int64)
        self.placed: dict[int, np.ndarray] = {}  # slot -> where its last step's rows are (CacheRows.place)
        self._views: dict[tuple[int, int], SlotView] = {}

    def empty(self, slot: int | None = None) -> None:
        """Forget slot `slot`'s rows (None: every slot's)."""
        for j in range(self.slots) if slot is None else (slot,):
            self.lengths[j] = 0
            self.placed.pop(j, None)

    def rows(self, n: int) -> "SlotView":
        """Slots 0..n-1 as one cache (a batched call's); made once per n and kept with its binding."""
        return self._view(0, n)

    def slot(self, j: int) -> "SlotView":
        """Slot j alone as a cache."""
        return self._view(j, j + 1)

    def span(self, start: int, stop: int) -> "SlotView":
        """Slots start..stop-1 as one cache (the prompts being fed, after the running ones)."""
        return self._view(start, stop)

    def _view(self, start: int, stop: int) -> "SlotView":
        if not 0 <= start < stop <= self.slots:
            raise ValueError(f"slots [{start}, {stop}) outside a pool of {self.slots}")
        view = self._views.get((start, stop))
        if view is None:
            view = self._views[(start, stop)] = self.view(start, stop)
        return view

    @abstractmethod
    def view(self, start: int, stop: int) -> "SlotView":
        """A new view of slots [start, stop)."""

    @abstractmethod
    def move_slot(self, src: int, dst: int) -> None:
        """Copy slot src's committed rows and length into slot dst (src's rows are left as they were)."""


class SlotView(CacheRows):
    """A run of a pool's slots seen as one cache (`Cache` in runtime/backends/host.py). Its `length` is the first
    slot's (what a single slot's calls read and move); `past_lengths` gives each slot's, for a batched call, whose
    rows the scheduler commits slot by slot (`commit_slot`)."""

    def __init__(self, pool: SlotPool, start: int, stop: int):
        # the pool keeps its views (each with its binding): a weak reference back, so that no cycle holds a pool's
        # buffers until the cyclic collector runs (a service opening and closing engines grew ~0.6 MB a cycle)
        self.pool, self.start, self.stop = weakref.proxy(pool), start, stop
        self.batch, self.capacity = stop - start, pool.capacity

    @property
    def length(self) -> int:
        return int(self.pool.lengths[self.start])

    @length.setter
    def length(self, value: int) -> None:
        self.pool.lengths[self.start] = value

    def past_lengths(self, batch: int) -> np.ndarray:
        if batch != self.batch:
            raise ValueError(f"a step of batch {batch} on {self.batch} slots")
        return self.pool.lengths[self.start:self.stop]

    @property
    def places_rows(self) -> bool:
        return True

    def _placed(self) -> dict:
        return self.pool.placed

    def _slot_key(self, k: int) -> int:
        return self.start + k

    def commit_slot(self, k: int, rows) -> None:
        """Keep the new rows of slot start + k at these offsets from its length (ascending), in order."""
        self.pool.slot(self.start + k).commit(rows)


class KVPool(SlotPool):
    """A batch's KV cache on the host: one buffer per layer and kind, [slots, kv_heads, capacity, head_dim]; its views
    are `SlotRows`, and a slot moves by one copy of its committed rows."""

    def __init__(self, layers: int, slots: int, kv_heads: int, capacity: int, head_dim: int, dtype=np.float32):
        super().__init__(slots, capacity)
        shape = (slots, kv_heads, capacity, head_dim)
        self.buffers = [np.zeros(shape, dtype=dtype) for _ in range(2 * layers)]

    @property
    def nbytes(self) -> int:
        return sum(buf.nbytes for buf in self.buffers)

    def view(self, start: int, stop: int) -> "SlotRows":
        return SlotRows(self, start, stop)

    def move_slot(self, src: int, dst: int) -> None:
        n = int(self.lengths[src])
        for buf in self.buffers:
            buf[dst, :, :n] = buf[src, :, :n]
        self.lengths[dst] = n
        self.placed.pop(dst, None)


class SlotRows(SlotView, HostRows):
    """Host slots as one cache: views of the pool's buffers, bound in place."""

    def __init__(self, pool: KVPool, start: int, stop: int):
        super().__init__(pool, start, stop)
        self.buffers = [buf[start:stop] for buf in pool.buffers]  # leading-axis slices: contiguous views
        self.handle = None

    def move(self, src: np.ndarray) -> None:
        at = self.length
        for buf in self.buffers:
            rows = buf[0]  # [kv_heads, capacity, head_dim]
            rows[:, at:at + src.size] = rows[:, src]
