"""The padded layout of a batched call over pool slots: the target's verification, the prompts' chunks, a draft
graph's round of calls (runtime/scheduler.py, runtime/drafting.py).

Each entry puts its nodes in its slot's batch row, and the call is padded to the widest entry. A padded row sees
only itself and writes a cache row past its slot's length, which nothing reads (the next real row overwrites it);
a graph with ragged rows (exporter/graph.py) computes the `live` rows only. Example: two slots, a tree of 3 nodes
after 10 rows and a chain of 1 after 4, give ids [2, 3], positions [[10, 11, 11], [4, 4, 4]], the second row's
mask the identity past its first column, live [3, 1], and flat rows [0, 1, 2, 3] selected.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Entry:
    """One slot's nodes in a batched call: `key` (who reads the outputs), batch row `b`, token `ids` [t], their
    absolute `positions` [t], `mask` [t, k] (each node's visible rows among the last k, the k - t before its first
    node already in the cache), the `rows` (0..t-1) whose per-row outputs are read, and other per-node inputs."""

    key: object
    b: int
    ids: list[int]
    positions: np.ndarray
    mask: np.ndarray
    rows: list[int]
    inputs: dict = field(default_factory=dict)


@dataclass
class PaddedBatch:
    """A batched call's inputs (`lay_out`) and where each entry's outputs are (`placed`)."""

    ids: np.ndarray  # [n, W]
    positions: np.ndarray  # [n, W]
    mask: np.ndarray  # [n, W, behind + W]
    live: np.ndarray  # [n]: each batch row's real rows (0: a row of padding only)
    selected: np.ndarray  # flat indices b * W + r of the rows whose per-row outputs come back
    inputs: dict  # other per-node inputs, [n, W, ...]
    entries: dict  # key -> (entry, index of its first selected row)

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    @classmethod
    def lay_out(cls, lengths: np.ndarray, entries: list[Entry], behind: int = 0) -> "PaddedBatch":
        """The call over slots whose committed lengths are `lengths` ([n]), the mask's columns covering `behind`
        cached rows before each row's first node (0: the entries' nodes see only each other)."""
        n, width = len(lengths), max(len(e.ids) for e in entries)
        ids = np.zeros((n, width), np.int64)
        positions = np.repeat(np.asarray(lengths, np.int64)[:, None], width, axis=1)
        mask = np.zeros((n, width, behind + width), np.bool_)
        mask[:, np.arange(width), behind + np.arange(width)] = True  # a padded row sees only itself
        live, inputs, selected, placed = np.zeros(n, np.int64), {}, [], {}
        for e in entries:
            t, k = len(e.ids), e.mask.shape[1]
            live[e.b] = t
            ids[e.b, :t] = e.ids
            positions[e.b, :t] = e.positions
            mask[e.b, :t] = False
            mask[e.b, :t, behind - (k - t):behind + t] = e.mask
            for name, value in e.inputs.items():
                if name not in inputs:
                    inputs[name] = np.zeros((n, width) + value.shape[1:], value.dtype)
                inputs[name][e.b, :t] = value
            placed[e.key] = (e, len(selected))
            selected.extend(e.b * width + r for r in e.rows)
        return cls(ids, positions, mask, live, np.asarray(selected, np.int64), inputs, placed)

    def placed(self, key, out: dict, names, batch_outputs) -> dict:
        """An entry's outputs: a per-batch-row output (in `batch_outputs`) as [1, t, ...] from its batch row, the
        others by its selected rows."""
        e, start = self.entries[key]
        return {name: out[name][e.b:e.b + 1, :len(e.ids)] if name in batch_outputs
                else out[name][start:start + len(e.rows)] for name in names}

    def real_rows(self) -> int:
        return int(self.live.sum())
