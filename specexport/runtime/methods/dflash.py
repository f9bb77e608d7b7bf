"""DFlash: a block draft proposes every position of a block in one call (exporter/dflash.py).

The draft's cache holds one context row per committed position (its keys and values made from the target's
context feature there). Each step makes one call: the context rows committed since the last step (the features
`observe`d from the target's last call), then the block, [root, mask x (B - 1)], whose rows 1..`depth` give the
draft's top-k at each of the next positions. The tree verified is the best `total_tokens - 1` paths through those
per-position candidates by the sum of their log-probabilities (SGLang's DDTree: a child's score never exceeds its
parent's, so the best set is ancestor-closed); top-k 1 is the greedy chain of the block. Only context rows stay in
the cache.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, replace

import numpy as np

from specexport.errors import UserError
from specexport.options import from_section, setting, with_given
from specexport.runtime import drafting
from specexport.runtime.drafting import DraftCall, DraftingProposer
from specexport.runtime.grammar import Matcher
from specexport.runtime.tree import DraftTree

MAX_TOTAL = 64
PUBLISHED_BLOCK = 16  # z-lab's drafts' block: what a depth of 0 means before the draft is read


@dataclass(frozen=True)
class Settings:
    depth: int = setting(0, "dflash: block positions drafted per step, at most block_size - 1 (0: all of them).")
    top_k: int = setting(1, "dflash: candidates per position (1: the block's greedy chain; more: a tree of the best "
                            "paths through them).", flags=("--draft-top-k", "--top-k"))
    total_tokens: int = setting(0, "dflash: tokens verified per step, the root included (0: depth + 1 for a chain, "
                                   "else 2 * depth).")


def resolved(s: Settings, block: int, graph_top_k: int) -> tuple[int, int, int]:
    """(depth, top_k, total tokens) of settings on a draft of `block` rows, after one clear line for impossible
    settings."""
    depth = s.depth or block - 1
    if not 1 <= depth <= block - 1:
        raise UserError(f"--depth must be in 1..{block - 1} (the draft's block of {block} rows), got {s.depth}")
    if not 1 <= s.top_k <= graph_top_k:
        raise UserError(f"--draft-top-k must be in 1..{graph_top_k} (the draft graph returns {graph_top_k}), got "
                        f"{s.top_k}")
    total = s.total_tokens or (depth + 1 if s.top_k == 1 else 2 * depth)
    most = min(MAX_TOTAL, sum(s.top_k ** d for d in range(1, depth + 1)) + 1)
    if not 2 <= total <= most:
        raise UserError(f"--total-tokens must be in 2..{most} for depth {depth} and top-k {s.top_k}, got {total}")
    return depth, s.top_k, total


def best_paths(root: int, tokens: np.ndarray, logps: np.ndarray, drafts: int, allowed=None) -> DraftTree:
    """The `drafts` best paths through per-position candidates (tokens, logps [depth, k], best first), as a tree
    under `root`: best-first over (parent, next position, rank), a node's first child and next sibling entering
    the frontier when it is taken. `allowed(path)`: the tokens a grammar allows after a path (None: any)."""
    out_tokens, parents, scores, paths = [int(root)], [-1], [0.0], [()]
    frontier = [(-float(logps[0, 0]), 0, 0, 0)]  # (-score, parent node, position, rank)
    while frontier and len(out_tokens) <= drafts:
        neg, parent, pos, rank = heapq.heappop(frontier)
        if rank + 1 < tokens.shape[1]:  # the next sibling
            heapq.heappush(frontier, (-(scores[parent] + float(logps[pos, rank + 1])), parent, pos, rank + 1))
        token = int(tokens[pos, rank])
        if allowed is not None:
            ok = allowed(paths[parent])
            if ok is None or not ok[token]:
                continue
        out_tokens.append(token)
        parents.append(parent)
        scores.append(-neg)
        paths.append(paths[parent] + (token,))
        if pos + 1 < tokens.shape[0]:  # its first child
            node = len(out_tokens) - 1
            heapq.heappush(frontier, (-(scores[node] + float(logps[pos + 1, 0])), node, pos + 1, 0))
    return DraftTree(out_tokens, parents, scores=scores)


class DFlash(DraftingProposer):
    def __init__(self, session, settings: Settings, section: dict, grammar: Matcher | None = None):
        self.session, self.grammar = session, grammar
        self.block, self.mask_token = int(section["block_size"]), int(section["mask_token"])
        self.depth, self.top_k, self.total = resolved(settings, self.block, section["graph_top_k"])
        self.hidden = int(section["hidden"])
        self.max_drafts = self.total - 1
        self.extra_rows = self.block  # the block's rows, written past the context
        self.cache = None
        self.pending: list[np.ndarray] = []  # context features of committed positions not yet in the draft's cache
        self.fed = 0

    def wants(self, fused: bool) -> tuple[str, ...]:
        return ("dflash_context",)

    def start(self, prompt_len: int, capacity: int, cache=None) -> None:
        self.cache = drafting.own_cache(self, capacity, cache)
        self.pending, self.fed = [], 0

    def observe(self, outputs: dict, rows) -> None:
        self.pending.append(outputs["dflash_context"][0, list(rows)])

    def drafting(self, history: list[int]):
        feats = np.concatenate(self.pending) if self.pending else np.zeros((0, self.hidden), np.float32)
        m, b = len(feats), self.block
        if self.fed + m + 1 != len(history):
            raise RuntimeError(f"DFlash draft out of step: {self.fed} fed + {m} features for {len(history)} tokens")
        self.pending = []
        self.cache.rewind(self.fed)
        ids = list(history[self.fed:self.fed + m]) + [history[-1]] + [self.mask_token] * (b - 1)
        mask = np.tril(np.ones((m + b, m + b), bool))
        mask[m:] = True  # the block sees every row: the context and itself
        context = np.concatenate([feats, np.zeros((b, feats.shape[1] if m else self.hidden), feats.dtype)])
        rows = list(range(m + 1, m + 1 + self.depth))
        out = yield DraftCall(ids, self.fed + np.arange(m + b), mask, rows, ("draft_logp", "draft_tokens"),
                              {"context": context, "context_rows": np.arange(m + b) < m})
        self.cache.advance(m)
        self.fed += m
        k = self.top_k
        allowed = None if self.grammar is None else self.grammar.allowed
        draft = best_paths(history[-1], out["draft_tokens"][:, :k], out["draft_logp"][:, :k], self.total - 1, allowed)
        # the block's candidates, for `specexport profile` (tune/dflash.py)
        return replace(draft, candidates=(out["draft_tokens"], out["draft_logp"]))


class DFlashMethod:
    """The block drafter's settings and proposer."""

    Settings = Settings
    profile_section = "dflash"

    def settings(self, section: dict, given: dict) -> Settings:
        s = with_given(from_section(Settings, section, "the bundle's DFlash settings"), given, "dflash")
        if "block_size" in section:
            resolved(s, section["block_size"], section["graph_top_k"])
        return s

    def proposer(self, engine, settings: Settings, sampler) -> DFlash:
        return DFlash(engine.graph("draft"), settings, engine.bundle.manifest["method"], sampler.grammar)

    def describe(self, settings: Settings) -> str:
        return f"depth {settings.depth}, top-k {settings.top_k}, {self.tokens_per_step(settings)} tokens"

    def tree_info(self, settings: Settings) -> dict:
        return {"depth": settings.depth, "top_k": settings.top_k, "total_tokens": settings.total_tokens}

    def tokens_per_step(self, settings: Settings) -> int:
        """The most tokens a step verifies (a bundle's settings are resolved against its draft's block at build)."""
        depth = settings.depth or PUBLISHED_BLOCK - 1
        return settings.total_tokens or (depth + 1 if settings.top_k == 1 else 2 * depth)


METHOD = DFlashMethod()
