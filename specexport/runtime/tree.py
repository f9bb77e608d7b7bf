"""Trees of draft tokens as pure data: parent lists -> depths, attention bias, paths.

A tree is a list of parent indices in topological order (parent < child; -1 for a root, i.e. a
node whose parent is the last committed token). A chain is a tree with one child per node.
"""

from __future__ import annotations

import numpy as np

# Additive bias for a hidden position: finite, so that a row is never all -inf in any dtype.
HIDDEN = np.float32(-1e9)


def check_parents(parents) -> np.ndarray:
    parents = np.asarray(parents, dtype=np.int64).reshape(-1)
    if parents.size and not np.all((parents >= -1) & (parents < np.arange(parents.size))):
        raise ValueError(f"not a tree in topological order (parent must be -1 or an earlier index): {parents.tolist()}")
    return parents


def chain(n: int) -> np.ndarray:
    """Parents of a chain of n tokens: [-1, 0, 1, ...]."""
    return np.arange(-1, n - 1, dtype=np.int64)


def depths(parents) -> np.ndarray:
    """Depth of each node; roots have depth 0."""
    parents = check_parents(parents)
    depth = np.zeros(parents.size, dtype=np.int64)
    for i, p in enumerate(parents):
        depth[i] = 0 if p < 0 else depth[p] + 1
    return depth


def children(parents) -> list[list[int]]:
    """Children of each node, in index order: children([-1, 0, 0, 1]) == [[1, 2], [3], [], []]."""
    parents = check_parents(parents)
    kids: list[list[int]] = [[] for _ in range(parents.size)]
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            kids[p].append(i)
    return kids


def ancestor_mask(parents) -> np.ndarray:
    """[T, T] bool: mask[i, j] is True when j is i or an ancestor of i."""
    parents = check_parents(parents)
    n = parents.size
    mask = np.eye(n, dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            mask[i] |= mask[p]
    return mask


def attention_bias(parents, past_len: int, width: int | None = None, batch: int = 1, first: int = 0) -> np.ndarray:
    """Additive bias [batch, 1, T - first, width]: each new node sees the whole past and its own ancestors.

    `width` defaults to past_len + T; a graph whose bias spans the whole cache passes its capacity.
    With `first` > 0 only nodes first.. are new: nodes 0..first-1 of the tree are already cached right
    after the past (a tree grown level by level, as a draft model does).
    """
    return _bias(ancestor_mask(parents)[first:], past_len, width, batch)


def causal_bias(past_len: int, t: int, width: int | None = None, batch: int = 1) -> np.ndarray:
    """Bias for a plain chunk of t tokens (prefill or one decode step): the tree `chain(t)`."""
    return _bias(np.tri(t, dtype=bool), past_len, width, batch)


def _bias(visible: np.ndarray, past_len: int, width: int | None, batch: int) -> np.ndarray:
    """visible: [rows, tree nodes] bool; the tree's columns follow the past's."""
    rows, nodes = visible.shape
    width = past_len + nodes if width is None else width
    if width < past_len + nodes:
        raise ValueError(f"bias width {width} < past {past_len} + tree {nodes}")
    bias = np.full((batch, 1, rows, width), HIDDEN, dtype=np.float32)
    bias[..., :past_len] = 0.0
    bias[..., past_len:past_len + nodes] = np.where(visible, 0.0, HIDDEN)
    return bias

