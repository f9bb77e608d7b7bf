"""Logprobs as OpenAI's objects: the chat form (`content`: one object per token, with its bytes and alternatives) and
the completions form (parallel lists: tokens, token_logprobs, top_logprobs, text_offset), from the runtime's
TokenLogprob entries (runtime/sampling.py: the model's own log-softmax, read from the rows that verified each token).

A token's text is what it stands for alone (runtime/tokenizer.Tokenizer.token_bytes), so a character the vocabulary
splits over tokens shows as U+FFFD in each piece, while `bytes` (chat) keep the exact bytes, as OpenAI's do. E.g. one
SmolLM2 token: {"token": " hello", "logprob": -0.41, "bytes": [32, 104, 101, 108, 108, 111], "top_logprobs": [...]}.
"""

from __future__ import annotations

import math

from specexport.runtime.sampling import TokenLogprob
from specexport.runtime.tokenizer import Tokenizer


def _number(logprob: float) -> float:
    """JSON has no -Infinity: a token the model gives no mass at all (a masked one) reads as -9999, as vLLM's do."""
    return logprob if math.isfinite(logprob) else -9999.0


class Texts:
    """Token id -> (text, bytes), cached: alternatives repeat a lot over a response."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer, self._seen = tokenizer, {}

    def __call__(self, token: int) -> tuple[str, bytes]:
        if token not in self._seen:
            raw = self.tokenizer.token_bytes(token)
            self._seen[token] = (raw.decode("utf-8", errors="replace"), raw)
        return self._seen[token]


def chat(texts: Texts, entries: list[TokenLogprob]) -> dict:
    """A chat choice's `logprobs`: {"content": [...], "refusal": None}."""
    def one(token: int, logprob: float) -> dict:
        text, raw = texts(token)
        return {"token": text, "logprob": _number(logprob), "bytes": list(raw)}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries], "refusal": None}


def completion(texts: Texts, scored: list[tuple[TokenLogprob | None, int]], offset: int = 0) -> dict:
    """A completion choice's `logprobs` for (entry, token id) pairs, its text starting at character `offset` of the
    choice's text (a stream's later pieces). A None entry (the prompt's first token, under echo) has null logprobs:
    nothing came before it."""
    tokens, values, tops, offsets = [], [], [], []
    for entry, token in scored:
        text, _ = texts(token)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        values.append(None if entry is None else _number(entry.logprob))
        if entry is None:
            tops.append(None)
            continue
        top = {}
        for t, lp in entry.top:  # two ids that read the same keep the likelier (listed first)
            top.setdefault(texts(t)[0], _number(lp))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}
