"""Trees of draft tokens as pure data: the step's `DraftTree`, and parent lists -> depths, ancestor masks.

A tree is a list of parent indices in topological order (parent < child, -1 for a root). The step's tree is
root-inclusive: node 0 is the root (the last emitted token, not yet in the target's KV cache) and every other
node descends from it, so the same indices serve the tree mask, the verify call's rows, acceptance paths
and the cache commit. A chain is a tree with one child per node.

The mask helpers also take trees that continue a past (a draft model growing its own tree level by level):
there a -1 parent means "below the past".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from functools import lru_cache

import numpy as np

from specexport.errors import UserError

MAX_DRAFT_LENGTH = 64  # draft tokens per chain (the depth of a draft model's or a lookup's tree)

def check_draft_length(n: int) -> None:
    if not 1 <= n <= MAX_DRAFT_LENGTH:
        raise UserError(f"--draft-length must be in 1..{MAX_DRAFT_LENGTH}, got {n}")


# Additive bias for a hidden position: finite, so that a row is never all -inf in any dtype.
HIDDEN = np.float32(-1e9)


class AcceptMode(Enum):
    """How a tree's drafts were chosen, which decides the exact acceptance rule (runtime/verify.py)."""

    TOPK = "topk"  # deterministic candidates (a draft's top-k, lookups, Medusa heads, EAGLE): point masses
    WITH_REPLACEMENT = "with_replacement"  # children drawn i.i.d. from q (SpecInfer)
    WITHOUT_REPLACEMENT = "without_replacement"  # children drawn one after another, earlier ones removed
    TYPICAL = "typical"  # Medusa's typical acceptance: LOSSY when sampling, never fused into the graph


@dataclass(frozen=True)
class DraftTree:
    """One step's tree, root first: tokens[0] is the root and parents[0] is -1; parents[i] < i otherwise.

    `q` [len, V], for sampled drafts only: row r is the processed draft distribution node r's children were drawn
    from. `candidates`: what the proposer chose the tree from (Medusa: its heads' ranked tokens; EAGLE: the scored
    candidate tree), kept for `specexport profile`, which replays other trees on the same steps. `scores`: where the
    proposer estimates how likely each node is to be accepted (EAGLE's cumulative draft probability, suffix lookup's
    product of continuation frequencies), that estimate's log, node by node (the root's 0; a node's never above its
    parent's): the tree budget calibrates it (runtime/budget.py) and `truncated` keeps the best nodes by it, which
    renumbers them (a proposer whose `accepted(path)` reads its own tree's node numbers, a draft model's, scores
    none)."""

    tokens: list[int]
    parents: list[int]
    mode: AcceptMode = AcceptMode.TOPK
    q: np.ndarray | None = None
    candidates: object = None
    scores: list[float] | None = None

    @classmethod
    def root_only(cls, root: int) -> "DraftTree":
        return cls([int(root)], [-1])

    def __len__(self) -> int:
        """Tokens verified by the step: the root and the drafts."""
        return len(self.tokens)

    @property
    def drafts(self) -> int:
        return len(self.tokens) - 1

    def best_first(self) -> list[int]:
        """The nodes in the order `truncated` keeps them: `by_score` (a node scores at most its parent, so every
        prefix of the order is ancestor-closed), or in index order unscored."""
        if self.scores is None:
            return list(range(len(self.tokens)))
        return [0] + by_score(self.scores, range(1, len(self.tokens)))

    def truncated(self, n: int) -> "DraftTree":
        """The root and its n - 1 best nodes (`best_first`): still a tree, parents before children."""
        if n >= len(self.tokens):
            return self
        if self.scores is None:
            q = None if self.q is None else self.q[:n]
            return DraftTree(self.tokens[:n], self.parents[:n], self.mode, q, self.candidates)
        return self.kept(sorted(self.best_first()[:n]))

    def kept(self, keep: list[int]) -> "DraftTree":
        """The nodes `keep` (ascending, ancestor-closed, the root included), renumbered: still a tree."""
        if len(keep) == len(self.tokens):
            return self
        tokens, parents = subtree(self.tokens, self.parents, keep)
        q = None if self.q is None else self.q[keep]
        scores = None if self.scores is None else [self.scores[i] for i in keep]
        return DraftTree(tokens, parents, self.mode, q, self.candidates, scores)


def by_score(scores, nodes) -> list[int]:
    """`nodes` best first by their `scores` (ties: the earlier node, so a parent scored as its child comes first)."""
    return sorted(nodes, key=lambda i: (-scores[i], i))


def check_parents(parents) -> np.ndarray:
    parents = np.asarray(parents, dtype=np.int64).reshape(-1)
    if parents.size and not np.all((parents >= -1) & (parents < np.arange(parents.size))):
        raise ValueError(f"not a tree in topological order (parent must be -1 or an earlier index): {parents.tolist()}")
    return parents


def chain(n: int) -> np.ndarray:
    """Parents of a chain of n tokens: [-1, 0, 1, ...]."""
    return np.arange(-1, n - 1, dtype=np.int64)


def depths(parents) -> np.ndarray:
    """Depth of each node; roots have depth 0. Read-only (kept per tree shape, see `_shape`)."""
    return _shape(_key(parents))[0]


def path_tokens(tokens, parents) -> list[list[int]]:
    """Each node's tokens from the root's child down to itself (the root's: none), e.g. tokens [9, 4, 5, 6] with
    parents [-1, 0, 0, 1] give [[], [4], [5], [4, 6]]. Parents come before their children."""
    paths: list[list[int]] = []
    for i, p in enumerate(check_parents(parents).tolist()):
        paths.append([] if p < 0 else paths[p] + [int(tokens[i])])
    return paths


def children(parents) -> list[list[int]]:
    """Children of each node, in index order: children([-1, 0, 0, 1]) == [[1, 2], [3], [], []]."""
    parents = check_parents(parents)
    kids: list[list[int]] = [[] for _ in range(parents.size)]
    for i, p in enumerate(parents.tolist()):
        if p >= 0:
            kids[p].append(i)
    return kids


def subtree(tokens: list[int], parents: list[int], keep: list[int]) -> tuple[list[int], list[int]]:
    """The nodes `keep` (ascending, ancestor-closed, the root included) of a tree, with parents re-indexed."""
    where = {node: k for k, node in enumerate(keep)}
    return [tokens[n] for n in keep], [where[parents[n]] if parents[n] >= 0 else -1 for n in keep]


def ancestor_mask(parents) -> np.ndarray:
    """[T, T] bool: mask[i, j] is True when j is i or an ancestor of i. Read-only (kept per tree shape)."""
    return _shape(_key(parents))[1]


def _key(parents) -> tuple[int, ...]:
    return tuple(parents.tolist() if isinstance(parents, np.ndarray) else parents)


@lru_cache(maxsize=4096)
def _shape(parents: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """A tree's depths and ancestor mask, computed once per tree shape: every step of a loop asks for them, and a
    method's trees come in a few shapes (plain decoding: one)."""
    parents = check_parents(parents)
    depth = np.zeros(parents.size, dtype=np.int64)
    mask = np.eye(parents.size, dtype=bool)
    for i, p in enumerate(parents):
        if p >= 0:
            depth[i] = depth[p] + 1
            mask[i] |= mask[p]
    depth.flags.writeable = mask.flags.writeable = False
    return depth, mask


def causal_mask(t: int) -> np.ndarray:
    """[t, t] bool: the ancestor mask of a chain of t tokens (prefill or a decode step)."""
    return np.tri(t, dtype=bool)


def attention_bias(parents, past_len: int, width: int | None = None, batch: int = 1, first: int = 0) -> np.ndarray:
    """Additive bias [batch, 1, T - first, width]: each new node sees the whole past and its own ancestors (the
    4-D mask a transformers reference takes; step graphs build it themselves from the compact mask).

    `width` defaults to past_len + T. With `first` > 0 only nodes first.. are new: nodes 0..first-1 of the tree are
    already cached right after the past (a tree grown level by level, as a draft model does).
    """
    return mask_bias(ancestor_mask(parents)[first:], past_len, width, batch)


def mask_bias(visible: np.ndarray, past_len: int, width: int | None = None, batch: int = 1) -> np.ndarray:
    """The wide additive bias [batch, 1, rows, width] of a compact mask `visible` [rows, K] whose K columns follow
    the `past_len` rows every row sees."""
    rows, nodes = visible.shape
    width = past_len + nodes if width is None else width
    if width < past_len + nodes:
        raise ValueError(f"bias width {width} < past {past_len} + tree {nodes}")
    bias = np.full((batch, 1, rows, width), HIDDEN, dtype=np.float32)
    bias[..., :past_len] = 0.0
    bias[..., past_len:past_len + nodes] = np.where(visible, 0.0, HIDDEN)
    return bias
