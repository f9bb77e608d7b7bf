"""Sampling: turn target logits into the distribution to sample from, and draw tokens from it.

The functions are pure (random numbers are arguments) so that verification can reuse
`probabilities` for the target distribution and tests can hand-work every case.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from specexport.errors import UserError
from specexport.runtime.grammar import Constraint, Matcher

MAX_TEMPERATURE = 1000.0  # far past any useful setting; keeps the graph's float32 sampling parameters finite
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a logit bias: -100 bans a token, 100 all but forces it
MAX_PENALTY = 2.0  # OpenAI's range for the frequency and presence penalties (and a generous repetition penalty's)
MAX_TOP_LOGPROBS = 20  # OpenAI's (and vLLM's default) most alternatives a token's logprob lists


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token; temperature 0 means greedy (argmax).

    `min_p` (sampling only) keeps the tokens at least min_p times as likely as the most likely one; `logit_bias`
    ((token id, bias), ...) adds each bias to its token's logit, greedy or sampled. The penalties (`penalize`) come
    first, on the model's logits: `repetition_penalty` (transformers' and vLLM's: a token of the prompt or the output
    so far has its logit divided by it where positive, multiplied where negative), then OpenAI's
    `frequency_penalty` (times the token's count in the output so far) and `presence_penalty` (once, if there)
    subtracted. `min_tokens` keeps the ids that end the output (the end of sequence, stop ids) from being drawn
    before the output has that many tokens. `logprobs` (N, 0 to MAX_TOP_LOGPROBS) asks for each new token's
    log-probability and the N most likely tokens' (`TokenLogprob`), `prompt_logprobs` the same for the prompt's tokens
    after the first. `constraint` (runtime/grammar.py) keeps every token to a grammar: a JSON schema, a regex, ...
    E.g. SamplingParams(temperature=0.7, min_p=0.05, logit_bias=((13, -100.0),)) never emits token 13."""

    temperature: float = 0.0
    top_k: int = 0  # 0 keeps every token
    top_p: float = 1.0  # 1.0 keeps every token
    seed: int | None = None
    min_p: float = 0.0  # 0 keeps every token
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0  # 1 is off
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs
    prompt_logprobs: int | None = None  # None: no logprobs of the prompt's tokens
    constraint: Constraint | None = None  # structured output: the grammar every token follows

    def __post_init__(self) -> None:
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # also false for NaN
            raise UserError(f"temperature must be in [0, {MAX_TEMPERATURE:g}], got {self.temperature}")
        if self.top_k < 0:
            raise UserError(f"top_k must be >= 0 (0 disables it), got {self.top_k}")
        if not 0 < self.top_p <= 1:  # also false for NaN
            raise UserError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise UserError(f"seed must be an integer in [0, 2^63), got {self.seed}")
        if not 0 <= self.min_p <= 1:  # also false for NaN
            raise UserError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 < self.repetition_penalty <= MAX_PENALTY:
            raise UserError(f"repetition_penalty must be in (0, {MAX_PENALTY:g}], got {self.repetition_penalty}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -MAX_PENALTY <= getattr(self, name) <= MAX_PENALTY:
                raise UserError(f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {getattr(self, name)}")
        if self.min_tokens < 0:
            raise UserError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is not None and not 0 <= getattr(self, name) <= MAX_TOP_LOGPROBS:
                raise UserError(f"{name} must be in 0..{MAX_TOP_LOGPROBS} (the alternatives listed), "
                                f"got {getattr(self, name)}")
        if len({t for t, _ in self.logit_bias}) < len(self.logit_bias):
            raise UserError("logit_bias names a token twice")
        for token, bias in self.logit_bias:
            if token < 0 or not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise UserError(f"logit_bias takes token ids >= 0 and biases in [-{MAX_LOGIT_BIAS:g}, "
                                f"{MAX_LOGIT_BIAS:g}], got {token}: {bias}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def conditional(self) -> bool:
        """Whether a row's distribution depends on what it follows (the penalties, min_tokens, a grammar:
        `conditioned`)."""
        return self.penalized or self.min_tokens > 0 or self.constraint is not None

    @property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1 or self.frequency_penalty != 0 or self.presence_penalty != 0

    @property
    def host_only(self) -> bool:
        """Whether only the host applies these settings: the graphs' acceptance (exporter/fused.py) takes the
        temperature, top-k and top-p, not min-p, a logit bias, the penalties or min_tokens, and brings back no
        logits to read logprobs from."""
        return (bool(self.logit_bias) or self.conditional or (self.min_p > 0 and not self.greedy)
                or self.logprobs is not None)


@dataclass(frozen=True)
class Context:
    """What the rows being sampled follow: `history`, the prompt's first `prompt_len` ids then the output so far,
    `stop_ids`, the ids that end the output (kept from being drawn before min_tokens), and `grammar`, the
    constraint's state after the output so far (runtime/grammar.Matcher)."""

    history: Sequence[int] = ()
    prompt_len: int = 0
    stop_ids: Collection[int] = ()
    grammar: Matcher | None = None


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the target and the `top` most likely tokens' ((id, logprob), most likely
    first, ties by lower id). They are the model's own (log-softmax of its logits, before temperature, penalties, a
    bias or top-k/p: vLLM's default "raw" logprobs), so they do not depend on the sampling settings: an evaluation
    harness reads the model's likelihood of a text. E.g. TokenLogprob(42, -0.105, ((42, -0.105), (7, -2.41)))."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs(logits: np.ndarray, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """Each token's `TokenLogprob` from its row of `logits` [len(tokens), V] (row i: the distribution token i was
    drawn from), with the `top` most likely tokens of that row."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1, np.shape(logits)[-1])[:len(tokens)]
    peak = x.max(axis=-1, keepdims=True)
    lp = x - (peak + np.log(np.exp(x - peak).sum(axis=-1, keepdims=True)))
    out = []
    for row, token in zip(lp, tokens):
        best = ()
        if top > 0:
            kth = -np.partition(-row, top - 1)[top - 1] if top < row.size else -np.inf
            ids = np.flatnonzero(row >= kth)  # every tie with the k-th, so the lower ids win below
            ids = ids[np.lexsort((ids, -row[ids]))][:top]
            best = tuple((int(i), float(row[i])) for i in ids)
        out.append(TokenLogprob(int(token), float(row[token]), best))
    return out


def conditioned(logits: np.ndarray, params: SamplingParams, context: Context,
                paths: list[list[int]] | None = None) -> np.ndarray:
    """`logits` [T, V] (or [V]) with the settings that depend on what each row follows (the same array where there
    are none). Row i follows the context's history and then `paths[i]`, the draft tokens on its tree path
    (runtime/tree.path_tokens), so that a tree's rows get what plain decoding would give at their positions: the
    penalties count its own tokens, min_tokens counts its own output length, and the grammar allows what follows its
    own path. E.g. history [5, 7, 7] with prompt_len 1 and frequency_penalty 0.5: token 7's logit loses 1.0, token
    5's nothing (only the prompt has it)."""
    if not params.conditional:
        return logits
    x = np.array(logits, dtype=np.float64)
    rows = x.reshape(-1, x.shape[-1])
    vocab = rows.shape[-1]
    history = np.asarray(context.history, np.int64)
    if params.penalized:  # (the counts cost two vocabulary-wide arrays a step: only the penalties read them)
        counts = np.bincount(history[context.prompt_len:], minlength=vocab)[:vocab]
        seen = np.zeros(vocab, bool)
        seen[history[history < vocab]] = True
    stops = np.array([t for t in context.stop_ids if t < vocab], np.int64)
    for i, row in enumerate(rows):
        path = paths[i] if paths is not None else ()
        if len(history) - context.prompt_len + len(path) < params.min_tokens:
            row[stops] = -np.inf
        if not params.penalized:
            continue
        c, s = counts, seen
        if path:
            extra = np.asarray(path, np.int64)
            c, s = counts.copy(), seen.copy()
            np.add.at(c, extra, 1)
            s[extra] = True
        if params.repetition_penalty != 1:
            row[s] = np.where(row[s] > 0, row[s] / params.repetition_penalty, row[s] * params.repetition_penalty)
        row -= params.frequency_penalty * c + params.presence_penalty * (c > 0)
    if context.grammar is not None:
        context.grammar.mask(rows, paths)
    return x


def biased(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """`logits` [..., V] with the params' logit bias added (the same array where there is none). A token id past
    the vocabulary is one line."""
    if not params.logit_bias:
        return logits
    ids = np.array([t for t, _ in params.logit_bias], np.int64)
    if ids.max() >= logits.shape[-1]:
        raise UserError(f"logit_bias: token id {int(ids.max())} is past the vocabulary (0..{logits.shape[-1] - 1})")
    x = np.array(logits, dtype=np.float64)
    x[..., ids] += np.array([b for _, b in params.logit_bias])
    return x


def probabilities(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """The sampling distribution over the last axis of `logits` [..., V], as float64.

    The logit bias first. Greedy gives a one-hot at the first maximum. Otherwise: divide by temperature, keep the
    top_k largest logits (ties with the k-th are kept, as in transformers), softmax, then keep
    the smallest set of most likely tokens whose mass reaches top_p (ties broken by lower
    token id; the most likely token is always kept), then those at least min_p times the most likely one's
    probability (transformers' order), and renormalise.
    """
    x = np.asarray(biased(logits, params), dtype=np.float64)
    if params.greedy:
        best = np.argmax(x, axis=-1)[..., None]
        probs = np.zeros_like(x)
        np.put_along_axis(probs, best, 1.0, axis=-1)
        return probs
    x = x / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = -np.partition(-x, params.top_k - 1, axis=-1)[..., params.top_k - 1 : params.top_k]
        x = np.where(x < kth, -np.inf, x)
    probs = np.exp(x - x.max(axis=-1, keepdims=True))
    probs /= probs.sum(axis=-1, keepdims=True)
    if params.top_p < 1:
        for row in probs.reshape(-1, probs.shape[-1]):  # a view: rows change in place
            _keep_nucleus(row, params.top_p)
    if params.min_p > 0:
        probs = np.where(probs >= params.min_p * probs.max(axis=-1, keepdims=True), probs, 0.0)
        probs /= probs.sum(axis=-1, keepdims=True)
    return probs


NUCLEUS_FLOORS = (2.0 ** -7, 2.0 ** -10, 2.0 ** -13, 2.0 ** -16)  # tried for top-p's candidates before all tokens


def _keep_nucleus(probs: np.ndarray, top_p: float) -> None:
    """In place on one normalised row: zero all but the nucleus, then renormalise.

    Sorts only the candidates at or above a probability floor (NUCLEUS_FLOORS, then every token with mass) whose
    sorted mass reaches top_p, instead of the whole vocabulary; candidates include every tie with the floor, so they
    are the first ones of a full stable sort by probability and the result equals it. One comparison per floor over
    the row instead of np.partition's passes: on 1500 rows of SmolLM2's logits at temperature 0.8, 0.11 / 0.14 / 1.66
    ms a row at top_p 0.9 / 0.95 / 0.99, against 1.03 / 1.03 / 1.53 with the partition growing k 64, 1024, 16384.
    """
    for floor in (*NUCLEUS_FLOORS, None):
        top = np.flatnonzero(probs >= floor if floor is not None else probs > 0)
        top = top[np.argsort(-probs[top], kind="stable")]  # ids ascend: ties keep the lower id first
        mass = np.cumsum(probs[top])
        if floor is None or (mass.size and mass[-1] >= top_p):
            break
    before = np.concatenate(([0.0], mass[:-1]))  # the mass of the more likely ones (exact, unlike mass - p)
    keep = top[before < top_p]
    kept = probs[keep]
    probs[:] = 0.0
    probs[keep] = kept / kept.sum()


def sample(probs: np.ndarray, u: float) -> int:
    """Inverse-CDF draw of one token from `probs` [V] given a uniform `u` in [0, 1).

    Never returns a zero-probability token, even when u is close to 1 or the cumulative
    sum rounds short of the total.
    """
    if not 0 <= u < 1:
        raise ValueError(f"u must be in [0, 1), got {u}")
    cdf = np.cumsum(probs, dtype=np.float64)
    token = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    if token == len(cdf) or probs[token] == 0:  # u * total rounded up to the total
        token = int(np.flatnonzero(probs)[-1])
    return token


class Sampler:
    """Picks one token from one row of logits, with its own seeded random stream; `context`: what the row follows
    (`conditioned`). `grammar`: the generation's constraint state (runtime/grammar.Matcher), where it has one."""

    def __init__(self, params: SamplingParams, grammar: Matcher | None = None):
        self.params, self.grammar = params, grammar
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits_row: np.ndarray, context: Context | None = None) -> int:
        if context is not None:
            logits_row = conditioned(logits_row, self.params, context)
        if self.params.greedy:
            return int(np.argmax(biased(logits_row, self.params)))
        return sample(probabilities(logits_row, self.params), self.rng.random())
