"""The chat template's head: the tokens every chat prompt begins with, prefilled once per engine.

A chat template renders the same text before each conversation's first user message (SmolLM2's: its default system
prompt, 24 tokens of the ~90 of a short request). `TemplateHead` finds those tokens (the common start of the template
rendered around two different messages) and keeps the KV rows its prefill calls wrote, so that later prompts copy
them into their cache instead of computing them again.

Exact by construction: a prompt that begins with the head is always prefilled in the same chunks (the head's, then
the rest: `Engine.prefill_chunks`), cached or not, and a chunk's rows depend only on its tokens and the rows before
it (causal attention; int8's per-call activation scale is taken over the call's own rows). So a kept chunk's rows are
the rows that computing it again would write, bit for bit, on a cache whose rows before it are the head's: a
prompt's leading chunks that spell the head from row 0 (`leading`) are the only ones kept or restored.

A proposer that reads the target's outputs at the prompt's rows (EAGLE's features, Medusa's candidates) is given the
head's, kept with its rows, as its call gave them (its own draft prefill still runs on them). Only caches whose rows
live on the host keep and take rows (a device cache computes the head each time).
"""

from __future__ import annotations

import numpy as np

from specexport.runtime.kvcache import HostRows


class TemplateHead:
    """The head's tokens and its prefill chunks' rows (per chunk, by its start and length: the rows it wrote in each
    cache buffer) and what proposers read from those calls (by the outputs' names). Its callers say which chunks
    continue the head (`leading`): `restore` and `keep` take their word."""

    def __init__(self, tokens: list[int]):
        self.tokens = list(tokens)
        self._rows: dict[tuple[int, int], list[np.ndarray]] = {}
        self._outputs: dict[tuple[int, int, tuple[str, ...]], dict[str, np.ndarray]] = {}

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

    def leading(self, chunks: list[list[int]]) -> int:
        """How many of a prompt's leading chunks (fed from row 0) hold the head's tokens, in order."""
        end = 0
        for k, chunk in enumerate(chunks):
            if self.tokens[end:end + len(chunk)] != chunk:
                return k
            end += len(chunk)
        return len(chunks)

    def restore(self, cache, chunk: list[int], wants: tuple[str, ...] = ()) -> dict[str, np.ndarray] | None:
        """Copy the kept rows of `chunk`, the head's next chunk on `cache`, into it (which advances past them) and
        return copies of the outputs `wants` names that its call gave; None where they are not kept or the cache
        takes no rows (the caller computes the chunk and `keep`s it)."""
        key = (cache.length, len(chunk))
        rows, outputs = self._rows.get(key), self._outputs.get(key + (wants,)) if wants else {}
        if rows is None or outputs is None or not _host(cache):
            return None
        cache.put_rows(cache.length, rows)
        cache.advance(len(chunk))
        return {name: value.copy() for name, value in outputs.items()}

    def keep(self, cache, start: int, chunk: list[int], outputs: dict[str, np.ndarray]) -> None:
        """Keep the rows `chunk`, one of the head's chunks, wrote on `cache` from row `start`, and the `outputs` of its
        call that a proposer read."""
        key = (start, len(chunk))
        if key not in self._rows and _host(cache):
            self._rows[key] = cache.rows_at(start, len(chunk))
        if outputs:
            self._outputs.setdefault(key + (tuple(outputs),), {name: np.array(v) for name, v in outputs.items()})


def _host(cache) -> bool:
    """Whether a cache's rows can be kept and put back (one sequence's, on the host)."""
    return isinstance(cache, HostRows) and cache.batch == 1
