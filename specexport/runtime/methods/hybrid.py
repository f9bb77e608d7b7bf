"""Hybrid: EAGLE-3's dynamic tree and suffix lookup's continuations merged into one verification tree.

Each step the EAGLE draft grows its candidate tree (runtime/methods/eagle.py: `depth` levels, `top_k` expanded per
level, every candidate scored by its cumulative draft log-probability), and suffix lookup finds its continuations
(runtime/methods/suffix.py); the continuations are merged into the candidate tree (a path both propose is one
branch; a node's score is its parent's plus the log of its continuation frequency, the better score where both
have it), and the step verifies the best `total_tokens - 1` nodes: the node budget, which a hardware profile sets
(deep and narrow where verification is expensive). The EAGLE draft's own cache holds committed positions only, so
nodes it never proposed cost it nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specexport.errors import UserError
from specexport.options import from_section, setting, with_given
from specexport.runtime.drafting import DraftingProposer
from specexport.runtime.methods import eagle, suffix


def _suffix_setting(name: str):
    """The suffix method's setting of this name, with its default and help."""
    f = suffix.Settings.__dataclass_fields__[name]
    return dataclasses.field(default=f.default, metadata=f.metadata)


@dataclass(frozen=True)
class Settings:
    depth: int = setting(3, "hybrid: EAGLE draft levels per step.")
    top_k: int = setting(2, "hybrid: EAGLE candidates expanded per level.", flags=("--draft-top-k", "--top-k"))
    total_tokens: int = setting(6, "hybrid: tokens verified per step at most, the root included (the node budget "
                                   "shared by EAGLE's candidates and suffix continuations).")
    match_factor: float = _suffix_setting("match_factor")
    min_prob: float = _suffix_setting("min_prob")
    no_datastore: bool = _suffix_setting("no_datastore")
    store_tokens: int = _suffix_setting("store_tokens")

    def __post_init__(self):
        self.suffix_settings()
        if not 1 <= self.depth <= eagle.MAX_DEPTH or self.top_k < 1:
            raise UserError(f"--depth must be in 1..{eagle.MAX_DEPTH} and --draft-top-k >= 1, got {self.depth} and "
                            f"{self.top_k}")

    def eagle_settings(self) -> eagle.Settings:
        """EAGLE's part: a dynamic tree whose every candidate is kept (the hybrid cuts the merged tree)."""
        most = min(eagle.MAX_TOTAL, self.top_k + (self.depth - 1) * self.top_k * self.top_k + 1)
        return eagle.Settings(depth=self.depth, top_k=self.top_k, total_tokens=most, tree="dynamic")

    def suffix_settings(self) -> suffix.Settings:
        return suffix.Settings(total_tokens=self.total_tokens, match_factor=self.match_factor, min_prob=self.min_prob,
                               no_datastore=self.no_datastore, store_tokens=self.store_tokens)


class HybridProposer(DraftingProposer):
    def __init__(self, draft: eagle.Eagle, lookup: suffix.SuffixLookup, s: Settings):
        self.draft, self.lookup = draft, lookup
        self.total = s.total_tokens
        self.max_drafts = s.total_tokens - 1

    def wants(self, fused: bool) -> tuple[str, ...]:
        return self.draft.wants(fused)

    # its draft graph is EAGLE's (runtime/drafting.py)
    session = property(lambda self: self.draft.session)
    extra_rows = property(lambda self: self.draft.extra_rows)
    cache = property(lambda self: self.draft.cache, lambda self, cache: setattr(self.draft, "cache", cache))

    def start(self, prompt_len: int, capacity: int, cache=None) -> None:
        self.draft.start(prompt_len, capacity, cache)
        self.lookup.start(prompt_len, capacity)

    def observe(self, outputs: dict, rows) -> None:
        self.draft.observe(outputs, rows)

    def accepted(self, path: list[int]) -> None:
        self.lookup.accepted(path)  # (the accepted drafts into the engine's response store)

    def drafting(self, history: list[int]):
        """`propose` as a generator of its draft calls (runtime/drafting.py)."""
        grown = yield from self.draft.drafting(history)
        c = suffix.Candidates(self.lookup.drafts(history), grown.candidates)
        self.lookup.tree = suffix.select(history[-1], c, self.total, self.lookup.factor, self.lookup.min_prob)
        return self.lookup.tree


class Hybrid:
    Settings = Settings
    profile_section = "hybrid"

    def settings(self, section: dict, given: dict) -> Settings:
        s = with_given(from_section(Settings, section, "the bundle's hybrid settings"), given, "hybrid")
        top_k = section.get("graph_top_k")
        if top_k is not None and s.top_k > top_k:
            raise UserError(f"--draft-top-k must be in 1..{top_k} (the draft graph returns {top_k}), got {s.top_k}")
        return s

    def proposer(self, engine, settings: Settings, sampler) -> HybridProposer:
        suffix.check_profile_budget(engine, settings.total_tokens)
        draft = eagle.Eagle(engine.graph("draft"), settings.eagle_settings(), None, sampler.grammar)
        return HybridProposer(draft, suffix.lookup(engine, settings.suffix_settings(), sampler), settings)

    def describe(self, settings: Settings) -> str:
        return (f"EAGLE depth {settings.depth}, top-k {settings.top_k} + suffix factor {settings.match_factor:g}, "
                f"min prob {settings.min_prob:g}{', no datastore' if settings.no_datastore else ''}: "
                f"{settings.total_tokens} tokens")

    def tree_info(self, settings: Settings) -> dict:
        return {"tokens_per_step": settings.total_tokens, "depth": settings.depth, "top_k": settings.top_k,
                "kind": "hybrid", "match_factor": settings.match_factor, "min_prob": settings.min_prob}

    def tokens_per_step(self, settings: Settings) -> int:
        return settings.total_tokens


METHOD = Hybrid()
