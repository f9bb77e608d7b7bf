"""Proposers: what guesses the draft tokens of a step.

Every proposer answers `propose(history)` with a `Proposal`: draft tokens hanging below the root
(the last token of `history`, emitted but not yet verified), as a tree with parents relative to the
draft list (-1 = child of the root), and, when its drafts were sampled, the processed draft
distributions they were drawn from. After verification the loop calls `accepted(nodes)` with the
draft indices on the accepted path, so a proposer with state (a KV cache) can keep what stays valid.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport.runtime import tree
from specexport.runtime.sampling import SamplingParams, probabilities, sample


@dataclass
class Proposal:
    tokens: list[int]
    parents: list[int]
    q: np.ndarray | None = None  # [1 + len(tokens), V]: distribution row r's children were drawn from
    mode: str = "topk"  # how the drafts were chosen (see verify.MODES): deterministic unless sampled

    def __len__(self) -> int:
        return len(self.tokens)

    def truncated(self, n: int) -> "Proposal":
        """The first n nodes (still a tree: parents come before children)."""
        q = None if self.q is None else self.q[:n + 1]
        return Proposal(self.tokens[:n], self.parents[:n], q, self.mode)


class NoProposer:
    """Plain decoding: nothing to propose, every step verifies the root alone.

    A proposer that reads the target's own outputs (Medusa) names them in `wants(fused)`; the engine then
    asks the target for them on every prompt call and every verify call, and hands them to
    `observe(outputs, rows)`: the rows now committed (the prompt chunk's, or the accepted path's; the last
    one is where the next step grows from)."""

    max_nodes = 0

    def wants(self, fused: bool) -> tuple[str, ...]:
        return ()

    def observe(self, outputs: dict, rows) -> None:
        pass

    def start(self, prompt_len: int, capacity: int) -> None:
        pass

    def propose(self, history: list[int]) -> Proposal:
        return Proposal([], [])

    def accepted(self, nodes: list[int]) -> None:
        pass


class NgramLookup(NoProposer):
    """Prompt lookup: continuations of earlier occurrences of the last n-gram (several form a tree)."""

    def __init__(self, max_ngram: int, min_ngram: int, draft_length: int, max_matches: int):
        from specexport.runtime.ngram import NgramProposer

        self.lookup = NgramProposer(max_ngram=max_ngram, min_ngram=min_ngram, draft_len=draft_length,
                                    max_matches=max_matches)
        self.max_nodes = draft_length * max_matches

    def start(self, prompt_len: int, capacity: int) -> None:
        self.lookup.reset()

    def propose(self, history: list[int]) -> Proposal:
        tokens, parents = self.lookup.propose(history)
        return Proposal(tokens, parents)


class DraftModel(NoProposer):
    """A small causal LM with its own in-place KV cache drafts a chain, or a tree with
    `branching[d]` children per node at depth d (its top-k; a sampled chain when sampling)."""

    def __init__(self, session, branching: tuple[int, ...], sampling: SamplingParams, rng: np.random.Generator):
        self.session = session
        self.branching = tuple(branching)
        self.sampling = sampling
        self.rng = rng
        self.sampled = not sampling.greedy and all(b == 1 for b in self.branching)
        self.max_nodes = int(np.cumprod(self.branching).sum())
        self.cache = None
        self.history_rows = self.forwarded = 0

    def start(self, prompt_len: int, capacity: int) -> None:
        self.cache = self.session.new_cache(capacity + self.max_nodes)
        self.history_rows = self.forwarded = 0

    def propose(self, history: list[int]) -> Proposal:
        new = history[self.cache.length:]  # committed since the last step (the root is last)
        logits = self._forward(new, tree.chain(len(new)), first=0, rows=[len(new) - 1])
        self.history_rows, self.forwarded = self.cache.length, 0
        tokens, parents = [], []
        q = np.zeros((self.max_nodes + 1, logits.shape[-1])) if self.sampled else None
        frontier = [(-1, logits[0])]
        for depth, width in enumerate(self.branching):
            level = len(tokens)
            for node, row in frontier:
                picks, dist = self._pick(row, width)
                if dist is not None:
                    q[node + 1] = dist
                tokens += picks
                parents += [node] * len(picks)
            if depth == len(self.branching) - 1:
                break
            created = list(range(level, len(tokens)))  # one draft call for the whole level
            frontier = list(zip(created, self._forward([tokens[i] for i in created], parents, first=level,
                                                       rows=range(len(created)))))
            self.forwarded = len(tokens)
        return Proposal(tokens, parents, q, "with_replacement" if self.sampled else "topk")

    def accepted(self, nodes: list[int]) -> None:
        """Keep the draft's KV rows of accepted drafts it computed (all but the last level's)."""
        self.cache.rewind(self.history_rows)
        self.cache.commit([n for n in nodes if n < self.forwarded])

    def _pick(self, logits: np.ndarray, width: int) -> tuple[list[int], np.ndarray | None]:
        if self.sampled:
            dist = probabilities(logits, self.sampling)
            return [sample(dist, self.rng.random())], dist
        if width == 1:
            return [int(np.argmax(logits))], None
        top = np.argpartition(logits, -width)[-width:]
        return [int(t) for t in top[np.argsort(-logits[top], kind="stable")]], None

    def _forward(self, ids: list[int], parents, first: int, rows) -> np.ndarray:
        """Append nodes first.. of a tree (earlier ones are already cached) and return logits of `rows`."""
        cache, t = self.cache, len(ids)
        past = self.history_rows if first else cache.length
        bias = tree.attention_bias(parents, past, self.session.bias_width(cache, cache.length, t), first=first)
        positions = past + tree.depths(parents)[first:]
        out = self.session.forward(cache, np.array([ids]), positions[None], bias, np.asarray(list(rows)))
        cache.advance(t)
        return out["logits"]


class MedusaHeads(NoProposer):
    """Medusa: a fixed tree whose node at depth d holds head d-1's candidate of the node's rank, taken at the
    last accepted row. In a fused graph the target call itself returns the candidates (one call per step);
    otherwise (sampling) the stand-alone heads graph runs on that row's hidden state."""

    def __init__(self, medusa_tree, heads_session=None):
        self.tree = medusa_tree
        self.parents = [p - 1 for p in medusa_tree.parents[1:]]  # relative to the drafts: the root is -1
        self.max_nodes = medusa_tree.size - 1
        self.heads_session = heads_session
        self.candidates = None

    def wants(self, fused: bool) -> tuple[str, ...]:
        return ("medusa_tokens",) if fused else ("hidden_states",)

    def start(self, prompt_len: int, capacity: int) -> None:
        self.candidates = None

    def observe(self, outputs: dict, rows) -> None:
        row = list(rows)[-1]
        if "medusa_tokens" in outputs:
            self.candidates = outputs["medusa_tokens"][0]
            return
        hidden = outputs["hidden_states"][0, row][None]
        self.candidates = self.heads_session.run(None, {"hidden": hidden})[0][0]

    def propose(self, history: list[int]) -> Proposal:
        if self.candidates is None:
            return Proposal([], [])
        return Proposal(self.tree.tokens(history[-1], self.candidates)[1:], self.parents)


class Eagle(NoProposer):
    """EAGLE-1/2/3: a one-layer draft decoder over the target's features, with its own in-place KV cache.

    The draft's cache holds one row per committed position t: (feature of t, token t + 1). Each step first
    feeds the pairs committed since the last step (the features `observe`d from the target's last call, and
    the tokens after them, the root last), then grows a tree from the last row: `depth` levels, each one draft
    call over the nodes to expand. Dynamic (EAGLE-2): the `top_k` best new candidates by cumulative log-prob are
    expanded, and the `total_tokens - 1` best of all are verified. Static (EAGLE-1): a fixed tree of ranks.
    Tree rows in the draft cache are dropped every step; only target features ever enter it as history."""

    def __init__(self, session, depth: int, top_k: int, total_tokens: int, static=None):
        self.session = session
        self.depth, self.top_k, self.total = depth, top_k, total_tokens
        self.static = static  # eagle_tree.StaticTree or None (dynamic)
        if static is not None:
            self.depth, self.total = static.depth, static.size + 1
        self.max_nodes = self.total - 1
        self.cache = self.last_candidates = None
        self.pending: list[np.ndarray] = []  # features of committed positions not yet fed to the draft
        self.fed = 0  # positions whose pair is in the draft's cache

    def wants(self, fused: bool) -> tuple[str, ...]:
        return ("eagle_features",)

    def start(self, prompt_len: int, capacity: int) -> None:
        grown = self.top_k * max(self.depth - 1, 0) if self.static is None else self.static.size
        self.cache = self.session.new_cache(capacity + grown + 1)
        self.pending, self.fed = [], 0

    def observe(self, outputs: dict, rows) -> None:
        self.pending.append(outputs["eagle_features"][0, list(rows)])

    def propose(self, history: list[int]) -> Proposal:
        from specexport.runtime.eagle_tree import CandidateTree

        feats = np.concatenate(self.pending) if self.pending else np.zeros((0, 0), np.float32)
        m = len(feats)
        if m == 0 or self.fed + m + 1 != len(history):
            raise RuntimeError(f"EAGLE draft out of step: {self.fed} fed + {m} features for {len(history)} tokens")
        self.pending = []
        self.cache.rewind(self.fed)
        out = self._call(history[self.fed + 1:], feats, tree.chain(m), self.fed, 0, [m - 1])
        self.cache.advance(m)
        self.fed += m
        candidates = CandidateTree()
        last = out["hidden_out"][0, m - 1]
        node_path = {-1: ()}
        frontier = self._grow(candidates, node_path, -1, out, 0)
        hidden_of = {-1: last}  # input hidden for a node's children: the draft's output at that node
        fed_parents, fed_index = [], {}
        for _ in range(self.depth - 1):
            frontier = [n for n in frontier if self.static is None or self.static.has_children(node_path[n])]
            if not frontier:
                break
            first = len(fed_parents)
            for n in frontier:
                fed_index[n] = len(fed_parents)
                fed_parents.append(fed_index.get(candidates.parents[n], -1))
            hidden = np.stack([hidden_of[candidates.parents[n]] for n in frontier])
            out = self._call([candidates.tokens[n] for n in frontier], hidden, fed_parents, self.fed, first,
                             range(len(frontier)), depth_offset=1)
            self.cache.advance(len(frontier))
            made = []
            for row, n in enumerate(frontier):
                hidden_of[n] = out["hidden_out"][0, row]
                made += self._grow(candidates, node_path, n, out, row)
            frontier = made if self.static is not None else candidates.top(made, self.top_k)
        self.last_candidates = candidates  # for `specexport profile`: the whole scored tree of this step
        if self.static is not None:
            _, tokens, parents = candidates._subtree(list(range(len(candidates))))
        else:
            _, tokens, parents = candidates.select(self.total - 1)
        return Proposal(tokens, parents)

    def _grow(self, candidates, node_path, parent: int, out: dict, row: int) -> list[int]:
        tokens, logps = out["draft_tokens"][row], out["draft_logp"][row]
        if self.static is not None:
            return self.static.grow(candidates, node_path, parent, tokens, logps)
        return candidates.add(parent, tokens[:self.top_k], logps[:self.top_k])

    def _call(self, ids, hidden, parents, past: int, first: int, rows, depth_offset: int = 0) -> dict:
        """Feed nodes first.. of `parents` (the earlier ones are cached after `past`); logits of `rows`."""
        cache, t = self.cache, len(ids)
        bias = tree.attention_bias(parents, past, self.session.bias_width(cache, cache.length, t), first=first)
        positions = past - 1 + depth_offset + tree.depths(parents)[first:] if depth_offset else past + np.arange(t)
        return self.session.forward(cache, np.array([ids]), np.asarray(positions)[None], bias, np.asarray(list(rows)),
                                    want=("hidden_out", "draft_logp", "draft_tokens"), inputs={"hidden": hidden[None]})
