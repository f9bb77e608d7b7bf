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
    asks the target for them on the prompt's last call and every verify call, and hands them to
    `observe(outputs, row)`, `row` being the step row of the last accepted node."""

    max_nodes = 0

    def wants(self, fused: bool) -> tuple[str, ...]:
        return ()

    def observe(self, outputs: dict, row: int) -> None:
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

    def observe(self, outputs: dict, row: int) -> None:
        if "medusa_tokens" in outputs:
            self.candidates = outputs["medusa_tokens"][0]
            return
        hidden = outputs["hidden_states"][0, row][None]
        self.candidates = self.heads_session.run(None, {"hidden": hidden})[0][0]

    def propose(self, history: list[int]) -> Proposal:
        if self.candidates is None:
            return Proposal([], [])
        return Proposal(self.tree.tokens(history[-1], self.candidates)[1:], self.parents)
