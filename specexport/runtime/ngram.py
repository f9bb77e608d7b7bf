"""Prompt lookup: propose draft tokens by finding the last few tokens earlier in the history.

The proposal is the step's tree, root first: node 0 is the root (the last emitted token, the last
element of `history`, parent -1) and the drafts hang below it in topological order. One match gives
a chain; several matches are merged into a trie (continuations that share a prefix share its nodes),
so they form a tree.

Ranking of matches: longer n-grams first (max_ngram down to min_ngram); within one n, the most
recent occurrence first. A match counts only when it adds a node to the trie (a continuation that
is already a prefix of an earlier branch is not distinct), and the first `max_matches` such matches
are merged in rank order until `max_nodes` draft nodes exist, so the best-ranked branch is complete first.
At most `SCAN_PER_N * max_matches` occurrences are examined per n, which bounds the cost on highly
repetitive histories.

`propose` is called once per step with the whole history. An index from n-gram (a tuple) to the
positions where it ends is extended with only the tokens appended since the previous call, so a
call costs O(new tokens + draft) and not O(history). Call `reset()` for a new sequence; a history
that is shorter than the last one or differs at its last seen token also rebuilds the index.
Pure Python: no numpy, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

SCAN_PER_N = 16  # occurrences examined per n-gram length, in units of max_matches


class NgramIndex:
    """The n-gram index of one history; `propose(history) -> (tokens, parents)`, the step's tree root first."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, draft_len: int = 8, max_matches: int = 4,
                 max_nodes: int | None = None):  # fmt: skip
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"ngram sizes must satisfy max_ngram >= min_ngram >= 1, got max_ngram={max_ngram}, min_ngram={min_ngram}")
        if not 1 <= draft_len <= 64:
            raise ValueError(f"draft_len must be in 1..64, got {draft_len}")
        if max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {max_matches}")
        if max_nodes is not None and max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1 (or None for draft_len * max_matches), got {max_nodes}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.draft_len, self.max_matches = draft_len, max_matches
        self.max_nodes = draft_len * max_matches if max_nodes is None else max_nodes
        self.reset()

    def reset(self) -> None:
        """Forget the history (a new sequence begins)."""
        self._tokens: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of its last token, ascending

    def propose(self, history: Sequence[int]) -> tuple[list[int], list[int]]:
        """The tree rooted at history[-1]: (tokens, parents), root first; the root alone when nothing matches
        (([], []) for an empty history)."""
        self._sync(history)
        tokens, length = self._tokens, len(self._tokens)
        if not length:
            return [], []
        trie_tokens, trie_parents = [tokens[-1]], [-1]
        children: list[dict[int, int]] = [{}]  # children[node]: token -> child node
        used: set[int] = set()
        matches = 0
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            ends = self._ends.get(tuple(tokens[length - n :]))
            if not ends or len(ends) < 2:
                continue  # ends[-1] is the query itself (it ends at the root)
            for end in islice(reversed(ends), 1, 1 + SCAN_PER_N * self.max_matches):  # most recent first
                if end in used:
                    continue  # the same continuation was already taken with a longer n
                used.add(end)
                added, full = _insert(tokens[end + 1 : end + 1 + self.draft_len], trie_tokens, trie_parents, children,
                                      self.max_nodes)  # fmt: skip
                matches += added > 0
                if full or matches == self.max_matches:
                    return trie_tokens, trie_parents
        return trie_tokens, trie_parents

    def _sync(self, history: Sequence[int]) -> None:
        """Index the tokens appended since the last call (or everything, for a new history)."""
        seen = len(self._tokens)
        if len(history) < seen or (seen and (history[seen - 1] != self._tokens[seen - 1] or history[0] != self._tokens[0])):
            self.reset()
            seen = 0
        tokens, ends = self._tokens, self._ends
        for i in range(seen, len(history)):
            tokens.append(int(history[i]))
            for n in range(self.min_ngram, min(self.max_ngram, i + 1) + 1):
                key = tuple(tokens[i - n + 1 : i + 1])
                positions = ends.get(key)
                if positions is None:
                    ends[key] = [i]
                else:
                    positions.append(i)


def _insert(continuation, tokens, parents, children, max_nodes) -> tuple[int, bool]:
    """Merge one continuation below the root (node 0) into the trie; returns (nodes added, whether max_nodes
    draft nodes were reached)."""
    node, added = 0, 0
    for token in continuation:
        child = children[node].get(token)
        if child is None:
            if len(tokens) > max_nodes:
                return added, True
            child = len(tokens)
            tokens.append(token)
            parents.append(node)
            children.append({})
            children[node][token] = child
            added += 1
        node = child
    return added, len(tokens) > max_nodes
