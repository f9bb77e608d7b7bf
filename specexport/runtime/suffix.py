"""Suffix lookup (SuffixDecoding): a step's drafts are what followed earlier occurrences of the context's last
tokens, in the request itself (prompt and output so far), in the engine's store of earlier responses (what the
requests it served before, and those it serves now, generated), and in a datastore of the target's own outputs. The
continuations of the occurrences of the longest match form a trie whose nodes carry an estimated probability: the
product, along the path, of continuation frequencies (of the occurrences that reach a node, the share that go on
with the child's token).

The indexes are prefix arrays: the positions p of a text sorted by the tokens at p, p - 1, p - 2, ... (the text
read backwards from p, `depth` tokens deep; before the text's start reads as -1). The positions where the
context's last m tokens end are one contiguous range, and the range for m + 1 lies inside the range for m, sorted
by the next token back; so the longest match is found by narrowing, two binary searches per token of context.
The datastore's array is static (numpy, from a file: runtime/datastore.py); the request's and the response store's
grow with their texts, each new position put in place by one binary search. Pure numpy and Python.
"""

from __future__ import annotations

import heapq
import threading
from array import array
from bisect import bisect_left, bisect_right
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MATCH_DEPTH = 32  # the longest context matched, in tokens (how deep the prefix arrays are sorted)
SAMPLE = 256  # occurrences read at most per match: evenly spaced in the range, a sample stratified by context
STORE_TOKENS = 1 << 18  # an engine's response store holds at most this many tokens by default (about 3 MB)
LEAD_IN = MATCH_DEPTH  # prompt tokens stored before each response: the context its first tokens are matched in
USED_MATCH = 8  # a lookup that matches this deep counts as a use of the stored responses it reads (for eviction)
OFFSET_BITS = 24  # a response store's position: its response's number << OFFSET_BITS | its offset in its text
_MASK = (1 << OFFSET_BITS) - 1


@dataclass(frozen=True)
class Draft:
    """One index's continuations of its longest match, best first: the trie's nodes in the order a best-first
    search reaches them (a parent before its children; probabilities never increase), at most `limit`, none below
    the `min_prob` it was made with. `parents[i]` is an earlier node of the list, -1 for a child of the root."""

    match: int  # tokens of context matched
    occurrences: int  # how many times the match occurs (before sampling)
    tokens: list[int]
    parents: list[int]
    probs: list[float]

    def allowed(self, factor: float, min_prob: float, limit: int) -> int:
        """How many of its first nodes a step takes: SuffixDecoding's adaptive length (at most factor x match
        length), none below min_prob, at most `limit`."""
        n = min(limit, len(self.tokens), int(factor * self.match + 1e-6))
        k = 0
        while k < n and self.probs[k] >= min_prob:
            k += 1
        return k


def narrow(order: Sequence[int], token_at, context: Sequence[int], lo: int, hi: int, depth: int, matched: int = 0,
           keep=None) -> tuple[int, int, int]:
    """(m, lo, hi): the longest m <= depth for which order[lo:hi] holds the positions p whose text ends with
    context[-m:] at p, narrowed from a range whose positions all end with context[-matched:]. `keep(a, b)`: whether
    a narrower range order[a:b] counts (else the match stops short of it)."""
    m = matched
    for d in range(matched, min(depth, len(context))):
        c = int(context[-1 - d])

        def key(p, d=d):
            return token_at(p - d)

        a = bisect_left(order, c, lo, hi, key=key)
        b = bisect_right(order, c, a, hi, key=key)
        if a == b or (keep is not None and not keep(a, b)):
            break
        lo, hi, m = a, b, d + 1
    return m, lo, hi


def best_first(rows: list[list[int]], limit: int, min_prob: float) -> tuple[list[int], list[int], list[float]]:
    """The best `limit` nodes of the trie of `rows` (token rows of one length, sorted, -1 past a row's end), best
    first; children below `min_prob` are never reached. Returns (tokens, parents, probs): a node's probability is
    its parent's x its continuation frequency (of the rows through the parent, the share through the node)."""
    tokens, parents, probs = [], [], []
    width = len(rows[0]) if rows else 0
    heap: list = []
    order = 0

    def push_children(a: int, b: int, column: int, prob: float, parent: int) -> None:
        nonlocal order
        if column >= width:
            return
        i = a
        while i < b:
            token = rows[i][column]
            j = b if rows[b - 1][column] == token else i + 1  # sorted: the run ends where the token changes
            while j < b and rows[j][column] == token:
                j += 1
            p = prob * ((j - i) / (b - a))  # (the share first: a child never rounds above its parent)
            if token >= 0 and p >= min_prob:
                heapq.heappush(heap, (-p, order, token, parent, column, i, j))
                order += 1
            i = j

    if rows:
        push_children(0, len(rows), 0, 1.0, -1)
    while heap and len(tokens) < limit:
        negp, _, token, parent, column, lo, hi = heapq.heappop(heap)
        tokens.append(token)
        parents.append(parent)
        probs.append(-negp)
        push_children(lo, hi, column + 1, -negp, len(tokens) - 1)
    return tokens, parents, probs


class StaticIndex:
    """The prefix array of a fixed text (a datastore: documents, each after a -1 separator)."""

    def __init__(self, tokens: np.ndarray, order: np.ndarray, depth: int):
        self.tokens, self.order, self.depth = tokens, order, depth
        self._tokens, self._order = memoryview(tokens), memoryview(order)  # fast scalar reads for the searches
        firsts = tokens[order]
        self._starts = np.searchsorted(firsts, np.arange(int(tokens.max(initial=0)) + 2)).tolist()

    def token_at(self, q: int) -> int:
        return self._tokens[q] if q >= 0 else -1

    def draft(self, context: Sequence[int], limit: int, factor: float, min_prob: float) -> Draft | None:
        """The continuations of the longest match of the context's end, or None when its last token never occurs."""
        last = int(context[-1])
        if last >= len(self._starts) - 1:
            return None
        lo, hi = self._starts[last], self._starts[last + 1]
        if lo == hi:
            return None
        m, lo, hi = narrow(self._order, self.token_at, context, lo, hi, self.depth, matched=1)
        width = min(limit, int(factor * m + 1e-6))
        if width < 1:
            return Draft(m, hi - lo, [], [], [])
        step = max(1, -(-(hi - lo) // SAMPLE))
        if hi - lo <= 32:  # a few rows: plain Python is faster than numpy's calls
            rows = [self._tokens[p + 1:p + 1 + width].tolist() for p in self._order[lo:hi].tolist()]
            rows = [r[:r.index(-1)] + [-1] * (width - r.index(-1)) if -1 in r else r + [-1] * (width - len(r))
                    for r in rows]
        else:
            index = np.minimum(self.order[lo:hi:step, None] + np.arange(1, width + 1), len(self.tokens) - 1)
            rows = self.tokens[index]
            rows[np.logical_or.accumulate(rows < 0, axis=1)] = -1  # nothing after a document's end
            rows = rows.tolist()
        return Draft(m, hi - lo, *best_first(sorted(rows), limit, min_prob))


class HistoryIndex:
    """The prefix array of one request's text, grown as the text grows: positions with a next token are indexed
    (the root, the last token, is the query)."""

    def __init__(self, depth: int = MATCH_DEPTH):
        self.depth = depth
        self.reset()

    def reset(self) -> None:
        self.text: list[int] = []
        self.order: list[int] = []  # positions 0 .. len(text) - 2, sorted by the text read backwards

    def token_at(self, q: int) -> int:
        return self.text[q] if q >= 0 else -1

    def _key(self, p: int) -> list[int]:
        return self.text[max(0, p - self.depth + 1):p + 1][::-1]

    def sync(self, history: Sequence[int]) -> None:
        """Index the text up to `history` (a new or changed history is indexed again, in one sort)."""
        seen = len(self.text)
        if len(history) < seen or (seen and (history[seen - 1] != self.text[seen - 1] or history[0] != self.text[0])):
            self.reset()
            seen = 0
        self.text += [int(t) for t in history[seen:]]
        if len(history) - seen > 64:  # a prompt: one sort
            self.order = sorted(range(len(self.text) - 1), key=self._key)
            return
        for p in range(max(seen - 1, 0), len(self.text) - 1):
            self.order.insert(bisect_right(self.order, self._key(p), key=self._key), p)

    def draft(self, history: Sequence[int], limit: int, factor: float, min_prob: float) -> Draft | None:
        """The continuations of the longest earlier match of the history's end, or None."""
        self.sync(history)
        m, lo, hi = narrow(self.order, self.token_at, self.text, 0, len(self.order), self.depth)
        if m == 0:
            return None
        width = min(limit, int(factor * m + 1e-6))
        if width < 1:
            return Draft(m, hi - lo, [], [], [])
        step = max(1, -(-(hi - lo) // SAMPLE))
        rows = [(self.text[p + 1:p + 1 + width] + [-1] * width)[:width] for p in self.order[lo:hi:step]]
        return Draft(m, hi - lo, *best_first(sorted(rows), limit, min_prob))


class ResponseStore:
    """Earlier responses, shared by the requests of one engine (SuffixDecoding's global tree of responses). A stored
    text is the last LEAD_IN tokens of a prompt, then its response: the prompt's tokens are context only, to match
    the response's first tokens in (a repeated question matches its earlier answer from the first step); every
    continuation drafted is response text. The positions followed by a response token are one prefix array (a
    position: the response's number and the offset in its text), grown a binary-search insertion per token as
    requests write their responses (`open`, then `extend` as they go, so concurrent requests see each other's), and
    whole responses are dropped, least recently used first (written to, or read by a lookup that matched at least
    USED_MATCH tokens), so that the texts hold at most `capacity` tokens. A lookup leaves out the asking request's
    own response (`skip`): its own text is HistoryIndex's, and counting it twice would skew the frequencies. One
    lock: the scheduler's thread and Engine.generate threads share an engine's store."""

    def __init__(self, capacity: int = STORE_TOKENS, depth: int = MATCH_DEPTH):
        self.capacity, self.depth = capacity, depth
        self.longest = _MASK - 2 * depth  # the most tokens of one text (a position read back past its start: -1)
        self.lock = threading.Lock()
        self.texts: OrderedDict[int, array] = OrderedDict()  # number -> lead-in + response, least recently used first
        self.leads: dict[int, int] = {}  # number -> the length of its lead-in
        self.order = array("q")  # the indexed positions, sorted by the text read backwards
        self.tokens = 0  # in all texts
        self._next = 0

    def __len__(self) -> int:
        """Responses held."""
        return len(self.texts)

    def token_at(self, q: int) -> int:
        text, off = self.texts.get(q >> OFFSET_BITS), q & _MASK  # (read back past a start, q borrows: off > longest)
        return text[off] if text is not None and off < len(text) else -1

    def _key(self, q: int) -> array:
        text, off = self.texts[q >> OFFSET_BITS], q & _MASK
        return text[max(0, off - self.depth + 1):off + 1][::-1]

    def bound(self, capacity: int) -> None:
        """Hold at most `capacity` tokens from now on (0: none), dropping responses now if needed."""
        with self.lock:
            self.capacity = capacity
            self._evict()

    def open(self, lead_in: Sequence[int]) -> int:
        """A new response, after the end of its prompt (`lead_in`, of which the last LEAD_IN tokens are kept): its
        number, for `extend` and `draft(skip=...)`."""
        with self.lock:
            number, self._next = self._next, self._next + 1
            text = array("i", [int(t) for t in lead_in[len(lead_in) - min(len(lead_in), LEAD_IN):]])
            self.texts[number], self.leads[number] = text, len(text)
            self.tokens += len(text)
            self._evict()
        return number

    def extend(self, number: int, tokens: Sequence[int]) -> None:
        """Append tokens to a response (nothing once it was dropped, or past `capacity` tokens of text)."""
        with self.lock:
            text = self.texts.get(number)
            if text is None:
                return
            tokens = tokens[:max(0, min(self.capacity, self.longest) - len(text))]
            if not len(tokens):
                return
            first = max(len(text) - 1, self.leads[number] - 1, 0)  # the first position to get a response token next
            text.extend(int(t) for t in tokens)
            base = number << OFFSET_BITS
            for q in range(base + first, base + len(text) - 1):
                self.order.insert(bisect_right(self.order, self._key(q), key=self._key), q)
            self.tokens += len(tokens)
            self.texts.move_to_end(number)
            self._evict()

    def _evict(self) -> None:
        """Drop the least recently used responses until the texts fit the capacity (the caller holds the lock)."""
        gone = []
        while self.tokens > self.capacity and self.texts:
            number, text = self.texts.popitem(last=False)
            del self.leads[number]
            self.tokens -= len(text)
            gone.append(number)
        if gone:
            order = np.frombuffer(self.order, dtype=np.int64)
            self.order = array("q", order[~np.isin(order >> OFFSET_BITS, gone)].tobytes())

    def draft(self, context: Sequence[int], limit: int, factor: float, min_prob: float, skip: int | None = None
              ) -> Draft | None:
        """The continuations of the longest match of the context's end in the responses but `skip`, or None."""
        with self.lock:
            order = self.order

            def others(a: int, b: int) -> bool:  # a range with another response's position (mostly the first)
                return skip is None or any(order[i] >> OFFSET_BITS != skip for i in range(a, b))

            m, lo, hi = narrow(order, self.token_at, context, 0, len(order), self.depth, keep=others)
            if m == 0:
                return None
            width = min(limit, int(factor * m + 1e-6))
            if width < 1:
                return Draft(m, hi - lo, [], [], [])
            step = max(1, -(-(hi - lo) // SAMPLE))
            sampled = order[lo:hi:step]
            picks = [q for q in sampled if q >> OFFSET_BITS != skip]
            rows = []
            for q in picks:
                text, off = self.texts[q >> OFFSET_BITS], q & _MASK
                rows.append((text[off + 1:off + 1 + width].tolist() + [-1] * width)[:width])
            if m >= USED_MATCH:
                for number in {q >> OFFSET_BITS for q in picks}:
                    self.texts.move_to_end(number)
        occurrences = hi - lo - (len(sampled) - len(picks)) * step  # (the asking response's left out)
        return Draft(m, max(occurrences, len(picks)), *best_first(sorted(rows), limit, min_prob))
