"""Where a step's rows sit in the call, so that a position's logits are the same bits however it is computed.

Two rules of ONNX Runtime's CPU attention decide a row's bits beyond its own inputs (docs/precision.md,
../shared/reference/row_invariance.md):

- probs x V runs with a one-row kernel for a call of one row, and for the last row of some calls of 16k + 1
  rows, in another float order than every other row gets: such a call gets one padding row more.
- a row's softmax sums its keys in `LANES` partial sums by key index (16 with AVX-512, 8 with AVX2), lane by
  lane in index order, and probs x V sums them in runs of 256 keys (MLAS's SGEMM StrideK for 64-wide heads; 128
  for 128). Plain decoding reads the key of the token d places after the past at index past + d; so does a chain. A
  branching tree's node at depth d reads its ancestors wherever the tree's order put them, in other lanes. Laid
  out in lanes, each node sits at a slot s = depth (mod LANES) after its parent's: its ancestors then fall in
  plain decoding's lanes, in its order, and the rows between them are padding. A slot must also fall in the run
  of probs x V that past + depth falls in: near a run's end a wide tree has no such slot for its later branches,
  and the loop verifies the tree without them (`exact_nodes`).

A padding row repeats a real row's token at its root's position, sees only itself and writes a cache row that
no committed row keeps; a ragged graph (exporter/graph.py) computes its per-row work on the real rows only, so
the padding costs attention alone. After the call the outputs come back in the caller's row order, and the
cache remembers where each node's rows went (`Cache.place`) until the caller commits them.

A graph whose attention is specexport's own (`AttentionRows`, `build --attention-rows`) sums a row's keys in one
order wherever they sit: it is not laid out (GraphSession.lays_out).

Example: a root with two children, [-1, 0, 0], is laid out at slots [0, 1, 17] of a call of 18 rows: the second
child reads its parent's key at index past + 0 and its own at past + 17, the lanes of past + 0 and past + 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

LANES = 16  # AVX-512's partial sums; a layout for 16 also holds for AVX2's 8
MARGIN = 4 * LANES  # the rows a cache keeps past its longest tree: a tree of four branches laid out, and padding


@dataclass(frozen=True)
class Layout:
    """A step laid out: the call's inputs, and for each (batch row, row) of the caller's step the call's row that
    holds it (`place` [B, T]); `real` [B, T'] marks the call's rows that hold a real row of the caller's."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    tree_mask: np.ndarray
    logits_indices: np.ndarray
    place: np.ndarray
    real: np.ndarray
    moved: list  # per batch row: its real rows' slots, where they are not 0..n-1 (else None)

    def outputs(self, out: dict[str, np.ndarray], seq_outputs) -> dict[str, np.ndarray]:
        """The call's outputs in the caller's rows: those per [batch, seq] gathered back by `place`."""
        return {name: np.take_along_axis(value, self.place.reshape(self.place.shape + (1,) * (value.ndim - 2)),
                                         axis=1) if name in seq_outputs else value for name, value in out.items()}


def chunk_keys(head_dim: int) -> int:
    """The keys MLAS's SGEMM sums in one run for probs x V (its StrideK for N = head_dim columns): 256 for 64."""
    stride_n, stride_k = 128, 128
    while stride_n > 16 and stride_n // 2 >= head_dim:
        stride_n, stride_k = stride_n // 2, stride_k * 2
    return stride_k


def exact_nodes(parents, past: int, head_dim: int, prefix: bool = False) -> int | list[int]:
    """The nodes of a tree (parents in order, root first) that a step after `past` cached rows lays out exactly,
    in the rows a cache keeps for a tree of its size (its nodes and `MARGIN`): each in its lane (`lane_slots`)
    and in the run of probs x V keys where past + its depth falls. The others (the later branches of a wide tree
    near a run's end, or beyond the margin) and their descendants are left out. A function of the tree and its
    past alone, so that a seeded request's tree is the same alone and batched. `prefix`: the longest prefix of the
    nodes (their numbering kept), as a count; else the nodes kept, ascending.
    Example: exact_nodes([-1, 0, 0], 250, 64) == [0, 1] (slot 17 would fall after key 256: another run)."""
    keep = _exact(tuple(int(p) for p in parents), past % chunk_keys(head_dim), chunk_keys(head_dim))
    if prefix:
        return next((k for k, node in enumerate(keep) if k != node), len(keep))
    return list(keep)


@lru_cache(maxsize=4096)
def _exact(parents: tuple[int, ...], offset: int, chunk: int) -> tuple[int, ...]:
    limit = len(parents) + MARGIN - 2  # 2: the layout's padding rows
    used: set[int] = set()
    slots, depth, keep = {}, {}, []
    for i, p in enumerate(parents):
        if p >= 0 and p not in slots:
            continue
        depth[i] = 0 if p < 0 else depth[p] + 1
        s = 0 if p < 0 else slots[p] + 1
        s += (depth[i] - s) % LANES
        while s in used:
            s += LANES
        if (offset + s) // chunk == (offset + depth[i]) // chunk and s < limit:
            used.add(s)
            slots[i] = s
            keep.append(i)
    return tuple(keep)


def lay_out(input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray, logits_indices: np.ndarray,
            live: np.ndarray | None, lanes: bool, room: int) -> Layout | None:
    """The layout of a step of B x T rows (batch row b's first live[b] rows real, None: all), or None where the
    step runs as given. `lanes`: branching trees go into lanes (else only the padding row of a 16k + 1 call);
    `room`: the rows the cache has after the longest batch row's past (a layout that does not fit is not made)."""
    b, t = input_ids.shape
    mask = tree_mask.reshape((-1,) + tree_mask.shape[-2:])
    behind = mask.shape[-1] - t
    live = np.full(b, t, np.int64) if live is None else check_live(b, t, live)
    slots = [_row_slots(mask[min(k, len(mask) - 1)], behind, int(live[k])) if lanes else None for k in range(b)]
    if all(s is None for s in slots):
        return _appended(input_ids, position_ids, mask, logits_indices, live) if t % 16 == 1 and room >= 1 else None
    widths = [int(s.max()) + 1 if s is not None else int(live[k]) for k, s in enumerate(slots)]
    width = max(widths)
    if any(live[k] < t and widths[k] == width for k in range(b)):
        width += 1  # a free row in every batch row, for the caller's padding rows
    width += width % 16 == 1
    if width > t + room:
        return _appended(input_ids, position_ids, mask, logits_indices, live) if t % 16 == 1 and room >= 1 else None
    return _placed(input_ids, position_ids, mask, logits_indices, live, slots, width)


def check_live(b: int, t: int, live) -> np.ndarray:
    """`live` [B]: each batch row's real rows, at most T, at least one in the step."""
    live = np.asarray(live, np.int64)
    if live.shape != (b,) or live.min(initial=0) < 0 or live.max(initial=0) > t or not live.sum():
        raise ValueError(f"live rows {live.tolist()} do not fit a step of {b} x {t} rows")
    return live


def _appended(input_ids, position_ids, mask, logits_indices, live) -> Layout:
    """The rows in their order and one padding row after them (a call of 16k + 1 rows), at once for the batch."""
    b, t = input_ids.shape
    behind = mask.shape[-1] - t
    laid = np.zeros(mask.shape[:1] + (t + 1, behind + t + 1), bool)
    laid[:, :t, :-1] = mask
    laid[:, t, -1] = True
    flat = np.asarray(logits_indices, np.int64)
    return Layout(np.concatenate([input_ids, input_ids[:, -1:]], axis=1),
                  np.concatenate([position_ids, position_ids[:, -1:]], axis=1), laid,
                  flat // t * (t + 1) + flat % t, np.broadcast_to(np.arange(t), (b, t)),
                  np.arange(t + 1) < live[:, None], [None] * b)


def _placed(input_ids, position_ids, mask, logits_indices, live, slots, width) -> Layout:
    b, t = input_ids.shape
    behind = mask.shape[-1] - t
    ids = np.repeat(input_ids[:, :1], width, axis=1)
    positions = np.repeat(position_ids[:, :1], width, axis=1)
    laid = np.zeros((b, width, behind + width), bool)
    laid[:, np.arange(width), behind + np.arange(width)] = True  # a padding row sees only itself
    place = np.full((b, t), width - 1, np.int64)  # the caller's padding rows: a padding row of the call
    real = np.zeros((b, width), bool)
    moved = []
    for k in range(b):
        n = int(live[k])
        s = np.arange(n) if slots[k] is None else slots[k]
        m = mask[min(k, len(mask) - 1)]
        ids[k, s], positions[k, s] = input_ids[k, :n], position_ids[k, :n]
        laid[k, s] = False
        laid[k, s[:, None], np.arange(behind)[None]] = m[:n, :behind]
        laid[k, s[:, None], behind + s[None]] = m[:n, behind:behind + n]
        place[k, :n], real[k, s] = s, True
        moved.append(None if slots[k] is None or np.array_equal(s, np.arange(n)) else s)
    flat = np.asarray(logits_indices, np.int64)
    indices = flat // t * width + place.reshape(-1)[flat]
    return Layout(ids, positions, laid, indices, place, real, moved)


def _row_slots(mask: np.ndarray, behind: int, n: int) -> np.ndarray | None:
    """A batch row's slots in lanes (None: its rows stay where they are): only for a forest of n rows after a past
    every row sees whole, that branches."""
    if n < 3 or not mask[:n, :behind].all() or mask[:n, behind + n:].any():
        return None
    return _slots_of(np.packbits(mask[:n, behind:behind + n]).tobytes(), n)


@lru_cache(maxsize=4096)
def _slots_of(block: bytes, n: int) -> np.ndarray | None:
    """Slots of a forest given as its ancestor-or-self block (packed bits of [n, n]), kept per shape: a method's
    trees come in a few shapes. None for a chain (already in lanes) or for rows that are no forest in order."""
    anc = np.unpackbits(np.frombuffer(block, np.uint8), count=n * n).reshape(n, n).astype(bool)
    depth = anc.sum(1) - 1
    parents = np.full(n, -1, np.int64)
    for i in range(n):
        above = np.flatnonzero(anc[i, :i])
        if not anc[i, i] or anc[i, i + 1:].any() or len(above) != depth[i]:
            return None
        if len(above):
            parents[i] = above[np.argmax(depth[above])]
            if not np.array_equal(anc[i, :i], anc[parents[i], :i] | (np.arange(i) == parents[i])):
                return None
    if np.array_equal(depth, np.arange(n)):
        return None
    return lane_slots(parents)


def lane_slots(parents) -> np.ndarray:
    """Each node's slot: the first free one after its parent's that is its depth modulo LANES (a root: 0 mod LANES),
    in node order, so that siblings keep their order. lane_slots([-1, 0, 0, 1]) == [0, 1, 17, 2]."""
    used: set[int] = set()
    slots = np.zeros(len(parents), np.int64)
    depth = np.zeros(len(parents), np.int64)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
        s = 0 if p < 0 else slots[p] + 1
        s += (depth[i] - s) % LANES
        while s in used:
            s += LANES
        used.add(s)
        slots[i] = s
    slots.flags.writeable = False
    return slots
