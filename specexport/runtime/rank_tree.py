"""Rank trees: a tree's shape as paths of candidate ranks, one grammar for Medusa and EAGLE-1's static trees.

A path (0, 2) is "the rank-0 candidate below the root, then the rank-2 candidate below that"; the root (the
target's own last token) is implicit. Medusa reads rank r at depth d from head d-1's candidates (whatever the
parent's token); an EAGLE draft reads it from its own top-k below the parent. Nodes are ordered by (depth, path),
so parents come before children, and node i + 1 of the step's tree is path i.

`--tree` takes a preset name, a JSON file, inline JSON (a list of paths), or auto:N (the N nodes with the best
expected acceptance, from measured per-rank accuracies: Medusa heads trained here carry them).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specexport.errors import UserError, read_user_text

PRESETS = {
    # FasterDecoding/Medusa's published 63-node trees (medusa/model/medusa_choices.py), for 7B models on GPUs
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
    # EAGLE-1's static tree (EAGLE v1 mc_sim_7b_63 for its draft: 25 nodes + root, depth 5)
    "eagle1_25": [
        (0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1), (3, 0), (0, 0, 0),
        (0, 0, 1), (0, 0, 2), (0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 0, 0), (0, 0, 0, 0), (0, 0, 0, 1),
        (0, 0, 0, 2), (0, 0, 0, 0, 0), (0, 0, 0, 0, 1),
    ],
    # small trees for CPUs and small GPUs, where every verified token costs: chains and shallow bushes
    "chain_3": [(0,), (0, 0), (0, 0, 0)],
    "chain_5": [(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0, 0)],
    "small_7": [(0,), (1,), (2,), (0, 0), (1, 0), (0, 0, 0), (0, 0, 0, 0)],
    "small_15": [(0,), (1,), (2,), (3,), (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (0, 0, 0), (0, 0, 1),
                 (0, 1, 0), (1, 0, 0), (0, 0, 0, 0)],
}
MAX_NODES = 255  # a step verifies at most 256 tokens, the root included
MAX_DEPTH = 16


@dataclass(frozen=True)
class RankTree:
    paths: tuple[tuple[int, ...], ...]  # sorted by (depth, path); node i + 1 of the step's tree is paths[i]

    @property
    def size(self) -> int:
        """Tokens verified per step: the root and every path."""
        return len(self.paths) + 1

    @property
    def depth(self) -> int:
        return max(len(p) for p in self.paths)

    @property
    def top_k(self) -> int:
        """Candidates needed per node (or per Medusa head): the largest rank used, plus one."""
        return max(max(p) for p in self.paths) + 1

    @property
    def parents(self) -> list[int]:
        """The step tree's parents, root first (-1)."""
        index = {p: i + 1 for i, p in enumerate(self.paths)}
        return [-1] + [index.get(p[:-1], 0) for p in self.paths]

    def medusa_tokens(self, root: int, candidates: np.ndarray) -> list[int]:
        """The step tree's tokens, root first, from Medusa heads' candidates [heads, top_k] (best first)."""
        return [int(root)] + [int(candidates[len(p) - 1, p[-1]]) for p in self.paths]

    def ranks_below(self, path: tuple[int, ...]) -> list[int]:
        """Ranks kept below the node at `path` (() = the root), ascending."""
        return sorted(p[-1] for p in self.paths if len(p) == len(path) + 1 and p[:-1] == path)

    def as_lists(self) -> list[list[int]]:
        return [list(p) for p in self.paths]


def make(paths, where: str = "tree", depth_limit: int | None = None, rank_limit: int | None = None) -> RankTree:
    """Check paths and sort them: non-empty lists of ranks >= 0, no duplicates, every prefix present, at most
    MAX_NODES; depth within `depth_limit` (Medusa: its heads), ranks below `rank_limit` (the graph's candidates)."""
    if not isinstance(paths, (list, tuple)) or not paths:
        raise UserError(f"{where}: a tree needs at least one path of ranks, such as [[0], [1], [0, 0]]")
    seen = []
    for p in paths:
        if not isinstance(p, (list, tuple)) or not p or not all(_rank(r) for r in p):
            raise UserError(f"{where}: each path must be a non-empty list of ranks >= 0, got {p!r:.40}")
        seen.append(tuple(p))
    if len(set(seen)) != len(seen):
        raise UserError(f"{where}: path {list(next(p for p in seen if seen.count(p) > 1))} appears twice")
    if len(seen) > MAX_NODES:
        raise UserError(f"{where}: {len(seen)} paths; at most {MAX_NODES}")
    present, most_depth = set(seen), min(depth_limit or MAX_DEPTH, MAX_DEPTH)
    for p in seen:
        if len(p) > 1 and p[:-1] not in present:
            raise UserError(f"{where}: path {list(p)} has no parent {list(p[:-1])} (every prefix must be a path)")
        if len(p) > most_depth:
            what = f"there are only {depth_limit} heads" if depth_limit else f"at most depth {MAX_DEPTH}"
            raise UserError(f"{where}: path {list(p)} is {len(p)} deep; {what}")
        if rank_limit is not None and max(p) >= rank_limit:
            raise UserError(f"{where}: path {list(p)} uses rank {max(p)}; the graph gives {rank_limit} candidates")
    return RankTree(tuple(sorted(seen, key=lambda p: (len(p), p))))


def _rank(r) -> bool:
    return isinstance(r, int) and not isinstance(r, bool) and r >= 0


def parse(spec: str, depth_limit: int | None = None, rank_limit: int | None = None,
          rank_accuracy: list[list[float]] | None = None) -> RankTree:
    """A tree from `--tree`: a preset name, inline JSON, a JSON file (a list of paths, or an object with
    "choices"), or auto:N (N nodes from `rank_accuracy`[depth][rank])."""
    spec = spec.strip()
    if spec in PRESETS:
        return make(PRESETS[spec], f"tree '{spec}'", depth_limit, rank_limit)
    if spec.startswith("auto"):
        count = spec.partition(":")[2]
        if not count.isdigit() or not 1 <= int(count) <= MAX_NODES:
            raise UserError(f"tree '{spec}': auto:N needs N in 1..{MAX_NODES}")
        if not rank_accuracy:
            raise UserError(f"tree '{spec}' needs per-rank accuracies (Medusa heads trained by specexport carry "
                            f"them); pick a preset ({', '.join(PRESETS)}) or a JSON file")
        rows = [row[:rank_limit] for row in rank_accuracy[:depth_limit]]
        return make(from_accuracy(rows, int(count)).paths, spec, depth_limit, rank_limit)
    if spec.startswith("["):
        return make(_json(spec, "inline tree"), "inline tree", depth_limit, rank_limit)
    path = Path(spec)
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise UserError(f"tree file {path} not found")
        data = _json(read_user_text(path, "a tree in JSON"), f"tree file {path}")
        if isinstance(data, dict):
            data = data.get("choices", data.get("medusa_choices"))
        return make(data, str(path), depth_limit, rank_limit)
    raise UserError(f"unknown tree '{spec[:40]}': use a preset ({', '.join(PRESETS)}), a .json file, inline JSON "
                    "paths, or auto:N")


def _json(text: str, where: str):
    try:
        return json.loads(text)
    except ValueError as e:
        raise UserError(f"{where}: not valid JSON ({str(e)[:80]})") from None


def size_of(spec: str) -> int:
    """Tokens per step of a tree spec without resolving auto:N (which needs accuracies): N + 1."""
    spec = spec.strip()
    if spec.startswith("auto:") and spec[5:].isdigit():
        return int(spec[5:]) + 1
    return parse(spec).size


def from_accuracy(rank_accuracy: list[list[float]], nodes: int) -> RankTree:
    """The `nodes` paths that maximise the expected accept length when rank r at depth d is right with
    probability rank_accuracy[d][r], independently per depth: a path's value is the product along it, which never
    grows with depth, so adding the best open child each time is optimal."""
    acc = [list(map(float, row)) for row in rank_accuracy]
    if nodes < 1:
        raise UserError(f"a tree needs at least 1 node, got {nodes}")
    if not acc or not all(acc):
        raise UserError("no accuracies to build a tree from")
    chosen: dict[tuple[int, ...], float] = {}
    frontier = {(r,): acc[0][r] for r in range(len(acc[0]))}
    while len(chosen) < nodes and frontier:
        best = max(frontier, key=lambda p: (frontier[p], -len(p), tuple(-x for x in p)))
        value = frontier.pop(best)
        chosen[best] = value
        if len(best) < len(acc):
            for r, a in enumerate(acc[len(best)]):
                frontier[best + (r,)] = value * a
    return make(list(chosen))


def expected_accept_length(tree: RankTree, rank_accuracy: list[list[float]]) -> float:
    """1 (the bonus token) + the sum over nodes of the product of accuracies along the path."""
    total = 1.0
    for p in tree.paths:
        total += float(np.prod([rank_accuracy[d][r] if r < len(rank_accuracy[d]) else 0.0 for d, r in enumerate(p)]))
    return total
