"""EAGLE draft trees as pure code, apart from the model calls.

The proposer grows a `CandidateTree` level by level from the draft's top-k at each fed node, and asks it which
nodes to feed next and which to verify:

- dynamic (EAGLE-2/3): every node's score is its cumulative draft log-probability (the sum along its path, an
  estimate of the chance the target accepts the whole path). Each level feeds the `top_k` best new candidates
  (`top`); after `depth` levels the `total` best of all candidates are verified (`select`), which is always an
  ancestor-closed set because a child never scores above its parent (ties go to the earlier node).
- static (EAGLE-1): a fixed shape given as paths of ranks ([[0], [1], [0, 0], ...], rank r = the draft's r-th
  choice below the parent); every node with children is fed, every node is verified (`StaticTree`).
"""

from __future__ import annotations

import json
from pathlib import Path

from specexport.errors import UserError, read_user_text

# EAGLE-1's static tree (EAGLE v1 `mc_sim_7b_63`, 25 nodes + root, depth 5) and a small one for CPUs.
STATIC_PRESETS = {
    "eagle1_25": [[0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [2, 1], [3, 0], [0, 0, 0],
                  [0, 0, 1], [0, 0, 2], [0, 1, 0], [0, 1, 1], [0, 2, 0], [0, 2, 1], [1, 0, 0], [0, 0, 0, 0],
                  [0, 0, 0, 1], [0, 0, 0, 2], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]],
    "chain_5": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0, 0]],
}
MAX_DEPTH, MAX_TOTAL = 16, 256


class CandidateTree:
    """Draft candidates below the root: token, parent (-1 = the root), cumulative score, depth (1 = a root child)."""

    def __init__(self):
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []
        self.depths: list[int] = []

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, tokens, logps) -> list[int]:
        """Children of `parent` with their draft log-probs; returns their indices."""
        base = self.scores[parent] if parent >= 0 else 0.0
        depth = self.depths[parent] + 1 if parent >= 0 else 1
        first = len(self.tokens)
        for t, lp in zip(tokens, logps):
            self.tokens.append(int(t))
            self.parents.append(parent)
            self.scores.append(base + float(lp))
            self.depths.append(depth)
        return list(range(first, len(self.tokens)))

    def top(self, indices, k: int) -> list[int]:
        """The k best of `indices` by score (ties: the earlier node), in index order."""
        best = sorted(indices, key=lambda i: (-self.scores[i], i))[:k]
        return sorted(best)

    def select(self, n: int) -> tuple[list[int], list[int], list[int]]:
        """The n best candidates, reranked into a tree: (candidate indices, tokens, parents relative to the
        selection: -1 = the root), parents before children."""
        chosen = self.top(range(len(self.tokens)), n)
        return self._subtree(chosen)

    def _subtree(self, chosen: list[int]) -> tuple[list[int], list[int], list[int]]:
        where = {c: k for k, c in enumerate(chosen)}
        parents = []
        for c in chosen:
            p = self.parents[c]
            if p >= 0 and p not in where:
                raise ValueError(f"candidate {c} selected without its parent {p}")
            parents.append(where[p] if p >= 0 else -1)
        return chosen, [self.tokens[c] for c in chosen], parents


class StaticTree:
    """A fixed tree of ranks: which nodes to feed at each level and which ranks to keep below each."""

    def __init__(self, paths: list[list[int]], name: str = "tree"):
        check_paths(paths, name)
        self.paths = sorted((tuple(p) for p in paths), key=lambda p: (len(p), p))
        self.depth = max(len(p) for p in self.paths)
        self.size = len(self.paths)
        self.max_rank = max(max(p) for p in self.paths)

    def ranks_below(self, path: tuple[int, ...]) -> list[int]:
        """Ranks kept below the node at `path` (() = the root), ascending."""
        return sorted(p[-1] for p in self.paths if len(p) == len(path) + 1 and p[:-1] == path)

    def grow(self, candidates: CandidateTree, node_path: dict[int, tuple], parent: int, tokens, logps) -> list[int]:
        """Add the kept ranks below `parent` (a candidate, or -1) to `candidates`; returns the new indices."""
        path = node_path[parent]
        ranks = self.ranks_below(path)
        made = candidates.add(parent, [tokens[r] for r in ranks], [logps[r] for r in ranks])
        for index, r in zip(made, ranks):
            node_path[index] = path + (r,)
        return made

    def has_children(self, path: tuple[int, ...]) -> bool:
        return any(len(p) == len(path) + 1 and p[:-1] == path for p in self.paths)


def check_paths(paths, name: str) -> None:
    if not isinstance(paths, list) or not paths:
        raise UserError(f"{name}: a static tree is a non-empty list of paths of ranks, e.g. [[0], [1], [0, 0]]")
    seen = set()
    for p in paths:
        if not isinstance(p, list) or not p or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in p):
            raise UserError(f"{name}: each path must be a non-empty list of ranks >= 0, got {p!r}")
        if len(p) > MAX_DEPTH:
            raise UserError(f"{name}: path {p} is deeper than {MAX_DEPTH}")
        seen.add(tuple(p))
    missing = [list(p[:-1]) for p in seen if len(p) > 1 and p[:-1] not in seen]
    if missing:
        raise UserError(f"{name}: path {missing[0]} is missing (every prefix of a path must be a path)")
    if len(seen) != len(paths):
        raise UserError(f"{name}: a path is listed twice")
    if len(paths) >= MAX_TOTAL:
        raise UserError(f"{name}: {len(paths)} nodes; at most {MAX_TOTAL - 1}")


def parse_static(spec: str) -> StaticTree:
    """A static tree: a preset name, a JSON file, or inline JSON."""
    if spec in STATIC_PRESETS:
        return StaticTree(STATIC_PRESETS[spec], spec)
    text = spec
    if not spec.lstrip().startswith("["):
        path = Path(spec)
        if path.suffix == ".json" and not path.is_file():
            raise UserError(f"EAGLE tree file {spec} not found")
        if not path.is_file():
            raise UserError(f"unknown EAGLE tree '{spec}': use 'dynamic', a preset ({', '.join(STATIC_PRESETS)}), "
                            "a JSON file or inline JSON paths")
        text = read_user_text(path, "an EAGLE tree in JSON")
    try:
        paths = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"EAGLE tree {spec[:40]!r}: not valid JSON ({e.msg})") from None
    return StaticTree(paths, spec[:40])


def check_dynamic(depth: int, top_k: int, total_tokens: int, graph_top_k: int) -> None:
    """One clear line for impossible EAGLE-2 settings."""
    if not 1 <= depth <= MAX_DEPTH:
        raise UserError(f"--depth must be in 1..{MAX_DEPTH}, got {depth}")
    if not 1 <= top_k <= graph_top_k:
        raise UserError(f"--top-k must be in 1..{graph_top_k} (the bundle's draft graph returns {graph_top_k}), got {top_k}")
    most = top_k + (depth - 1) * top_k * top_k + 1
    if not 2 <= total_tokens <= min(MAX_TOTAL, most):
        raise UserError(f"--total-tokens must be in 2..{min(MAX_TOTAL, most)} for depth {depth} and top-k {top_k} "
                        f"(the root and the candidates drafted), got {total_tokens}")
