"""Medusa trees as data: choice lists, presets, custom JSON files, and trees built from head accuracies.

A choice is a path of ranks, one per depth: (0, 2) is "head 0's top-1 token, then head 1's top-3 token"; the
root (the target's own next token) is implicit. The node at depth d uses head d-1's candidate of rank
path[-1], whatever its parent's token. Nodes are ordered by (depth, path), so parents come first.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specexport.errors import UserError

# Published 63-node trees (FasterDecoding/Medusa, medusa/model/medusa_choices.py), for 7B GPUs.
PUBLISHED = {
    "mc_sim_7b_63": [
        (0,), (0, 0), (1,), (0, 1), (2,), (0, 0, 0), (1, 0), (0, 2), (3,), (0, 3), (4,), (0, 4), (2, 0), (0, 5),
        (0, 0, 1), (5,), (0, 6), (6,), (0, 7), (0, 1, 0), (1, 1), (7,), (0, 8), (0, 0, 2), (3, 0), (0, 9), (8,),
        (9,), (1, 0, 0), (0, 2, 0), (1, 2), (0, 0, 3), (4, 0), (2, 1), (0, 0, 4), (0, 0, 5), (0, 0, 0, 0),
        (0, 1, 1), (0, 0, 6), (0, 3, 0), (5, 0), (1, 3), (0, 0, 7), (0, 0, 8), (0, 0, 9), (6, 0), (0, 4, 0),
        (1, 4), (7, 0), (0, 1, 2), (2, 0, 0), (3, 1), (2, 2), (8, 0), (0, 5, 0), (1, 5), (1, 0, 1), (0, 2, 1),
        (9, 0), (0, 6, 0), (0, 0, 0, 1), (1, 6), (0, 7, 0),
    ],
    "vicuna_7b_stage2": [
        (0,), (0, 0), (1,), (0, 1), (0, 0, 0), (1, 0), (2,), (0, 2), (0, 0, 1), (0, 3), (3,), (0, 1, 0), (2, 0),
        (4,), (0, 0, 2), (0, 4), (1, 1), (1, 0, 0), (0, 0, 0, 0), (5,), (0, 0, 3), (0, 5), (0, 2, 0), (3, 0),
        (0, 1, 1), (0, 6), (6,), (0, 7), (0, 0, 4), (4, 0), (1, 2), (0, 8), (7,), (0, 3, 0), (0, 0, 0, 1),
        (0, 0, 5), (2, 1), (0, 0, 6), (1, 0, 1), (0, 0, 1, 0), (2, 0, 0), (5, 0), (0, 9), (0, 1, 2), (8,),
        (0, 4, 0), (0, 2, 1), (1, 3), (0, 0, 7), (0, 0, 0, 2), (0, 0, 8), (1, 1, 0), (0, 1, 0, 0), (6, 0), (9,),
        (0, 1, 3), (0, 0, 0, 3), (1, 0, 2), (0, 5, 0), (3, 1), (0, 0, 2, 0), (7, 0), (1, 4),
    ],
}
# Small trees for CPUs and small GPUs, where every verified token costs: a chain and two shallow bushes.
SMALL = {
    "chain_3": [(0,), (0, 0), (0, 0, 0)],
    "small_7": [(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0)],
    "small_15": [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1),
               (0, 1, 0), (1, 0, 0), (0, 0, 0, 0)],
}
PRESETS = {**PUBLISHED, **SMALL}
MAX_NODES = 256


@dataclass(frozen=True)
class MedusaTree:
    choices: tuple[tuple[int, ...], ...]  # sorted by (depth, path); node i + 1 is choices[i]

    @property
    def size(self) -> int:
        """Tokens verified per step: the root and every choice."""
        return len(self.choices) + 1

    @property
    def depth(self) -> int:
        return max(len(c) for c in self.choices)

    @property
    def top_k(self) -> int:
        """Candidates needed per head: the largest rank used, plus one."""
        return max(max(c) for c in self.choices) + 1

    @property
    def parents(self) -> list[int]:
        """Parent index per node, root first (-1)."""
        index = {c: i + 1 for i, c in enumerate(self.choices)}
        return [-1] + [index.get(c[:-1], 0) for c in self.choices]

    def tokens(self, root: int, candidates: np.ndarray) -> list[int]:
        """The tree's tokens, root first, from the heads' candidates [heads, top_k] (best first)."""
        return [int(root)] + [int(candidates[len(c) - 1, c[-1]]) for c in self.choices]

    def as_lists(self) -> list[list[int]]:
        return [list(c) for c in self.choices]


def make_tree(choices, heads: int | None = None, top_k: int | None = None, where: str = "tree") -> MedusaTree:
    """Check a choice list and sort it: non-empty paths of non-negative ints, no duplicates, every prefix
    present, depth within `heads`, ranks below `top_k`."""
    if not isinstance(choices, (list, tuple)) or not choices:
        raise UserError(f"{where}: a Medusa tree needs at least one choice (a list of rank paths such as [[0], [0, 0]])")
    paths = []
    for c in choices:
        if not isinstance(c, (list, tuple)) or not c or not all(isinstance(r, int) and not isinstance(r, bool) for r in c):
            raise UserError(f"{where}: each choice must be a non-empty list of ranks, got {c!r}")
        if min(c) < 0:
            raise UserError(f"{where}: ranks must be >= 0, got {list(c)}")
        paths.append(tuple(c))
    if len(set(paths)) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise UserError(f"{where}: choice {list(dup)} appears twice")
    if len(paths) > MAX_NODES:
        raise UserError(f"{where}: {len(paths)} choices; at most {MAX_NODES}")
    present = set(paths)
    for p in paths:
        if len(p) > 1 and p[:-1] not in present:
            raise UserError(f"{where}: choice {list(p)} has no parent {list(p[:-1])}")
        if heads is not None and len(p) > heads:
            raise UserError(f"{where}: choice {list(p)} needs head {len(p) - 1}, but there are only {heads} heads")
        if top_k is not None and max(p) >= top_k:
            raise UserError(f"{where}: choice {list(p)} uses rank {max(p)}; the heads give {top_k} candidates")
    return MedusaTree(tuple(sorted(paths, key=lambda p: (len(p), p))))


def tree_from_accuracy(rank_accuracy: list[list[float]], nodes: int) -> MedusaTree:
    """The `nodes` choices that maximise the expected accept length when head d's rank-r candidate is right
    with probability rank_accuracy[d][r], independently per depth: a path's value is the product along it,
    which never grows with depth, so adding the best open child each time is optimal."""
    acc = [list(map(float, row)) for row in rank_accuracy]
    if nodes < 1:
        raise UserError(f"a tree needs at least 1 node, got {nodes}")
    if not acc or not all(acc):
        raise UserError("no head accuracies to build a tree from")
    chosen: dict[tuple[int, ...], float] = {}
    frontier = {(r,): acc[0][r] for r in range(len(acc[0]))}
    while len(chosen) < nodes and frontier:
        best = max(frontier, key=lambda p: (frontier[p], -len(p), tuple(-x for x in p)))
        value = frontier.pop(best)
        chosen[best] = value
        if len(best) < len(acc):
            for r, a in enumerate(acc[len(best)]):
                frontier[best + (r,)] = value * a
    return make_tree(list(chosen))


def expected_accept_length(tree: MedusaTree, rank_accuracy: list[list[float]]) -> float:
    """1 (the bonus token) + the sum over nodes of the product of accuracies along the path."""
    total = 1.0
    for c in tree.choices:
        total += float(np.prod([rank_accuracy[d][r] if r < len(rank_accuracy[d]) else 0.0 for d, r in enumerate(c)]))
    return total


def resolve_tree(spec: str, heads: int, top_k_limit: int, rank_accuracy: list[list[float]] | None) -> MedusaTree:
    """A tree from a preset name, a JSON file or inline JSON (a list of rank paths), or `auto:N` (N nodes from
    the heads' measured per-rank accuracies)."""
    spec = spec.strip()
    if spec.startswith("["):
        try:
            return make_tree(json.loads(spec), heads, top_k_limit, "inline tree")
        except ValueError as e:
            raise UserError(f"inline tree: not valid JSON ({e})") from None
    if spec.startswith("auto"):
        count = spec.partition(":")[2] or "15"
        if not count.isdigit() or not 1 <= int(count) <= MAX_NODES:
            raise UserError(f"tree '{spec}': auto:N needs N in 1..{MAX_NODES}")
        if not rank_accuracy:
            raise UserError("tree 'auto' needs per-rank head accuracies (heads trained by specexport carry them); "
                            f"pick a preset ({', '.join(PRESETS)}) or a JSON file")
        tree = tree_from_accuracy([row[:top_k_limit] for row in rank_accuracy[:heads]], int(count))
        return make_tree(tree.choices, heads, top_k_limit, spec)
    if spec in PRESETS:
        return make_tree(PRESETS[spec], heads, top_k_limit, f"tree '{spec}'")
    path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise UserError(f"tree file {path} not found") from None
        except (OSError, ValueError) as e:
            raise UserError(f"tree file {path}: not valid JSON ({e})") from None
        if isinstance(data, dict):
            data = data.get("choices", data.get("medusa_choices"))
        return make_tree(data, heads, top_k_limit, str(path))
    raise UserError(f"unknown tree '{spec}': use a preset ({', '.join(PRESETS)}), a .json file or inline JSON of "
                    "rank paths, or auto:N")
