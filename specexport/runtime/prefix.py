"""Prompts' leading chunks prefilled once: the KV rows of a prompt's chunks kept for later prompts that begin with them.

Chat prompts share beginnings: every conversation opens with the template's system prompt (SmolLM2's default: 21 of
the ~90 tokens of a short request) or the service's own, and each turn of a conversation re-sends the turns before
it. A prompt is prefilled in chunks cut where a message ends (`PrefixStore.split`: after the chat template's
end-of-message tokens, `message_marks`, unless the assistant's reply follows: a question and its answer are one part),
and the rows each chunk wrote are kept (`keep`), so that a later prompt whose chunks from row 0 are the same copies
them into its cache (`restore`) instead of computing them again: turn n + 1 of a conversation computes only turn n's
exchange and its own question.

Exact by construction: a prompt is always cut in the same chunks, kept rows or not (the cut depends on its tokens
alone), and a chunk's rows depend only on its tokens and the rows before it (causal attention; int8's per-call
activation scale is taken over the call's own rows). So a kept chunk's rows are the rows that computing it again
would write, bit for bit, on a cache that holds the same chunks before it: a chunk is known by all the chunks from
row 0 through it (their tokens and their lengths), never by its tokens alone.

A proposer that reads the target's outputs at the prompt's rows (EAGLE's features, Medusa's candidates) is given
those of the kept call, as its call gave them (its own draft prefill still runs on them). A cache of one sequence
keeps and takes rows where its kind can (`keeps_rows`): on the host as arrays, on ONNX Runtime's device path as
tensors copied on the device (runtime/backends/iobinding.py); TensorRT's device cache computes every chunk. The store
holds at most `budget` bytes of rows and outputs (device memory where the rows are on a device), forgetting the
chunks used longest ago first (a chunk never outlives the chunks before it).
"""

from __future__ import annotations

import heapq
import threading

import numpy as np

from specexport.errors import UserError

BUDGET = 256 << 20  # bytes of kept rows an engine holds by default
MIN_PART = 16  # a message boundary cuts the prompt only where the part before it has at least this many tokens


def message_marks(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """What the chat template writes after each message (ChatML's `<|im_end|>` and newline: the common end of two
    renderings whose messages differ at their last character) and before the assistant's reply (its generation
    prompt, ChatML's `<|im_start|>assistant` and newline); none without a template, or where the end does not begin
    with a special token (plain text would cut prompts at ordinary words)."""
    if not tokenizer.has_chat_template:
        return (), ()
    try:
        a, b, asked = (tokenizer.encode_chat([{"role": "user", "content": text}], add_generation_prompt=reply)
                       for text, reply in (("x", False), ("Q", False), ("x", True)))
    except UserError:  # a template that wants other messages: no cuts
        return (), ()
    start = next((i for i, (s, t) in enumerate(zip(a, b)) if s != t), min(len(a), len(b)))
    n = 0
    while n < min(len(a), len(b)) - start and a[-1 - n] == b[-1 - n]:
        n += 1
    special = {i for i, token in tokenizer.backend.get_added_tokens_decoder().items() if token.special}
    end = tuple(a[len(a) - n:])
    if not end or end[0] not in special:
        return (), ()
    return end, tuple(asked[len(a):]) if asked[:len(a)] == a else ()


class _Chunk:
    """A kept chunk: its rows (per cache buffer), the outputs proposers read from its call (by their names), the
    chunks kept after it (by their tokens), and when it was last used."""

    __slots__ = ("parent", "tokens", "rows", "outputs", "children", "used", "nbytes")

    def __init__(self, parent: "_Chunk | None", tokens: tuple[int, ...], rows: list[np.ndarray] | None, used: int):
        self.parent, self.tokens, self.rows, self.used = parent, tokens, rows, used
        self.outputs: dict[tuple[str, ...], dict[str, np.ndarray]] = {}
        self.children: dict[tuple[int, ...], _Chunk] = {}
        self.nbytes = sum(r.nbytes for r in rows) if rows else 0


class PrefixStore:
    """The kept chunks of an engine's prompts, a tree from row 0 (`split` says where prompts are cut; `restore` and
    `keep` take a prompt's chunks from row 0 through the one in question)."""

    def __init__(self, message_end: tuple[int, ...] = (), reply_start: tuple[int, ...] = (), budget: int = BUDGET,
                 min_part: int = MIN_PART):
        self.message_end, self.reply_start = tuple(message_end), tuple(reply_start)
        self.budget, self.min_part = budget, min_part
        self._root = _Chunk(None, (), None, 0)
        self.nbytes, self._clock = 0, 0
        self.queries = self.hits = 0  # prompt tokens prefilled through this store, and those copied (as vLLM counts)
        self._lock = threading.Lock()  # one engine may prefill on several threads (batch-1 generations)

    @property
    def marks(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Where this store cuts prompts (`message_marks`)."""
        return self.message_end, self.reply_start

    @classmethod
    def of(cls, tokenizer, budget: int = BUDGET) -> "PrefixStore":
        """The store for a tokenizer's prompts: cut where its chat template ends a message."""
        return cls(*message_marks(tokenizer), budget=budget)

    def split(self, ids: list[int]) -> list[int]:
        """Where the prompt is cut (ascending offsets): after each end of a message that leaves at least `min_part`
        tokens since the last cut and is not followed by the assistant's reply (a question and its answer are one
        part: the prompt that asked the question ended with the reply's start, the next turn's holds the reply), never
        at the prompt's end."""
        marker, reply, cuts, last = self.message_end, self.reply_start, [], 0
        if not marker:
            return cuts
        m, first = len(marker), marker[0]
        for i in range(len(ids) - m):  # a cut at p = i + m < len(ids)
            p = i + m
            if ids[i] == first and p - last >= self.min_part and tuple(ids[i:p]) == marker \
                    and not (reply and tuple(ids[p:p + len(reply)]) == reply):
                cuts.append(last := p)
        return cuts

    def asked(self, tokens: int) -> None:
        """Count a prompt of `tokens` tokens prefilled (its chunks restored or computed and kept)."""
        with self._lock:
            self.queries += tokens

    def restore(self, cache, chunks: list[list[int]], wants: tuple[str, ...] = ()) -> list[dict[str, np.ndarray]]:
        """Copy into `cache`, which holds some leading chunks of `chunks` (the prompt's chunks from row 0), the kept
        rows of the chunks after those, in order, as many as are kept (the cache advances past them), in one walk of
        the store; returns, for each chunk copied, copies of the outputs `wants` names that its call gave. None copied
        where the next is not kept with those outputs, the cache ends between chunks or takes no rows (the caller
        computes the next chunk and `keep`s it)."""
        ends = np.cumsum([0] + [len(c) for c in chunks])
        fed = int(np.searchsorted(ends, cache.length)) if cache.keeps_rows else len(chunks)
        if fed >= len(chunks) or ends[fed] != cache.length:
            return []
        found = []
        with self._lock:
            node = self._find(chunks[:fed])
            for chunk in chunks[fed:] if node is not None else ():
                node = node.children.get(tuple(chunk))
                outputs = node.outputs.get(wants) if node is not None and wants else {}
                if node is None or outputs is None:
                    break
                found.append((node, outputs))
            if found:
                self._touch(found[-1][0])
                self.hits += sum(len(node.tokens) for node, _ in found)
        for node, _ in found:
            cache.put_rows(cache.length, node.rows)
            cache.advance(len(node.tokens))
        return [{name: value.copy() for name, value in outputs.items()} for _, outputs in found]

    def keep(self, cache, chunks: list[list[int]], outputs: dict[str, np.ndarray]) -> None:
        """Keep the rows the last of `chunks` (the prompt's chunks from row 0, all in `cache` now) wrote, and the
        `outputs` of its call that a proposer read, where the chunks before it are kept (the first always is)."""
        n = len(chunks[-1])
        if not cache.keeps_rows or cache.length != sum(len(c) for c in chunks):
            return
        with self._lock:
            parent = self._find(chunks[:-1])  # the root for a prompt's first chunk
            if parent is None:
                return
            key = tuple(chunks[-1])
            node = parent.children.get(key)
            if node is None:
                node = parent.children[key] = _Chunk(parent, key, cache.rows_at(cache.length - n, n), 0)
                self.nbytes += node.nbytes
            if outputs and tuple(outputs) not in node.outputs:
                node.outputs[tuple(outputs)] = kept = {name: np.array(v) for name, v in outputs.items()}
                grown = sum(v.nbytes for v in kept.values())
                node.nbytes += grown
                self.nbytes += grown
            self._touch(node)
            self._shrink()

    def _find(self, chunks: list[list[int]]) -> _Chunk | None:
        node = self._root
        for chunk in chunks:
            node = node.children.get(tuple(chunk))
            if node is None:
                return None
        return node

    def _touch(self, node: _Chunk) -> None:
        """Mark a chunk and those before it used now (a chunk is never older than the chunks before it)."""
        self._clock += 1
        while node is not self._root:
            node.used, node = self._clock, node.parent

    def _shrink(self) -> None:
        """Forget the chunks used longest ago, each after the chunks kept after it, until the store fits its
        budget: one walk for the leaves, then a heap (a chunk whose last child goes becomes a leaf; it is never
        older than its children, so the order holds)."""
        if self.nbytes <= self.budget:
            return
        leaves, stack = [], [self._root]
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if not node.children and node is not self._root:
                leaves.append((node.used, id(node), node))
        heapq.heapify(leaves)
        while self.nbytes > self.budget:
            _, _, oldest = heapq.heappop(leaves)
            parent = oldest.parent
            del parent.children[oldest.tokens]
            self.nbytes -= oldest.nbytes
            if not parent.children and parent is not self._root:
                heapq.heappush(leaves, (parent.used, id(parent), parent))
