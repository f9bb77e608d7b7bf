"""EAGLE-1/2/3: a one-layer draft decoder over the target's features, with its own in-place KV cache.

The draft's cache holds one row per committed position t: (feature of t, token t + 1). Each step first feeds the
pairs committed since the last step (the features `observe`d from the target's last call, and the tokens after
them, the root last), then grows a tree from the last row: `depth` levels, each one draft call over the nodes to
expand. Dynamic (EAGLE-2): every candidate's score is its cumulative draft log-probability (an estimate of the
chance the target accepts its whole path); each level expands the `top_k` best new candidates, and after `depth`
levels the `total_tokens - 1` best of all are verified, an ancestor-closed set because a child never scores above
its parent (ties go to the earlier node). Static (EAGLE-1): a fixed rank tree (runtime/rank_tree.py); every node
with children is expanded, every node verified. Tree rows in the draft cache are dropped every step; only target
features ever enter it as history.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport.errors import UserError
from specexport.options import from_section, setting, with_given
from specexport.runtime import drafting, rank_tree, tree
from specexport.runtime.drafting import DraftCall, DraftingProposer
from specexport.runtime.grammar import Matcher
from specexport.runtime.tree import DraftTree

MAX_DEPTH, MAX_TOTAL = rank_tree.MAX_DEPTH, rank_tree.MAX_NODES + 1


@dataclass(frozen=True)
class Settings:
    depth: int = setting(2, "eagle: draft levels per step. [default: the profile's, else 2]")
    top_k: int = setting(2, "eagle: candidates expanded per level. [default: the profile's, else 2]",
                         flags=("--draft-top-k", "--top-k"))
    total_tokens: int = setting(4, "eagle: tokens verified per step, the root included (EAGLE-2's total_token). "
                                   "[default: the profile's, else 4]")
    tree: str = setting("dynamic", "eagle: dynamic (EAGLE-2) or a static rank tree (a preset such as eagle1_25 or "
                                   "chain_5, a JSON file or inline JSON paths).")


class CandidateTree:
    """Candidates grown from the root (node 0: the step's root token, score 0, depth 0): token, parent, cumulative
    draft log-probability, depth."""

    def __init__(self, root: int):
        self.tokens, self.parents, self.scores, self.depths = [int(root)], [-1], [0.0], [0]

    def __len__(self) -> int:
        return len(self.tokens)

    def add(self, parent: int, tokens, logps) -> list[int]:
        """Children of `parent` with their draft log-probs; returns their indices."""
        first = len(self.tokens)
        for t, lp in zip(tokens, logps):
            self.tokens.append(int(t))
            self.parents.append(parent)
            self.scores.append(self.scores[parent] + float(lp))
            self.depths.append(self.depths[parent] + 1)
        return list(range(first, len(self.tokens)))

    def top(self, indices, k: int) -> list[int]:
        """The k best of `indices` by score (ties: the earlier node), in index order."""
        return sorted(tree.by_score(self.scores, indices)[:k])

    def cut(self, depth: int, drafts: int) -> tuple[list[int], list[int]]:
        """The tree a step verifies: the root and the `drafts` best candidates at depth <= `depth`, as (tokens,
        parents) with parents re-indexed to the selection (the root stays node 0)."""
        cut = self.draft(depth, drafts)
        return cut.tokens, cut.parents

    def draft(self, depth: int, drafts: int, candidates=None) -> DraftTree:
        """`cut` as the step's DraftTree, its nodes scored by their cumulative log-probability (`candidates`: what
        to keep for `specexport profile`, by default this tree)."""
        chosen = [0] + self.top([i for i in range(1, len(self)) if self.depths[i] <= depth], drafts)
        tokens, parents = tree.subtree(self.tokens, self.parents, chosen)
        return DraftTree(tokens, parents, candidates=self if candidates is None else candidates,
                         scores=[self.scores[i] for i in chosen])


class Eagle(DraftingProposer):
    def __init__(self, session, settings: Settings, static: rank_tree.RankTree | None, grammar: Matcher | None = None):
        self.session, self.static, self.grammar = session, static, grammar
        self.depth, self.top_k, self.total = settings.depth, settings.top_k, settings.total_tokens
        if static is not None:
            self.depth, self.total = static.depth, static.size
        self.max_drafts = self.total - 1
        # rows past the target's that the cache takes: the tree's fed nodes and one row of padding
        self.extra_rows = (self.top_k * max(self.depth - 1, 0) if static is None else static.size - 1) + 1
        self.cache = None
        self.pending: list[np.ndarray] = []  # features of committed positions not yet fed to the draft
        self.fed = 0  # positions whose pair is in the draft's cache

    def wants(self, fused: bool) -> tuple[str, ...]:
        return ("eagle_features",)

    def start(self, prompt_len: int, capacity: int, cache=None) -> None:
        self.cache = drafting.own_cache(self, capacity, cache)
        self.pending, self.fed = [], 0

    def observe(self, outputs: dict, rows) -> None:
        self.pending.append(outputs["eagle_features"][0, list(rows)])

    def drafting(self, history: list[int]):
        """`propose` as a generator of its draft calls (runtime/drafting.py)."""
        feats = np.concatenate(self.pending) if self.pending else np.zeros((0, 0), np.float32)
        m = len(feats)
        if m == 0 or self.fed + m + 1 != len(history):
            raise RuntimeError(f"EAGLE draft out of step: {self.fed} fed + {m} features for {len(history)} tokens")
        self.pending = []
        self.cache.rewind(self.fed)
        out = yield self._call(history[self.fed + 1:], feats, tree.chain(m), self.fed, 0, [m - 1])
        self.cache.advance(m)
        self.fed += m
        candidates, paths = CandidateTree(history[-1]), {0: ()}
        frontier = self._grow(candidates, paths, 0, out, 0)
        hidden_of = {0: out["hidden_out"][0, m - 1]}  # a node's children are fed the draft's output at the node
        fed_parents, fed_index = [], {}  # the nodes fed so far, as a tree below the last history row (-1)
        for _ in range(self.depth - 1):
            frontier = [n for n in frontier if self.static is None or self.static.ranks_below(paths[n])]
            if not frontier:
                break
            first = len(fed_parents)
            for n in frontier:
                fed_index[n] = len(fed_parents)
                fed_parents.append(fed_index.get(candidates.parents[n], -1))
            hidden = np.stack([hidden_of[candidates.parents[n]] for n in frontier])
            out = yield self._call([candidates.tokens[n] for n in frontier], hidden, fed_parents, self.fed, first,
                                   range(len(frontier)))
            self.cache.advance(len(frontier))
            made = []
            for row, n in enumerate(frontier):
                hidden_of[n] = out["hidden_out"][0, row]
                made += self._grow(candidates, paths, n, out, row)
            frontier = made if self.static is not None else candidates.top(made, self.top_k)
        return candidates.draft(self.depth, self.total - 1)

    def _grow(self, candidates: CandidateTree, paths: dict, parent: int, out: dict, row: int) -> list[int]:
        """Add the candidates below `parent` from draft output `row`: its top_k, or the static tree's ranks; under
        structured output, only those the grammar allows after the parent's path."""
        tokens, logps = out["draft_tokens"][row], out["draft_logp"][row]
        allowed = self._allowed(candidates, parent)
        if self.static is None:
            keep = [i for i in range(min(self.top_k, len(tokens))) if allowed is None or allowed[tokens[i]]]
            return candidates.add(parent, [tokens[i] for i in keep], [logps[i] for i in keep])
        ranks = [r for r in self.static.ranks_below(paths[parent]) if allowed is None or allowed[tokens[r]]]
        made = candidates.add(parent, [tokens[r] for r in ranks], [logps[r] for r in ranks])
        paths.update({n: paths[parent] + (r,) for n, r in zip(made, ranks)})
        return made

    def _allowed(self, candidates: CandidateTree, node: int) -> np.ndarray | None:
        """The tokens the grammar allows below candidate `node` (None: no grammar); none for a path it forbids."""
        if self.grammar is None:
            return None
        path = []
        while node > 0:
            path.append(candidates.tokens[node])
            node = candidates.parents[node]
        allowed = self.grammar.allowed(path[::-1])
        return allowed if allowed is not None else np.zeros(self.grammar.vocab, bool)

    @staticmethod
    def _call(ids, hidden, parents, past: int, first: int, rows) -> DraftCall:
        """Feed nodes first.. of `parents` (a tree below row past - 1; earlier nodes are cached after it)."""
        return DraftCall(list(ids), past + tree.depths(parents)[first:], tree.ancestor_mask(parents)[first:],
                         list(rows), ("hidden_out", "draft_logp", "draft_tokens"), {"hidden": hidden})


class EagleMethod:
    """EAGLE-1/2 (`version` 1) or EAGLE-3 (3): the same proposer over different target features."""

    Settings = Settings
    profile_section = "eagle"

    def __init__(self, version: int):
        self.version = version

    def settings(self, section: dict, given: dict) -> Settings:
        s = with_given(from_section(Settings, section, "the bundle's EAGLE settings"), given, "eagle")
        self.static_tree(s, section.get("graph_top_k"))
        return s

    @staticmethod
    def static_tree(s: Settings, graph_top_k: int | None) -> rank_tree.RankTree | None:
        """The static tree (None for dynamic), after one clear line for impossible settings. `graph_top_k`: the
        candidates the draft graph returns per node (None: not known yet, no bundle)."""
        if not 1 <= s.depth <= MAX_DEPTH:
            raise UserError(f"--depth must be in 1..{MAX_DEPTH}, got {s.depth}")
        if s.top_k < 1 or (graph_top_k is not None and s.top_k > graph_top_k):
            most = f"1..{graph_top_k} (the draft graph returns {graph_top_k})" if graph_top_k else ">= 1"
            raise UserError(f"--draft-top-k must be in {most}, got {s.top_k}")
        most = s.top_k + (s.depth - 1) * s.top_k * s.top_k + 1
        if not 2 <= s.total_tokens <= min(MAX_TOTAL, most):
            raise UserError(f"--total-tokens must be in 2..{min(MAX_TOTAL, most)} for depth {s.depth} and top-k "
                            f"{s.top_k} (the root and the candidates drafted), got {s.total_tokens}")
        return None if s.tree == "dynamic" else rank_tree.parse(s.tree, rank_limit=graph_top_k)

    def proposer(self, engine, settings: Settings, sampler) -> Eagle:
        static = self.static_tree(settings, engine.bundle.manifest["method"]["graph_top_k"])
        return Eagle(engine.graph("draft"), settings, static, sampler.grammar)

    def describe(self, settings: Settings) -> str:
        return (f"{settings.tree} tree: depth {settings.depth}, top-k {settings.top_k}, "
                f"{self.tokens_per_step(settings)} tokens")

    def tree_info(self, settings: Settings) -> dict:
        return {"tokens_per_step": self.tokens_per_step(settings), "depth": settings.depth, "top_k": settings.top_k,
                "kind": settings.tree}

    def tokens_per_step(self, settings: Settings) -> int:
        return settings.total_tokens if settings.tree == "dynamic" else rank_tree.size_of(settings.tree)


EAGLE1, EAGLE3 = EagleMethod(1), EagleMethod(3)
MTP = EagleMethod(1)  # the target's own MTP layers: EAGLE-1's draft graph, read from the target's checkpoint
