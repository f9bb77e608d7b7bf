"""The chat template's head: the tokens every chat prompt begins with, prefilled once per engine.

A chat template renders the same text before each conversation's first user message (SmolLM2's: its default system
prompt, 24 tokens of the ~90 of a short request). `TemplateHead` finds those tokens (the common start of the template
rendered around two different messages) and keeps the KV rows its prefill calls wrote, so that later prompts copy
them into their cache instead of computing them again.

Exact by construction: a prompt that begins with the head is always prefilled in the same chunks (the head's, then
the rest: `Engine.prefill_chunks`), cached or not, and a chunk's rows depend only on its tokens and the rows before
it (causal attention; int8's per-call activation scale is taken over the call's own rows). So a kept chunk's rows are
the rows that computing it again would write, bit for bit, on a cache whose rows before it are the head's: a
prompt's leading chunks that spell the head from row 0, in the same chunking, are the only ones kept or restored.

A proposer that reads the target's outputs at the prompt's rows (EAGLE's features, Medusa's candidates) is given the
head's, kept with its rows, as its call gave them (its own draft prefill still runs on them). Only caches whose rows
live on the host keep and take rows (a device cache computes the head each time).
"""

from __future__ import annotations

import numpy as np

from specexport.runtime.kvcache import HostRows


class TemplateHead:
    """The head's tokens and the rows its prefill chunks wrote (per cache buffer), with what proposers read from
    those calls (by the outputs' names). A chunk is known by the prompt's chunks from row 0 through it (their
    lengths: the same rows need the same chunking before them, as well as the same tokens); only chunks whose tokens
    and those before them spell the head are kept or put back."""

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)
        self._rows: dict[tuple[int, ...], list[np.ndarray]] = {}
        self._outputs: dict[tuple[tuple[int, ...], tuple[str, ...]], dict[str, np.ndarray]] = {}

    @classmethod
    def of(cls, tokenizer) -> "TemplateHead":
        """The head of the tokenizer's chat template (none without one, or where it renders nothing before the
        message): the common start of two renderings whose messages differ at their first character."""
        if not tokenizer.has_chat_template:
            return cls([])
        a, b = (tokenizer.encode_chat([{"role": "user", "content": text}]) for text in ("x", "Q"))
        n = next((i for i, (s, t) in enumerate(zip(a, b)) if s != t), min(len(a), len(b)))
        return cls(a[:n])

    def split(self, ids: list[int]) -> int:
        """How many leading tokens of `ids` are the head (0 unless they begin with all of it and go on past it)."""
        n = len(self.tokens)
        return n if n and len(ids) > n and ids[:n] == self.tokens else 0

    def key(self, chunks: list[list[int]]) -> tuple[int, ...] | None:
        """The key of the last of a prompt's leading `chunks` (fed from row 0): their lengths, or None unless their
        tokens, in order, are the head's first ones."""
        lengths = tuple(len(c) for c in chunks)
        end = sum(lengths)
        if not chunks or end > len(self.tokens) or [t for c in chunks for t in c] != self.tokens[:end]:
            return None
        return lengths

    def restore(self, cache, chunks: list[list[int]], wants: tuple[str, ...] = ()) -> dict[str, np.ndarray] | None:
        """Copy the kept rows of the last of `chunks` (the prompt's chunks from row 0; `cache` holds those before
        it) into `cache` (which advances past them) and return copies of the outputs `wants` names that its call
        gave; None where they are not kept or the cache takes no rows (the caller computes the chunk and `keep`s
        it)."""
        key = self.key(chunks)
        if key is None or not _host(cache) or cache.length != sum(key[:-1]):
            return None
        rows, outputs = self._rows.get(key), self._outputs.get((key, wants)) if wants else {}
        if rows is None or outputs is None:
            return None
        cache.put_rows(cache.length, rows)
        cache.advance(key[-1])
        return {name: value.copy() for name, value in outputs.items()}

    def keep(self, cache, chunks: list[list[int]], outputs: dict[str, np.ndarray]) -> None:
        """Keep the rows the last of `chunks` (the prompt's chunks from row 0, all in `cache` now) wrote, and the
        `outputs` of its call that a proposer read, where the chunks spell the head."""
        key = self.key(chunks)
        if key is None or not _host(cache) or cache.length != sum(key):
            return
        if key not in self._rows:
            self._rows[key] = cache.rows_at(cache.length - key[-1], key[-1])
        if outputs:
            self._outputs.setdefault((key, tuple(outputs)), {name: np.array(v) for name, v in outputs.items()})


def _host(cache) -> bool:
    """Whether a cache's rows can be kept and put back (one sequence's, on the host)."""
    return isinstance(cache, HostRows) and cache.batch == 1
