"""A draft model: a small causal LM with the target's vocabulary (or the target's first layers) and its own
in-place KV cache drafts a chain, or a tree with `draft_branching[d]` children per node at depth d (its top-k; a
sampled chain when sampling, which keeps the target's distribution exactly). Under structured output it drafts only
what the grammar allows after each node's path (its logits masked as the target's rows are), so its drafts can be
accepted."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from specexport.errors import UserError
from specexport.options import from_section, setting, with_given
from specexport.runtime import drafting, tree
from specexport.runtime.drafting import DraftCall, DraftingProposer
from specexport.runtime.grammar import Matcher
from specexport.runtime.sampling import SamplingParams, probabilities, sample
from specexport.runtime.tree import MAX_DRAFT_LENGTH, AcceptMode, DraftTree, check_draft_length


@dataclass(frozen=True)
class Settings:
    draft_length: int = setting(4, "draft: draft tokens per step (the depth of the draft's tree).")
    draft_branching: tuple[int, ...] = setting(
        (), "draft: children per node at each depth, e.g. 2,1,1 (past the given depths, a chain; default a chain).",
        flags=("--draft-tree",))

    @property
    def branching(self) -> tuple[int, ...]:
        """Children per node for each of the draft_length depths: the given ones, cut or extended by chain links."""
        return (self.draft_branching + (1,) * self.draft_length)[:self.draft_length]

    @property
    def drafts(self) -> int:
        return int(np.cumprod(self.branching).sum())


class DraftModel(DraftingProposer):
    def __init__(self, session, branching: tuple[int, ...], sampling: SamplingParams, rng: np.random.Generator,
                 grammar: Matcher | None = None):
        self.session = session
        self.branching = tuple(branching)
        self.sampling, self.rng, self.grammar = sampling, rng, grammar
        self.sampled = not sampling.greedy and all(b == 1 for b in self.branching)
        self.max_drafts = int(np.cumprod(self.branching).sum())
        self.extra_rows = self.max_drafts  # rows past the target's that the cache takes (the tree's nodes)
        self.cache = None
        self.root_row = 0  # the draft cache's row of the step's root (the last history row)
        self.forwarded = 0  # tree nodes whose K/V are in the draft cache after root_row (the root included)

    def start(self, prompt_len: int, capacity: int, cache=None) -> None:
        self.cache = drafting.own_cache(self, capacity, cache)

    def drafting(self, history: list[int]):
        """`propose` as a generator of its draft calls (runtime/drafting.py)."""
        new = history[self.cache.length:]  # committed since the last step (the root is last)
        logits = yield from self._forward(new, tree.chain(len(new)), self.cache.length, first=0, rows=[len(new) - 1])
        self.root_row, self.forwarded = self.cache.length - 1, 1
        tokens, parents = [history[-1]], [-1]
        q = np.zeros((self.max_drafts + 1, logits.shape[-1])) if self.sampled else None
        frontier, paths = [(0, logits[0])], [[]]  # paths: each node's drafts from the root's child down
        for depth, width in enumerate(self.branching):
            level = len(tokens)
            for node, row in frontier:
                picks, dist = self._pick(row, width, paths[node])
                if dist is not None:
                    q[node] = dist
                tokens += picks
                parents += [node] * len(picks)
                paths += [paths[node] + [t] for t in picks]
            if len(tokens) == level:  # the grammar allows nothing more here
                break
            if depth == len(self.branching) - 1:
                break
            created = list(range(level, len(tokens)))  # one draft call for the whole level
            rows = yield from self._forward([tokens[i] for i in created], parents, self.root_row, first=level,
                                            rows=range(len(created)))
            frontier = list(zip(created, rows))
            self.forwarded = len(tokens)
        return DraftTree(tokens, parents, AcceptMode.WITH_REPLACEMENT if self.sampled else AcceptMode.TOPK, q)

    def accepted(self, path: list[int]) -> None:
        """Keep the draft's K/V rows of the accepted nodes it computed (the root and all but the last level)."""
        self.cache.rewind(self.root_row)
        self.cache.commit([n for n in path if n < self.forwarded])

    def _pick(self, logits: np.ndarray, width: int, path: list[int]) -> tuple[list[int], np.ndarray | None]:
        """A node's children from its draft logits (the grammar's allowed tokens only, after `path`, where there is
        one): a sample (with the distribution it was drawn from), or the top `width`."""
        if self.grammar is not None:
            allowed = self.grammar.allowed(path)
            if allowed is None or not allowed.any():
                return [], None
            logits = np.where(allowed[:logits.shape[-1]], logits, -np.inf)
            width = min(width, int(allowed.sum()))
        if self.sampled:
            dist = probabilities(logits, self.sampling)
            return [sample(dist, self.rng.random())], dist
        if width == 1:
            return [int(np.argmax(logits))], None
        top = np.argpartition(logits, -width)[-width:]
        return [int(t) for t in top[np.argsort(-logits[top], kind="stable")]], None

    def _forward(self, ids: list[int], parents, past: int, first: int, rows):
        """Append nodes first.. of a tree whose node 0 sits at row `past` (nodes before `first` are cached right
        after it); returns the logits of `rows` (a generator: the call is yielded, runtime/drafting.py)."""
        out = yield DraftCall(list(ids), past + tree.depths(parents)[first:], tree.ancestor_mask(parents)[first:],
                              list(rows), ("logits",))
        self.cache.advance(len(ids))
        return out["logits"]


class Draft:
    Settings = Settings
    profile_section = "draft"

    def settings(self, section: dict, given: dict) -> Settings:
        s = with_given(from_section(Settings, section, "the bundle's draft settings"), given, "draft")
        check_draft_length(s.draft_length)
        given_tree = given.get("draft_branching", ())
        if len(given_tree) > s.draft_length or any(not 1 <= b <= 8 for b in s.draft_branching):
            raise UserError(f"--draft-tree must give 1..8 children for at most --draft-length ({s.draft_length}) "
                            f"depths, got {','.join(map(str, s.draft_branching))}")
        if s.drafts > MAX_DRAFT_LENGTH:
            raise UserError(f"--draft-tree {','.join(map(str, s.branching))} makes {s.drafts} nodes; at most "
                            f"{MAX_DRAFT_LENGTH}")
        trimmed = list(s.branching)
        while trimmed and trimmed[-1] == 1:  # chain links past the last branching depth are implied
            trimmed.pop()
        return dataclasses.replace(s, draft_branching=tuple(trimmed))

    def proposer(self, engine, settings: Settings, sampler) -> DraftModel:
        return DraftModel(engine.graph("draft"), settings.branching, sampler.params, sampler.rng, sampler.grammar)

    def describe(self, settings: Settings) -> str:
        return f"draft length {settings.draft_length}"

    def tree_info(self, settings: Settings) -> dict:
        return {"tokens_per_step": settings.drafts + 1, "depth": settings.draft_length}

    def tokens_per_step(self, settings: Settings) -> int:
        return settings.drafts + 1


METHOD = Draft()
