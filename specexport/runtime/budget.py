"""One tree budget for a batch: how many rows each sequence's tree gets in a batched step.

The batched target call pads every sequence's tree to the widest (runtime/scheduler.py), so it computes n x W rows
for n sequences at width W, whatever the trees hold: sharing rows unevenly would not make the call cheaper. The
budget is therefore one width W for the step, each tree cut to W nodes (DraftTree.truncated: its best-scored ones, or
its first ones where unscored: either way still a tree), W chosen to maximise the expected tokens per second of the
step:

    sum over sequences of E[tokens | W]  /  (latency(n sequences, width W) + the step's host time)

E[tokens | W] = 1 + sum of p_i over the W - 1 draft nodes a tree keeps, p_i the probability that node i is accepted
(`AcceptanceRates`, calibrated on the running method's own trees over the steps this engine verified so far). Where
the proposer scores its nodes (EAGLE's cumulative draft probability, suffix lookup's product of continuation
frequencies) each node is rated by its own score, calibrated by depth and half-octave: the budget sees which
sequences' drafts are likely this step and which are not, instead of one average per node index. Trees without
scores (Medusa's, n-gram's, a draft model's: the same shape every step) are rated per node index. The latency comes
from `BatchLatency`: the target's call time by sequences and width, measured by `specexport profile` and kept in the
profile (a bundle built with that profile carries it), or measured when the scheduler starts; refined by every call
it makes (the scale by every call, a wider width's cost relative to one row by the calls at it). With one
stream the budget weighs the same trade-off the profile tuned the method's tree for; as streams are added each row
costs more of the step and the trees shrink, smoothly, towards plain decoding (W = 1): no thresholds.

Proposing costs time outside the target's call too (a draft graph's calls for EAGLE or a draft model; a lookup for
suffix and n-gram; for every method the scoring, the width's choice and the longer paths' bookkeeping): before a
step proposes, `worth_drafting` weighs the best width with that cost (what the scheduler measured its last proposing
steps to cost over its last plain ones) against plain decoding (W = 1) without it; when drafting does not pay, the
step verifies every sequence's root alone and no proposer runs.

A request sampled with a seed keeps its proposer's whole tree: speculative sampling's tokens depend on the tree
(not their distribution, which is exact either way), and a seeded request must give the same tokens whatever it is
batched with.
"""

from __future__ import annotations

import math
import time
from functools import lru_cache

import numpy as np

from specexport.runtime import tree

GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # sequences and widths at which the latency is measured
BLEND = 0.05  # weight of a new call's time in the table's scale
CELL_BLEND = 0.3  # weight of a wider call's time in the grid points around it, relative to one-row calls
FORGET = 0.002  # each call takes this share of every grid point's own correction back towards the table
SCORE_BINS = 16  # half-octaves of a proposer's estimate of a node's acceptance, the last for 2^-7.5 and below
DEPTHS = 4  # depths calibrated apart: 1, 2, 3, and 4 or deeper
PRIOR = 2.0  # how many nodes' worth the estimate itself counts for in its cell's calibration


def grid(most: int) -> list[int]:
    """GRID's points below `most`, and `most`."""
    return [g for g in GRID if g < most] + [most]


class AcceptanceRates:
    """P(a node of a step's tree is accepted), from the steps seen. A tree whose proposer scored its nodes
    (DraftTree.scores: EAGLE's cumulative draft probability, suffix lookup's product of frequencies) is rated node by
    node: the estimate, calibrated by the acceptance of the nodes seen at the same depth with estimates in the same
    half-octave (the estimate itself counts as PRIOR nodes of its cell, so a cell starts at what the proposer says;
    the depth, because a deep node needs its ancestors accepted too, which a suffix match's frequencies do not
    price). Others are rated by node index (a static tree's node i is the same candidate every step). The root: 1."""

    def __init__(self, size: int):
        self.verified, self.accepted = np.zeros(size), np.zeros(size)  # by node index
        self.scored_verified, self.scored_accepted = np.zeros(DEPTHS * SCORE_BINS), np.zeros(DEPTHS * SCORE_BINS)

    def update(self, drafts: list[tree.DraftTree], paths: list[list[int]]) -> None:
        """Verified trees and their accepted paths (node indices, the root first), a step's at once; a root alone
        tells nothing."""
        seen = [(d, p) for d, p in zip(drafts, paths) if len(d) > 1]
        if not seen:
            return
        size = len(self.verified)
        sizes = np.minimum([len(d) for d, _ in seen], size)
        self.verified += np.cumsum(np.bincount(sizes, minlength=size + 1)[::-1])[::-1][1:]  # trees longer than i
        self.accepted += np.bincount(np.concatenate([p for _, p in seen]), minlength=size)[:size]
        scored = [(d, np.asarray(p[1:], np.int64) - 1) for d, p in seen if d.scores is not None]
        if scored:
            cells = _cells([d for d, _ in scored], [np.arange(1, len(d)) for d, _ in scored])
            starts = np.cumsum([0] + [len(d) - 1 for d, _ in scored[:-1]])
            hits = cells[np.concatenate([p + start for (_, p), start in zip(scored, starts)])]
            self.scored_verified += np.bincount(cells, minlength=DEPTHS * SCORE_BINS)
            self.scored_accepted += np.bincount(hits, minlength=DEPTHS * SCORE_BINS)

    def expected(self, nodes: int) -> np.ndarray:
        """Expected tokens of the first 1..nodes nodes of a tree rated by index: 1 (the bonus) + the accepted drafts
        among them."""
        p = (self.accepted[:nodes] + 1) / (self.verified[:nodes] + 2)
        p[0] = 1.0
        return np.cumsum(p)

    def curves(self, drafts: list[tree.DraftTree]) -> list[np.ndarray]:
        """Expected tokens of each tree cut to 1..len(draft) nodes (DraftTree.truncated: its best nodes, by score), a
        step's trees at once."""
        curves = [self.expected(len(d)) if d.scores is None or len(d) < 2 else None for d in drafts]
        scored = [d for d, c in zip(drafts, curves) if c is None]
        if scored:
            orders = [np.array(d.best_first()[1:], np.int64) for d in scored]
            estimate = np.exp(np.concatenate([np.asarray(d.scores, float)[o] for d, o in zip(scored, orders)]))
            cells = _cells(scored, orders)
            p = (self.scored_accepted[cells] + PRIOR * estimate) / (self.scored_verified[cells] + PRIOR)
            parts = iter(np.split(p, np.cumsum([len(o) for o in orders])[:-1]))
            curves = [np.concatenate(([1.0], 1.0 + np.cumsum(next(parts)))) if c is None else c for c in curves]
        return curves


def _cells(drafts: list[tree.DraftTree], nodes: list[np.ndarray]) -> np.ndarray:
    """The calibration cell of each tree's `nodes`, concatenated: the node's depth (DEPTHS and deeper together) and
    the half-octave of its estimate (0 for (0.71, 1], 1 for (0.5, 0.71], ... the last for all below)."""
    depth = np.minimum(np.concatenate([tree.depths(d.parents)[n] for d, n in zip(drafts, nodes)]), DEPTHS) - 1
    scores = np.concatenate([np.asarray(d.scores, float)[n] for d, n in zip(drafts, nodes)])
    half_octaves = (-scores * 2 / np.log(2)).astype(np.int64)
    return depth * SCORE_BINS + np.minimum(half_octaves, SCORE_BINS - 1)


class BatchLatency:
    """Seconds of one target call of n sequences at width W (n x W rows): measured on a grid of both, bilinear
    between its points (linear beyond its last ones), and learned from the calls made (`observe`)."""

    def __init__(self, sequences: list[int], widths: list[int], seconds):
        self.sequences, self.widths = np.array(sequences, float), np.array(widths, float)
        self.seconds = np.array(seconds, float).reshape(len(sequences), len(widths))  # as measured, x a common scale
        self.local = np.zeros_like(self.seconds)  # each grid point's own correction (a log factor) from calls near it
        self.base = np.zeros(len(sequences))  # one-row calls' recent miss (a log factor after the scale), by sequences
        self.based = np.zeros(len(sequences))  # how much of `base` comes from calls (0: none yet)

    @classmethod
    def measure(cls, target, pool, sequences: list[int], widths: list[int], context: int = 128, repeats: int = 1
                ) -> "BatchLatency":
        """Time calls of n chains of W tokens, each after `context` rows of its own (the pool's first n slots; the
        rows are scratch: nothing is committed, and the slots' lengths are restored). The best of `repeats` calls
        after one warm-up (a shape's first call is slower)."""
        context = max(0, min(context, pool.capacity - max(widths)))
        saved = pool.lengths.copy()
        seconds = np.zeros((len(sequences), len(widths)))
        try:
            for i, n in enumerate(sequences):
                pool.lengths[:n] = context
                for j, w in enumerate(widths):
                    ids, positions = np.zeros((n, w), np.int64), np.broadcast_to(context + np.arange(w), (n, w))
                    mask = np.broadcast_to(tree.causal_mask(w), (n, w, w))
                    best = float("inf")
                    for _ in range(repeats + 1):
                        start = time.perf_counter()
                        target.forward(pool.rows(n), ids, positions, mask, np.arange(n * w), want=("logits",))
                        best = min(best, time.perf_counter() - start)
                    seconds[i, j] = best
        finally:
            pool.lengths[:] = saved
        return cls(sequences, widths, seconds)

    @classmethod
    def from_measurements(cls, measurements: dict) -> "BatchLatency | None":
        """The table a profile's [measurements] keeps (batch_sequences, batch_widths, batch_ms); None without one."""
        sequences, widths = measurements.get("batch_sequences") or (), measurements.get("batch_widths") or ()
        ms = measurements.get("batch_ms") or ()
        if not sequences or not widths or np.shape(ms) != (len(sequences), len(widths)):
            return None
        return cls(list(sequences), list(widths), np.array(ms, float) / 1000)

    def __call__(self, sequences: int, width):
        """Seconds for `sequences` sequences at `width` (a number, or an array of widths)."""
        by_width = _along(sequences, self.sequences, self.seconds * np.exp(self.local))
        seconds = np.maximum(_along(width, self.widths, by_width), 1e-6)
        return float(seconds) if seconds.ndim == 0 else seconds

    def observe(self, sequences: int, width: int, seconds: float) -> None:
        """A call's measured time. The whole table's scale moves towards it (BLEND): what the measurement did not see
        alike for every size (a busier machine, longer contexts). A wider call also teaches the grid points around
        it what it costs relative to one-row calls of about as many sequences made lately (CELL_BLEND): the ratio
        the budget decides by, which the measurement can miss (on the 2-core CPU a second row for each of 16
        sequences measured 1.35x one row at 128 tokens of context, 1.75x in a serving run's calls). Calls of one
        size alone scale every size alike. A point's own correction fades while no call comes near it (FORGET): a
        width once measured dear is tried again later rather than never."""
        predicted = self(sequences, width)
        scale = 1 + BLEND * (seconds / predicted - 1)
        self.seconds *= scale
        miss = math.log(seconds / (predicted * scale))  # against the rescaled table's prediction
        near = _hats(sequences, self.sequences)
        self.local *= 1 - FORGET
        if width <= self.widths[0]:
            self.base += CELL_BLEND * near * (miss - self.base)
            self.based += CELL_BLEND * near * (1 - self.based)
        elif near @ self.based > 0.5:
            relative = miss - (near @ self.base)
            self.local += CELL_BLEND * relative * np.outer(near, _hats(width, self.widths))

    def as_ms(self) -> list[list[float]]:
        return [[round(1000 * s, 3) for s in row] for row in self.seconds]


def _along(x, xs: np.ndarray, table: np.ndarray):
    """`table` (one row, or one value, per point of `xs`) interpolated at x (a number, or an array of them against a
    1-D table): linear between the points, along the last segment beyond the last point (a call wider than the grid
    costs more, not the same), the first row before the first point."""
    if len(xs) == 1:
        return np.broadcast_to(table[0], np.shape(x)) if table.ndim == 1 else table[0]
    k = np.clip(np.searchsorted(xs, x), 1, len(xs) - 1)  # xs[k - 1] < x <= xs[k], or the first or last segment
    share = np.maximum((np.asarray(x, float) - xs[k - 1]) / (xs[k] - xs[k - 1]), 0.0)
    return table[k - 1] + share * (table[k] - table[k - 1])


def _hats(x: float, xs: np.ndarray) -> np.ndarray:
    """The weights of the points `xs` in the linear interpolation at x (summing to 1; the nearest edge's beyond)."""
    return _weights(float(min(x, xs[-1])), tuple(xs.tolist()))


@lru_cache(maxsize=4096)
def _weights(x: float, xs: tuple[float, ...]) -> np.ndarray:
    """`_hats`, kept per point and grid (read-only): every step asks for the same few, and host work right after a
    target call runs with cold caches (on the 2-core CPU `observe` took 42 us in a loop, ~300 us after a call)."""
    weights = _along(x, np.array(xs), np.eye(len(xs)))
    weights.flags.writeable = False
    return weights


def choose_width(curves: list[np.ndarray], latency: BatchLatency, host_s: float, kept: list[bool] | None = None,
                 row_s: float = 0.0, sampled: list[bool] | None = None) -> int:
    """The width W (1..the longest tree) with the most expected tokens per second for trees whose expected tokens
    cut to 1, 2, ... nodes are `curves` (AcceptanceRates.curves); the trees marked `kept` stay whole (their rows make
    the call at least as wide as the longest of them). `host_s`: the step's host time; `row_s`: the host's time per
    row of a `sampled` tree it accepts (the target's distribution over the vocabulary, row by row)."""
    kept = np.array(kept or [False] * len(curves))
    sampled = np.array(sampled or [False] * len(curves))
    sizes = np.array([len(c) for c in curves])
    floor = int(sizes[kept].max()) if kept.any() else 1
    widths = np.arange(1, int(sizes.max()) + 1)
    nodes = np.where(kept, sizes, np.minimum(widths[:, None], sizes))  # [widths, sequences]: each tree's nodes
    table = np.empty((len(curves), len(widths)))  # [sequences, widths]: a tree's tokens stop growing at its size
    for row, c in zip(table, curves):
        row[:len(c)], row[len(c):] = c, c[-1]
    tokens = table[np.arange(len(curves)), nodes - 1].sum(axis=1)
    rate = tokens / (latency(len(curves), np.maximum(widths, floor)) + host_s + row_s * nodes[:, sampled].sum(axis=1))
    return int(widths[np.argmax(rate)])  # the first best: the narrowest of equals


def worth_drafting(sequences: int, size: int, rates: AcceptanceRates, latency: BatchLatency, host_s: float,
                   draft_s: float, row_s: float = 0.0, sampled: int = 0) -> bool:
    """Whether a step of `sequences` sequences should propose trees (of `size` nodes at most): the most expected tokens
    per second over widths 2..size, `draft_s` (the proposals' time) and the host's acceptance of the `sampled` ones'
    rows (`row_s` each) included, beat plain decoding's (width 1)."""
    if size < 2:
        return False
    widths = np.arange(2, size + 1)
    tokens = sequences * rates.expected(size)[widths - 1]
    drafting = tokens / (latency(sequences, widths) + host_s + draft_s + row_s * sampled * widths)
    return bool(drafting.max() > sequences / (latency(sequences, 1) + host_s + row_s * sampled))
