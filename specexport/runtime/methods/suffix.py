"""Suffix lookup (SuffixDecoding): the continuations of the longest earlier match of the context's end, in the
request's own text, in the engine's store of earlier responses, and in the bundle's datastore of the target's outputs
(runtime/suffix.py), merged into one tree under a node budget. Training-free, so it runs on any target.

Each index gives its continuations best first, scored by estimated probability (the product of continuation
frequencies along the path), as many as SuffixDecoding's adaptive length allows (match_factor x the match length)
and none below min_prob. They merge into one candidate tree (EAGLE's CandidateTree, scored by log-probability: a
node's score is its parent's plus the log of its continuation frequency; where two indexes propose a node, the
better score stays, and at equal scores the longer match's), and the step verifies the best total_tokens - 1 nodes.

The response store (runtime/suffix.ResponseStore) is the engine's, made at its first suffix proposer and kept beside
it (a table weakly keyed by the engine: it goes with the engine), bounded by the store_tokens setting: so every
request an engine serves, through `Engine.generate` (`specexport run`, bench) or the batched scheduler (`specexport
serve`), drafts from the responses of the requests before it, SuffixDecoding's cross-request tree. It holds responses,
not prompts (as SuffixDecoding's global tree: a continuation drafted should be what the target writes; prompts are
the user's text, and a conversation's prompt repeats its earlier turns, which would count them again), each after the
last LEAD_IN tokens of its prompt as context. A proposer writes its response as the generation goes: at each
`propose` the history so far, at `accepted` the step's accepted drafts (so the last step's reach the store too; only
the very last bonus token does not). A request sampled with a seed writes but does not read the store: its tokens
depend on its trees, and a seed gives the same tokens on every run (runtime/governor.py).
"""

from __future__ import annotations

import math
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass

from specexport.errors import UserError
from specexport.options import from_section, setting, with_given
from specexport.runtime import datastore as datastores
from specexport.runtime.methods.eagle import CandidateTree
from specexport.runtime.proposer import Proposer
from specexport.runtime.rank_tree import MAX_NODES
from specexport.runtime.suffix import LEAD_IN, MATCH_DEPTH, STORE_TOKENS, Draft, HistoryIndex, ResponseStore
from specexport.runtime.tree import DraftTree, subtree

MAX_TOTAL = MAX_NODES + 1
ANY_DEPTH = 1 << 30


@dataclass(frozen=True)
class Settings:
    total_tokens: int = setting(8, "suffix, hybrid: tokens verified per step at most, the root included (the node "
                                   "budget).")
    match_factor: float = setting(1.0, "suffix, hybrid: draft tokens per token of context matched (SuffixDecoding's "
                                       "adaptive length: at most factor x match length from each index).")
    min_prob: float = setting(0.1, "suffix, hybrid: leave out continuations whose estimated probability (the product "
                                   "of continuation frequencies) is below this.")
    no_datastore: bool = setting(False, "suffix, hybrid: ignore the bundle's datastore (the request's own text "
                                        "only).", build=False)
    store_tokens: int = setting(STORE_TOKENS, "suffix, hybrid: tokens of earlier responses the engine keeps to draft "
                                              "from, shared by all its requests (the least recently used dropped "
                                              "first); 0: none, each request as a fresh engine's.", build=False)

    def __post_init__(self):
        check_budget(self.total_tokens)
        if not (self.match_factor > 0 and math.isfinite(self.match_factor)) or not 0 <= self.min_prob <= 1:
            raise UserError(f"--match-factor must be > 0 and --min-prob in 0..1, got {self.match_factor} and "
                            f"{self.min_prob}")
        if self.store_tokens < 0:
            raise UserError(f"--store-tokens must be >= 0, got {self.store_tokens}")


def check_budget(total: int, limit: int = MAX_TOTAL, where: str = "") -> None:
    if not 2 <= total <= limit:
        raise UserError(f"--total-tokens (the node budget, the root included) must be in 2..{limit}{where}, "
                        f"got {total}")


@dataclass(frozen=True)
class Candidates:
    """What a step's tree was chosen from (kept on the DraftTree for `specexport profile`, which replays other
    settings on recorded steps): each index's continuations, and the hybrid's EAGLE candidate tree."""

    drafts: list[Draft]
    eagle: CandidateTree | None = None


def select(root: int, c: Candidates, total: int, factor: float, min_prob: float, eagle_depth: int = ANY_DEPTH
           ) -> DraftTree:
    """The step's tree, root first: the best `total - 1` of the merged candidates (of EAGLE's, those at most
    `eagle_depth` deep: what a run with that depth grows), scored by their log-probability, `c` kept with it. Its nodes
    are in best-first order (DraftTree.best_first), so that `truncated` keeps a prefix and their numbers: the
    acceptance path names this tree's nodes whatever the budget cut (SuffixLookup.accepted reads them)."""
    if c.eagle is None and len(c.drafts) <= 1:  # nothing to merge: a draft's first nodes are its best, root-closed
        d = c.drafts[0] if c.drafts else Draft(0, 0, [], [], [])
        k = d.allowed(factor, min_prob, total - 1)
        return DraftTree([root] + d.tokens[:k], [-1] + [p + 1 for p in d.parents[:k]], candidates=c,
                         scores=[0.0] + [min(0.0, math.log(p)) for p in d.probs[:k]])
    tree = CandidateTree(root)
    if c.eagle is not None:  # a copy: the recorded candidates stay as they were
        keep = [i for i, d in enumerate(c.eagle.depths) if d <= eagle_depth]
        tree.tokens, tree.parents = subtree(c.eagle.tokens, c.eagle.parents, keep)
        tree.scores, tree.depths = [c.eagle.scores[i] for i in keep], [c.eagle.depths[i] for i in keep]
    merge(tree, c.drafts, factor, min_prob, total - 1)
    return best_first_order(tree.draft(ANY_DEPTH, total - 1, c))


def best_first_order(t: DraftTree) -> DraftTree:
    """The same tree, its nodes renumbered in best-first order (a parent still before its children: it scores at
    least as well, and the earlier at a tie)."""
    order = t.best_first()
    at = {old: new for new, old in enumerate(order)}
    return DraftTree([t.tokens[i] for i in order], [-1] + [at[t.parents[i]] for i in order[1:]], t.mode, None,
                     t.candidates, [t.scores[i] for i in order])


def merge(tree: CandidateTree, drafts: list[Draft], factor: float, min_prob: float, limit: int) -> None:
    """Add each draft's allowed nodes to `tree`: a node's score is its parent's plus the log of its continuation
    frequency; a node already there keeps the better score."""
    where = {(p, t): i for i, (p, t) in enumerate(zip(tree.parents, tree.tokens)) if p >= 0}
    for d in drafts:
        at: list[int] = []  # the draft's nodes -> tree nodes
        for i in range(d.allowed(factor, min_prob, limit)):
            up = d.parents[i]
            parent = 0 if up < 0 else at[up]
            edge = min(0.0, math.log(d.probs[i]) - (0.0 if up < 0 else math.log(d.probs[up])))
            node = where.get((parent, d.tokens[i]))
            if node is None:
                node = where[(parent, d.tokens[i])] = tree.add(parent, [d.tokens[i]], [edge])[0]
            else:
                tree.scores[node] = max(tree.scores[node], tree.scores[parent] + edge)
            at.append(node)


class SuffixLookup(Proposer):
    """The request's text, the engine's response store (optionally; `reads`: whether its drafts come from the store
    too, else it only writes its response there) and the datastore (optionally), looked up every step."""

    def __init__(self, s: Settings, datastore: datastores.Datastore | None, store: ResponseStore | None = None,
                 reads: bool = True):
        self.total, self.factor, self.min_prob = s.total_tokens, s.match_factor, s.min_prob
        self.history = HistoryIndex()
        self.datastore = None if s.no_datastore else datastore
        self.store, self.reads = store, reads
        self.max_drafts = self.total - 1
        self.start(0, 0)

    def start(self, prompt_len: int, capacity: int, cache=None) -> None:
        self.history.reset()
        self.prompt_len = prompt_len
        self.response: int | None = None  # its number in the store, once it writes there
        self.written = 0  # tokens of its response in the store
        self.tree: DraftTree | None = None  # the last tree proposed

    def drafts(self, history: list[int]) -> list[Draft]:
        """Each index's continuations of its longest match, the longest match first (at equal scores its nodes go
        first)."""
        self.write(history)
        limit = self.total - 1
        found = [self.history.draft(history, limit, self.factor, self.min_prob)]
        if self.store is not None and self.reads:
            found.append(self.store.draft(history[-MATCH_DEPTH:], limit, self.factor, self.min_prob, self.response))
        if self.datastore is not None:
            found.append(self.datastore.index.draft(history[-MATCH_DEPTH:], limit, self.factor, self.min_prob))
        return sorted((d for d in found if d is not None and d.tokens), key=lambda d: -d.match)

    def propose(self, history: list[int]) -> DraftTree:
        self.tree = select(history[-1], Candidates(self.drafts(history)), self.total, self.factor, self.min_prob)
        return self.tree

    def write(self, history: list[int]) -> None:
        """Put the response so far (the history past the prompt) in the store."""
        if self.store is None or len(history) <= self.prompt_len + self.written:
            return
        if self.response is None:
            self.response = self.store.open(history[max(0, self.prompt_len - LEAD_IN):self.prompt_len])
        self.store.extend(self.response, history[self.prompt_len + self.written:])
        self.written = len(history) - self.prompt_len

    def accepted(self, path: list[int]) -> None:
        """Put the step's accepted drafts in the store (the bonus token comes with the next history): the last step's
        would never arrive otherwise. `path` names the nodes of `self.tree` (select keeps them in best-first order,
        so a budget's cut keeps their numbers); a path that is not one of its root paths writes nothing."""
        tree = self.tree
        if self.response is None or tree is None or len(path) < 2 or path[-1] >= len(tree.tokens) \
                or any(tree.parents[b] != a for a, b in zip(path, path[1:])):
            return
        tokens = [tree.tokens[i] for i in path[1:]]
        self.store.extend(self.response, tokens)
        self.written += len(tokens)


_STORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> its ResponseStore
_PAUSED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # engine -> fresh_requests contexts open on it
_STORES_LOCK = threading.Lock()


def response_store(engine, tokens: int = STORE_TOKENS) -> ResponseStore | None:
    """The engine's store of earlier responses (made at the first call), bounded to `tokens` from now on; None when
    `tokens` is 0 (the store, if any, emptied) or inside `fresh_requests`."""
    with _STORES_LOCK:
        if _PAUSED.get(engine):
            return None
        store = _STORES.get(engine)
        if store is None:
            if tokens == 0:
                return None
            store = _STORES[engine] = ResponseStore(tokens)
    if store.capacity != tokens:
        store.bound(tokens)
    return store if tokens else None


def lookup(engine, s: Settings, sampler) -> SuffixLookup:
    """The suffix lookup of a request on `engine`: the bundle's datastore, the engine's response store (read unless
    the request is sampled with a seed)."""
    params = sampler.params
    return SuffixLookup(s, bundle_datastore(engine), response_store(engine, s.store_tokens),
                        reads=params.greedy or params.seed is None)


@contextmanager
def fresh_requests(engine):
    """Within it, the engine's requests neither read nor write its response store: each runs as a fresh engine's
    first (a measurement that runs the same prompts again: `specexport profile`, the probe, a warm-up)."""
    with _STORES_LOCK:
        _PAUSED[engine] = _PAUSED.get(engine, 0) + 1
    try:
        yield
    finally:
        with _STORES_LOCK:
            _PAUSED[engine] -= 1


def bundle_datastore(engine) -> datastores.Datastore | None:
    """The bundle's datastore (loaded once per process), or None."""
    bundle = engine.bundle
    rel = bundle.manifest["method"].get("datastore")
    if rel is None:
        return None
    entry = bundle.manifest["files"].get(rel) if isinstance(rel, str) else None
    if entry is None:
        raise UserError(f"{bundle.path / 'manifest.json'} is malformed: the datastore {rel!r:.60} is not listed "
                        "under files (no checksum)")
    store = datastores.cached(str(bundle.file(rel)), entry["sha256"])
    store.check_for(bundle.manifest["model"]["vocab"], None, f"bundle {bundle.path}: {rel}")
    return store


def profile_budget(engine) -> int | None:
    """The max_tree_tokens of the profile the bundle was built with (None: no limit recorded)."""
    limit = ((engine.bundle.manifest.get("profile") or {}).get("limits") or {}).get("max_tree_tokens")
    return limit if isinstance(limit, int) else None


def check_profile_budget(engine, total: int) -> None:
    """One line when the node budget is above the max_tree_tokens of the profile the bundle was built with."""
    limit = profile_budget(engine)
    if limit is not None and total > limit:
        check_budget(total, limit, f" (the max_tree_tokens of profile "
                                   f"{engine.bundle.manifest['profile'].get('name', '?')})")


class Suffix:
    Settings = Settings
    profile_section = "suffix"

    def settings(self, section: dict, given: dict) -> Settings:
        return with_given(from_section(Settings, section, "the bundle's suffix settings"), given, "suffix")

    def proposer(self, engine, settings: Settings, sampler) -> SuffixLookup:
        check_profile_budget(engine, settings.total_tokens)
        return lookup(engine, settings, sampler)

    def describe(self, settings: Settings) -> str:
        return (f"up to {settings.total_tokens} tokens, factor {settings.match_factor:g}, min prob "
                f"{settings.min_prob:g}{', no datastore' if settings.no_datastore else ''}")

    def tree_info(self, settings: Settings) -> dict:
        return {"tokens_per_step": settings.total_tokens, "depth": settings.total_tokens - 1,
                "match_factor": settings.match_factor, "min_prob": settings.min_prob}

    def tokens_per_step(self, settings: Settings) -> int:
        return settings.total_tokens


METHOD = Suffix()
