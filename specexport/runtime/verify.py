"""Accept: choose the path of a verified tree and the token the target adds after it.

A verify step feeds the target T rows: row 0 is the root (the last emitted token, already
accepted but not yet in the KV cache), rows 1..T-1 are draft tokens; `parents[0] = -1` and
`0 <= parents[i] < i` otherwise. Row r of the target's output is its distribution for the
children of node r. Children of a node are tested in index order.

Words: the *accepted* rows form a path from the root; the *emitted* tokens are
the accepted draft tokens followed by one token the target supplies at the last accepted row:
the *bonus* token (called the *correction* when a child there was rejected: the sampling rules
then draw it from the residual). So every step emits at least one token (accept length >= 1).

The sampling rules are lossless (the emitted tokens follow the target's distribution exactly)
when the drafts were made the way the mode assumes, and take their random numbers as an
argument, `uniforms` [T, K + 1] with K = the most children any node has (`uniforms_shape`):

    uniforms[r, j]   tests the j-th child of node r (j < number of children of r)
    uniforms[r, -1]  draws the final token at r, if the path ends at r

Unused entries are ignored, so one draw of the whole array fixes the outcome.

Modes (tree.AcceptMode; arXiv 2211.17192 and 2305.09781, Sequoia, EAGLE):
- "with_replacement" (SpecInfer): the children of r were drawn i.i.d. from q[r]. Accept child x
  if u * q(x) < p(x) (probability min(1, p/q)); after a rejection p = norm(max(0, p - q)).
- "without_replacement" (Sequoia, EAGLE-1): the children were drawn one after another from q[r]
  with earlier ones removed. As above, and after a rejection also q[x] = 0, renormalised.
- "topk" (EAGLE-2/3): the children are deterministic (e.g. the draft's top-k), so each is a point
  mass: accept x if u < p(x); after a rejection p[x] = 0, renormalised. `q` is not used.
A chain is the tree [-1, 0, 1, ...] in either of the first two modes (`accept_chain`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum

import numpy as np

from specexport.runtime.sampling import (
    Context,
    SamplingParams,
    TokenLogprob,
    biased,
    conditioned,
    logprobs,
    probabilities,
    sample,
)
from specexport.runtime.tree import AcceptMode, DraftTree, chain, children, path_tokens

MODES = (AcceptMode.WITH_REPLACEMENT, AcceptMode.WITHOUT_REPLACEMENT, AcceptMode.TOPK)  # the exact rules
TYPICAL_THRESHOLD, TYPICAL_ALPHA = 0.09, 0.3  # Medusa's published typical-acceptance defaults


@dataclass(frozen=True)
class Acceptance:
    path: list[int]  # accepted rows, root first (always starts with 0)
    tokens: list[int]  # emitted: the accepted draft tokens, then the bonus / correction token
    logprobs: list[TokenLogprob] | None = None  # each emitted token's, where asked (SamplingParams.logprobs)

    @property
    def accept_length(self) -> int:
        """Accepted draft tokens + 1 (plain decoding has accept length 1)."""
        return len(self.tokens)


def accept_greedy(tokens, parents, target_argmax) -> Acceptance:
    """Greedy target: descend into the first child whose token is the target's argmax at its parent.

    tokens, parents, target_argmax: [T]. The bonus is target_argmax at the last accepted row.
    """
    tokens, kids = _check_tree(tokens, parents)
    best = _check_rows(np.asarray(target_argmax), len(tokens), "target_argmax").tolist()
    node, path = 0, [0]
    while matches := [c for c in kids[node] if tokens[c] == best[node]]:
        node = matches[0]  # the first matching child; a later duplicate is never reached
        path.append(node)
    return Acceptance(path, [tokens[r] for r in path[1:]] + [int(best[node])])


def accept_chain(tokens, p, q, uniforms) -> Acceptance:
    """Leviathan/Chen speculative sampling on a chain: tokens[1:] were drawn from q[0], q[1], ...

    uniforms [T, 2]: u[r, 0] tests tokens[r + 1], u[r, 1] draws the final token at r.
    """
    return accept_tree(tokens, chain(np.size(tokens)), p, q, uniforms, "with_replacement")


def accept_tree(tokens, parents, p, q, uniforms, mode: AcceptMode | str = AcceptMode.WITH_REPLACEMENT) -> Acceptance:
    """Lossless acceptance on a tree of drafts (see the module docstring for the modes).

    tokens [T] int, parents [T]; p [T, V]: the processed target probabilities
    (`sampling.probabilities`); q [T, V]: the processed draft probabilities that node r's
    children were drawn from (None for "topk"); uniforms [T, K + 1] in [0, 1).
    The inputs are not modified.
    """
    mode = _mode(mode)
    tokens, kids = _check_tree(tokens, parents)
    p = _check_rows(np.asarray(p), len(tokens), "p", ndim=2)
    if mode is not AcceptMode.TOPK:
        q = _check_rows(np.asarray(q), len(tokens), "q", ndim=2)
        if q.shape != p.shape:
            raise ValueError(f"q has shape {q.shape}, p has {p.shape}")
    if min(tokens) < 0 or max(tokens) >= p.shape[1]:
        raise ValueError(f"tokens must lie in [0, {p.shape[1]}): {tokens}")
    uniforms = np.asarray(uniforms, dtype=np.float64)
    if uniforms.shape != (shape := (len(tokens), max(map(len, kids)) + 1)):
        raise ValueError(f"uniforms must have shape {shape} for this tree, got {uniforms.shape}")
    if uniforms.min() < 0 or uniforms.max() >= 1:
        raise ValueError("uniforms must lie in [0, 1)")

    node, path = 0, [0]
    while True:
        p_r, q_r = p[node], None if mode is AcceptMode.TOPK else q[node]
        for j, c in enumerate(kids[node]):
            x = tokens[c]
            if mode is AcceptMode.TOPK:
                accept = uniforms[node, j] < p_r[x]  # proposal is a point mass: ratio p(x) / 1
            elif q_r[x] == 0:
                continue  # the draft cannot have drawn x (e.g. a repeat without replacement): no such event
            else:
                accept = uniforms[node, j] * q_r[x] < p_r[x]  # u < min(1, p(x) / q(x))
            if accept:
                break
            p_r, q_r = _reject(p_r, q_r, x, mode)
        else:  # no child accepted (or a leaf): the target supplies the last token and the step ends
            emitted = [tokens[r] for r in path[1:]]
            return Acceptance(path, emitted + [sample(p_r, uniforms[node, -1])])
        node = c
        path.append(node)


def accept_typical(tokens, parents, p, uniforms, threshold: float = TYPICAL_THRESHOLD,
                   alpha: float = TYPICAL_ALPHA) -> Acceptance:
    """Medusa's typical acceptance: LOSSY, the output does not follow the target's distribution.

    Descend into the first child x with p_parent(x) > min(threshold, alpha * exp(-H(p_parent))), H the
    entropy; at the last accepted row the final token is drawn from p there with uniforms[row, -1]. Trades
    exactness for longer accepts at temperature > 0 (Medusa's default threshold 0.09, alpha 0.3).
    """
    tokens, kids = _check_tree(tokens, parents)
    p = _check_rows(np.asarray(p), len(tokens), "p", ndim=2)
    uniforms = np.asarray(uniforms, dtype=np.float64)
    node, path = 0, [0]
    while True:
        row = p[node]
        entropy = -float(np.sum(row * np.log(row + 1e-5)))
        bar = min(threshold, alpha * np.exp(-entropy))
        ok = [c for c in kids[node] if row[tokens[c]] > bar]
        if not ok:
            return Acceptance(path, [tokens[r] for r in path[1:]] + [sample(row, uniforms[node, -1])])
        node = ok[0]
        path.append(node)


def accept(tree: DraftTree, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
           context: Context | None = None) -> Acceptance:
    """A step's acceptance outside the graph, from the target's logits [T, V] over the tree: greedy, the longest
    path of the target's argmax; sampling, the exact rule for how the drafts were chosen (`tree.mode`), so the
    output follows the target's distribution, or Medusa's lossy typical acceptance when the tree asks for it.
    `context` (its history ending with the tree's root): what the rows follow, for the settings that depend on it
    (sampling.conditioned). The emitted tokens' logprobs, where the params ask, are read from the rows that drew
    them (the path's: row path[k] gives emitted token k), as plain decoding reads each from its own step's row."""
    chosen = _accept(tree, logits, params, rng, context)
    if params.logprobs is None:
        return chosen
    return replace(chosen, logprobs=logprobs(np.asarray(logits)[chosen.path], chosen.tokens, params.logprobs))


def _accept(tree: DraftTree, logits: np.ndarray, params: SamplingParams, rng: np.random.Generator,
            context: Context | None) -> Acceptance:
    tokens, parents = tree.tokens, tree.parents
    if context is not None:
        logits = conditioned(logits, params, context, path_tokens(tokens, parents))
    if params.greedy:
        return accept_greedy(tokens, parents, biased(logits, params).argmax(-1))
    p = probabilities(logits, params)
    u = rng.random(uniforms_shape(parents))
    if tree.mode is AcceptMode.TYPICAL:
        return accept_typical(tokens, parents, p, u)
    q = None if tree.mode is AcceptMode.TOPK else tree.q[:len(tokens)]
    return accept_tree(tokens, parents, p, q, u, tree.mode)


class Route(Enum):
    """Where one sequence's step is accepted, named by the outputs the target call brings back for it."""

    GRAPH = ("accept_rows", "bonus_token")  # in the target graph, batch 1 (exporter/fused.add_accept)
    GRAPH_BATCHED = ("batch_accept_mask", "batch_bonus")  # in the graph, a batched call's greedy (add_batch_accept)
    HOST = ("logits",)  # on the host, from the rows' logits (`accept`)

    @property
    def outputs(self) -> tuple[str, ...]:
        return self.value


@dataclass(frozen=True)
class Accepting:
    """What a target graph accepts itself (`of`), and so each step's route (`route`: the one place it is decided).
    `graph`: a step's tree, greedy; `sampling`: sampled steps too (the graph takes the random numbers); `batched`:
    each greedy sequence of a batched call."""

    graph: bool
    sampling: bool
    batched: bool

    @classmethod
    def of(cls, target) -> "Accepting":
        outputs = set(target.outputs)
        return cls(set(Route.GRAPH.outputs) <= outputs, bool(target.fused_inputs),
                   {"batch_accept_mask", "batch_accept_len", "batch_bonus"} <= outputs)

    def route(self, params: SamplingParams, mode: AcceptMode = AcceptMode.TOPK, batched: bool = False) -> Route:
        """E.g. greedy alone: GRAPH where the graph has the acceptance; Medusa's typical acceptance (lossy, host
        only): HOST; a sampled sequence of a batched call: HOST; min-p or a logit bias (`host_only`): HOST."""
        if params.host_only:
            return Route.HOST
        if batched:
            return Route.GRAPH_BATCHED if params.greedy and self.batched else Route.HOST
        if self.graph and (params.greedy or (self.sampling and mode is not AcceptMode.TYPICAL)):
            return Route.GRAPH
        return Route.HOST


def fused_inputs(tree: DraftTree, params: SamplingParams, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The inputs of the acceptance fused into the target graph (exporter/fused.py) for one step: the same random
    numbers, drawn the same way, as `accept` uses, so a seed gives the same tokens either way."""
    if params.greedy:
        return greedy_inputs(len(tree))
    u = rng.random(uniforms_shape(tree.parents))
    sampled = tree.mode is not AcceptMode.TOPK and len(tree) > 1
    return {"sample_u": u, "sample_q": tree.q[:len(tree)] if sampled else np.zeros((0, 0)),
            "sample_params": np.array([params.temperature, params.top_k, params.top_p,
                                       tree.mode is AcceptMode.WITHOUT_REPLACEMENT], np.float32)}


def greedy_inputs(rows: int) -> dict[str, np.ndarray]:
    """The fused acceptance's inputs for greedy decoding: no random numbers needed."""
    return {"sample_u": np.zeros((rows, 1), np.float32), "sample_q": np.zeros((0, 0), np.float32),
            "sample_params": np.array([0, 0, 1, 0], np.float32)}


def uniforms_shape(parents) -> tuple[int, int]:
    """The shape of `uniforms` for this tree: (T, most children of any node + 1)."""
    kids = children(parents)
    return len(kids), max(map(len, kids), default=0) + 1


def _mode(mode) -> AcceptMode:
    try:
        mode = AcceptMode(mode)
    except ValueError:
        mode = None
    if mode not in MODES:
        raise ValueError(f"mode must be one of {[m.value for m in MODES]}")
    return mode


def _reject(p: np.ndarray, q: np.ndarray | None, x: int, mode: AcceptMode) -> tuple[np.ndarray, np.ndarray | None]:
    """The target (and draft) distributions to test the next sibling with, after `x` was rejected.

    Returns new arrays. If the residual has no mass, falls back to p. That cannot happen exactly:
    max(0, p - q) = 0 means p <= q everywhere, so p == q and x was accepted with probability 1;
    a topk residual is empty only if p(x) = 1, also accepted surely. Only rounding gets here, and
    there p is the distribution the rule approximates.
    """
    if mode is AcceptMode.TOPK:
        residual = p.copy()
        residual[x] = 0.0
    else:
        residual = np.maximum(p - q, 0.0)
        if mode is AcceptMode.WITHOUT_REPLACEMENT:
            q = q.copy()
            q[x] = 0.0
            q = q / q.sum() if q.sum() > 0 else q  # all zero: no sibling can follow (each would be skipped)
    total = residual.sum()
    return (residual / total if total > 0 else p), q


def _check_tree(tokens, parents) -> tuple[list[int], list[list[int]]]:
    kids = children(parents)  # checks the topological order
    if not kids or sum(map(len, kids)) != len(kids) - 1:  # some node besides row 0 has parent -1
        raise ValueError(f"row 0 must be the only root (parents [-1, >=0, ...]), got {np.asarray(parents).tolist()}")
    return _check_rows(np.asarray(tokens), len(kids), "tokens").tolist(), kids


def _check_rows(a: np.ndarray, rows: int, name: str, ndim: int = 1) -> np.ndarray:
    if a.ndim != ndim or a.shape[0] != rows:
        want = f"[{rows}{', V' if ndim == 2 else ''}]"
        raise ValueError(f"{name} must have shape {want} for a tree of {rows} rows, got {a.shape}")
    if ndim == 1 and not np.issubdtype(a.dtype, np.integer):
        raise ValueError(f"{name} must be integers, got {a.dtype}")
    return a
