"""What the loop calls to run one graph of a bundle: the `Backend` and `Cache` protocols.

A `Backend` runs a step graph (the target's, a draft's) one step at a time against a KV cache it owns, or any graph
with a plain call. Implementations: `host.GraphSession` (ONNX Runtime, the cache in host numpy buffers bound in
place: the CPU default), `iobinding.DeviceSession` (ONNX Runtime with the cache and the step's buffers resident on
the session's device; `--device cuda`, and `cpu-iobinding` to run the same code on CPU), and
`tensorrt.TensorRTSession`. `runtime.backends.open_graph` picks one for a device: a new backend implements
`Backend` and adds one branch there.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Cache(Protocol):
    """A backend's KV cache, counted in rows (positions). Its buffers never move: a step writes its T new rows at
    [length, length + T) in place, and these calls only move `length` (commit also compacts rows, where they live)."""

    length: int  # committed rows
    capacity: int

    def room(self) -> int: ...  # capacity - length

    def past_lengths(self, batch: int) -> np.ndarray: ...  # each batch row's committed length (a pool's slots differ)

    def advance(self, n: int) -> None: ...  # keep all n rows the last step wrote

    def commit(self, rows) -> None: ...  # keep the last step's rows at these offsets from `length` (ascending), in order

    def rewind(self, length: int) -> None: ...  # forget the rows after `length`


@runtime_checkable
class Backend(Protocol):
    """One graph of a bundle loaded for a device; what the loop (runtime/generate.py) and the proposers call.

    Attributes: `info` the graph's manifest entry; `outputs` its output names; `fused_inputs` True when it takes the
    sampling acceptance's inputs (exporter/fused.py); `calls`, `seconds` the forward calls so far and their time
    inside the graph call (`specexport profile` and bench read them).

    `new_cache(capacity, batch=1)`: a KV cache of `capacity` rows that the backend owns and binds to its graph
    (a graph with a static cache length returns one of that length).

    `forward(cache, input_ids, position_ids, tree_mask, logits_indices, want=("logits",), inputs=None,
    accept=None, live=None) -> {name: numpy array}`: one step over T new tokens, their K/V written at rows
    [cache.length, cache.length + T); it does not move cache.length (the caller advances or commits).
      - input_ids, position_ids: [B, T] integers.
      - tree_mask: [T, K] or [B, T, K] bool, K >= T: the visibility among the last K rows of cache + step. Row i
        sees every row before cache.length + T - K, and row cache.length + T - K + j when tree_mask[i, j]. K = T: the
        step's ancestor-or-self mask (`tree.ancestor_mask`; the past is implied visible); K > T: the K - T rows right
        before the step are tree nodes written by earlier calls (a draft growing its tree level by level). The
        backend turns it into what its graph takes (the graphs build their attention bias from it themselves).
      - logits_indices: [n] flat rows (b * T + t) whose logits (and per-row outputs) are wanted.
      - live: [B] how many rows at the start of each batch row are real (a batched step's trees padded to the
        widest); a graph with ragged rows (exporter/graph.py) computes those only. None: every row.
      - want: the outputs to bring back to the host, nothing else crosses.
      - inputs: the graph's other inputs by name (an EAGLE draft's `hidden`); accept: the fused acceptance's inputs
        (`verify.fused_inputs`), greedy when None.

    `run(feeds) -> {name: array}`: a plain call returning every output (Medusa's stand-alone heads).
    """

    info: dict
    outputs: list[str]
    fused_inputs: bool
    calls: int
    seconds: float

    def new_cache(self, capacity: int, batch: int = 1) -> Cache: ...

    def forward(self, cache: Cache, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray,
                logits_indices: np.ndarray, want: tuple[str, ...] = ("logits",),
                inputs: dict[str, np.ndarray] | None = None, accept: dict[str, np.ndarray] | None = None,
                live: np.ndarray | None = None) -> dict[str, np.ndarray]: ...

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]: ...


def pools(backend) -> bool:
    """Whether `backend` can hold a batch of sequences in one pool (`new_pool`: the batched engine, the drafting
    governor's measurements): ONNX Runtime graphs whose cache length is free; not TensorRT (batch 1), nor the trt
    flavour's fixed cache length."""
    return hasattr(backend, "new_pool") and not backend.info.get("kv_capacity")
