"""One tree budget for a batch: how many rows each sequence's tree gets in a batched step.

The batched target call pads every sequence's tree to the widest (runtime/scheduler.py); a graph that takes ragged
rows (exporter/graph.py: the ort flavour's tree graphs) computes the real rows only, but its attention runs in the
padded layout, so a call costs its real rows and its width (`BatchLatency`). The budget (`share`) gives the step's
rows to the nodes with the most value across the batch: each tree cut to its best k_i nodes (DraftTree.truncated:
its best-scored ones, or its first ones where unscored: either way still a tree), the k_i chosen to maximise the
expected tokens per second of the step:

    sum over sequences of E[tokens | k_i]  /  (latency(n sequences, width max k_i, k_1 + .. + k_n real rows) + host)

(a graph without ragged rows computes n x max k_i rows: there a width's rows cost nothing more once it is paid).

E[tokens | k] = 1 + sum of p_i over the k - 1 draft nodes a tree keeps, p_i the probability that node i is accepted
(`AcceptanceRates`, calibrated on the running method's own trees over the steps this engine verified so far). Where
the proposer scores its nodes (EAGLE's cumulative draft probability, suffix lookup's product of continuation
frequencies) each node is rated by its own score, calibrated by depth and half-octave: the budget sees which
sequences' drafts are likely this step and which are not, instead of one average per node index. Trees without
scores (Medusa's, n-gram's, a draft model's: the same shape every step) are rated per node index. The latency comes
from `BatchLatency`: the target's call time by sequences and width (and, for ragged rows, the same widths with one
real row a sequence), measured by `specexport profile` and kept in the profile (a bundle built with that profile
carries it), or measured when the scheduler starts; refined by every call it makes (the scale by every call, a wider
width's cost relative to one row by the calls at it). With one stream the budget weighs the same trade-off the
profile tuned the method's tree for; as streams are added each row costs more of the step and the trees shrink,
smoothly, towards plain decoding (one row each): no thresholds; in between, the sequences whose drafts are likely
keep nodes and the others verify their root alone.

Proposing costs time outside the target's call too (a draft graph's calls for EAGLE or a draft model; a lookup for
suffix and n-gram; for every method the scoring, the width's choice and the longer paths' bookkeeping): before a
step proposes, `worth_drafting` weighs what the last proposing steps chose (their expected tokens and rows per
sequence) with that cost (what the scheduler measured its last proposing steps to cost over its last plain ones)
against plain decoding without it; when drafting does not pay, the step verifies every sequence's root alone and no
proposer runs.

A request sampled with a seed keeps its proposer's whole tree: speculative sampling's tokens depend on the tree
(not their distribution, which is exact either way), and a seeded request must give the same tokens whatever it is
batched with.
"""

from __future__ import annotations

import bisect
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
FOLD = 16  # verified trees AcceptanceRates keeps before counting them, calls BatchLatency before learning from them


def grid(most: int) -> list[int]:
    """GRID's points below `most`, and `most`."""
    return [g for g in GRID if g < most] + [most]


class AcceptanceRates:
    """P(a node of a step's tree is accepted), from the steps seen. A tree whose proposer scored its nodes
    (DraftTree.scores: EAGLE's cumulative draft probability, suffix lookup's product of frequencies) is rated node by
    node: the estimate, calibrated by the acceptance of the nodes seen at the same depth with estimates in the same
    half-octave (the estimate itself counts as PRIOR nodes of its cell, so a cell starts at what the proposer says;
    the depth, because a deep node needs its ancestors accepted too, which a suffix match's frequencies do not
    price). Others are rated by node index (a static tree's node i is the same candidate every step). The root: 1.

    Trees are counted FOLD at a time, or when the rates are read (every read sees every tree): counting costs about
    the same for one tree as for a batch's (~60-90 us on the 2-core CPU), and one stream's steps bring one each."""

    def __init__(self, size: int):
        # verified and accepted nodes by node index; by calibration cell, of scored trees
        self._counts = (np.zeros(size), np.zeros(size), np.zeros(DEPTHS * SCORE_BINS), np.zeros(DEPTHS * SCORE_BINS))
        self._pending: list[tuple[tree.DraftTree, list[int]]] = []

    def update(self, drafts: list[tree.DraftTree], paths: list[list[int]]) -> None:
        """Verified trees and their accepted paths (node indices, the root first), a step's at once; a root alone
        tells nothing."""
        self._pending += [(d, p) for d, p in zip(drafts, paths) if len(d) > 1]
        if len(self._pending) >= FOLD:
            self.counts()

    def counts(self) -> tuple[np.ndarray, ...]:
        """Verified and accepted nodes by node index, and by calibration cell of the scored trees: every tree updated
        so far counted."""
        seen, self._pending = self._pending, []
        if not seen:
            return self._counts
        verified, accepted, scored_verified, scored_accepted = self._counts
        size = len(verified)
        sizes = np.minimum([len(d) for d, _ in seen], size)
        verified += np.cumsum(np.bincount(sizes, minlength=size + 1)[::-1])[::-1][1:]  # trees longer than i
        accepted += np.bincount(np.concatenate([p for _, p in seen]), minlength=size)[:size]
        scored = [(d, np.asarray(p[1:], np.int64) - 1) for d, p in seen if d.scores is not None]
        if scored:
            cells = _cells([d for d, _ in scored], [np.arange(1, len(d)) for d, _ in scored])
            starts = np.cumsum([0] + [len(d) - 1 for d, _ in scored[:-1]])
            hits = cells[np.concatenate([p + start for (_, p), start in zip(scored, starts)])]
            scored_verified += np.bincount(cells, minlength=DEPTHS * SCORE_BINS)
            scored_accepted += np.bincount(hits, minlength=DEPTHS * SCORE_BINS)
        return self._counts

    def expected(self, nodes: int) -> np.ndarray:
        """Expected tokens of the first 1..nodes nodes of a tree rated by index: 1 (the bonus) + the accepted drafts
        among them."""
        verified, accepted = self.counts()[:2]
        p = (accepted[:nodes] + 1) / (verified[:nodes] + 2)
        p[0] = 1.0
        return np.cumsum(p)

    def curves(self, drafts: list[tree.DraftTree]) -> list[np.ndarray]:
        """Expected tokens of each tree cut to 1..len(draft) nodes (DraftTree.truncated: its best nodes, by score), a
        step's trees at once."""
        by_index = self.expected(len(self._counts[0]))  # a tree rated by index: a prefix of it (a root alone: [1])
        curves = [by_index[:len(d)] if d.scores is None or len(d) < 2 else None for d in drafts]
        scored = [d for d, c in zip(drafts, curves) if c is None]
        if scored:
            orders = [np.array(d.best_first()[1:], np.int64) for d in scored]
            estimate = np.exp(np.concatenate([np.asarray(d.scores, float)[o] for d, o in zip(scored, orders)]))
            cells = _cells(scored, orders)
            _, _, verified, accepted = self.counts()
            p = (accepted[cells] + PRIOR * estimate) / (verified[cells] + PRIOR)
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
    """Seconds of one target call of n sequences padded to width W (n x W rows): measured on a grid of both, bilinear
    between its points (linear beyond its last ones), and learned from the calls made (`observe`).

    A graph with ragged rows (exporter/graph.py) computes a call's real rows only, but attention still runs in the
    padded layout: a call's cost is not its rows alone. On the 2-core CPU (16 sequences, 300 rows of context) 16 rows
    at width 1 took 51.7 ms, the same 16 real rows at width 2 59.5 ms, 17 rows at width 2 60.4, 32 at 77.1: every row
    ~1.1 ms, and a second width ~8 ms. So where the graph takes ragged rows the table keeps a second grid, `single`:
    the call at width W with one real row a sequence (its width's cost alone), and a call of R real rows costs
    single + (dense - single) * (R - n) / (n W - n), linear in its real rows between the two (measured so)."""

    def __init__(self, sequences: list[int], widths: list[int], seconds, single=None):
        self.sequences, self.widths = np.array(sequences, float), np.array(widths, float)
        self.points = (tuple(self.sequences.tolist()), tuple(self.widths.tolist()))  # the grid, as `_weights` keys
        shape = (len(sequences), len(widths))
        self.seconds = np.array(seconds, float).reshape(shape)  # as measured, x a common scale
        # one real row a sequence at each width (graphs with ragged rows; None: every row is computed)
        self.single = None if single is None else np.array(single, float).reshape(shape)
        self.local = np.zeros_like(self.seconds)  # each grid point's own correction (a log factor) from calls near it
        self.base = np.zeros(len(sequences))  # one-row calls' recent miss (a log factor after the scale), by sequences
        self.based = np.zeros(len(sequences))  # how much of `base` comes from calls (0: none yet)
        self._pending: list[tuple] = []  # calls observed, not yet learned from (`observe`)
        self._price()

    @classmethod
    def measure(cls, target, pool, sequences: list[int], widths: list[int], context: int = 128, repeats: int = 1
                ) -> "BatchLatency":
        """Time calls of n chains of W tokens, each after `context` rows of its own (the pool's first n slots; the
        rows are scratch: nothing is committed, and the slots' lengths are restored), and where the graph takes
        ragged rows the same calls with one real row a sequence. The best of `repeats` calls after one warm-up (a
        shape's first call is slower)."""
        context = max(0, min(context, pool.capacity - max(widths)))
        saved = pool.lengths.copy()
        seconds = np.zeros((2, len(sequences), len(widths)))
        try:
            for i, n in enumerate(sequences):
                pool.lengths[:n] = context
                for j, w in enumerate(widths):
                    ids, positions = np.zeros((n, w), np.int64), np.broadcast_to(context + np.arange(w), (n, w))
                    mask = np.broadcast_to(tree.causal_mask(w), (n, w, w))
                    calls = [(None, np.arange(n * w))]
                    if target.ragged and w > 1:  # at width 1 one real row a sequence is every row
                        calls.append((np.ones(n, np.int64), np.arange(n) * w))
                    for k, (live, selected) in enumerate(calls):
                        best = float("inf")
                        for _ in range(repeats + 1):
                            start = time.perf_counter()
                            target.forward(pool.rows(n), ids, positions, mask, selected, want=("logits",), live=live)
                            best = min(best, time.perf_counter() - start)
                        seconds[k, i, j] = best
                    seconds[len(calls):, i, j] = seconds[0, i, j]
        finally:
            pool.lengths[:] = saved
        return cls(sequences, widths, seconds[0], seconds[1] if target.ragged else None)

    @classmethod
    def from_measurements(cls, measurements: dict) -> "BatchLatency | None":
        """The table a profile's [measurements] keeps (batch_sequences, batch_widths, batch_ms, and batch_single_ms
        where it measured a graph with ragged rows); None without one."""
        sequences, widths = measurements.get("batch_sequences") or (), measurements.get("batch_widths") or ()
        ms, single = measurements.get("batch_ms") or (), measurements.get("batch_single_ms") or ()
        if not sequences or not widths or np.shape(ms) != (len(sequences), len(widths)):
            return None
        single = np.array(single, float) / 1000 if np.shape(single) == np.shape(ms) else None
        return cls(list(sequences), list(widths), np.array(ms, float) / 1000, single)

    def __call__(self, sequences: int, width, rows=None):
        """Seconds for `sequences` sequences padded to `width`, of which `rows` real rows in all where the graph takes
        ragged rows (None: every row; width and rows: numbers, or arrays that broadcast together)."""
        if self._pending:
            self._learn()
        tables = _along(width, self.points[1], _weights(float(sequences), self.points[0]) @ self.priced)
        seconds = tables[0]
        if len(tables) > 1 and rows is not None:  # between the width alone and every row of it, by the real rows
            alone = tables[1]
            padded = sequences * np.maximum(width, 1.0)
            real = np.minimum(np.maximum((rows - sequences) / np.maximum(padded - sequences, 1e-9), 0.0), 1.0)
            seconds = alone + real * (seconds - alone)
        seconds = np.maximum(seconds, 1e-6)
        return float(seconds) if _scalar(seconds) else seconds

    def observe(self, sequences: int, width: int, seconds: float, rows: int | None = None) -> None:
        """A call's measured time (`rows`: its real rows, where the graph takes ragged rows). The whole table's scale
        moves towards it (BLEND): what the measurement did not see alike for every size (a busier machine, longer
        contexts). A wider call also teaches the grid points around it what it costs relative to one-row calls of
        about as many sequences made lately (CELL_BLEND): the ratio the budget decides by, which the measurement can
        miss (on the 2-core CPU a second row for each of 16 sequences measured 1.35x one row at 128 tokens of
        context, 1.75x in a serving run's calls). Calls of one size alone scale every size alike. A point's own
        correction fades while no call comes near it (FORGET): a width once measured dear is tried again later rather
        than never. The one-row point is what one-row calls measure: a wider call between grid points corrects the
        wider ones alone, until the interpolation meets it.

        Calls are learned from FOLD at a time, or when the table is read (every read sees every call, in order): right
        after a target call the host's caches are cold, and one stream's steps read nothing."""
        self._pending.append((sequences, width, seconds, rows))
        if len(self._pending) >= FOLD:
            self._learn()

    def _learn(self) -> None:
        """Learn from `observe`'s calls, in order."""
        calls, self._pending = self._pending, []
        for sequences, width, seconds, rows in calls:
            predicted = self(sequences, width, rows)
            scale = 1 + BLEND * (seconds / predicted - 1)
            self.seconds *= scale
            if self.single is not None:
                self.single *= scale
            miss = math.log(seconds / (predicted * scale))  # against the rescaled table's prediction
            near = _hats(sequences, self.points[0])
            self.local *= 1 - FORGET
            if width <= self.widths[0]:
                self.base += CELL_BLEND * near * (miss - self.base)
                self.based += CELL_BLEND * near * (1 - self.based)
            elif near @ self.based > 0.5:  # the wider points around it (one-row calls alone correct the first)
                relative = miss - (near @ self.base)
                wider = _hats(width, self.points[1]).copy()
                wider[0] = 0.0
                self.local += CELL_BLEND * relative * np.outer(near, wider / wider.sum())
            self._price()

    def _price(self) -> None:
        """The tables as `__call__` reads them, stacked [dense (, single)]: with each point's own correction."""
        factor = np.exp(self.local)
        self.priced = np.stack([self.seconds * factor] + ([] if self.single is None else [self.single * factor]))

    def as_ms(self, single: bool = False) -> list[list[float]]:
        if self._pending:
            self._learn()
        return [[round(1000 * s, 3) for s in row] for row in (self.single if single else self.seconds)]


def _along(x, points: tuple[float, ...], values: np.ndarray):
    """`values` (one per point along their last axis) interpolated at x, a number or an array of them (`_weights`):
    values' leading axes, then x's."""
    if _scalar(x):
        return values @ _weights(float(x), points)
    xs = _grid(points)
    if len(xs) == 1:
        return values[..., :1].reshape(values.shape[:-1] + (1,) * x.ndim) + np.zeros(x.shape)  # its value everywhere
    k = np.minimum(np.maximum(np.searchsorted(xs, x), 1), len(xs) - 1)
    share = np.maximum((np.asarray(x, float) - xs[k - 1]) / (xs[k] - xs[k - 1]), 0.0)
    return values[..., k - 1] + share * (values[..., k] - values[..., k - 1])


def _scalar(x) -> bool:
    return not isinstance(x, np.ndarray) or x.ndim == 0


@lru_cache(maxsize=64)
def _grid(points: tuple[float, ...]) -> np.ndarray:
    """The points as an array (read-only), kept per grid."""
    xs = np.array(points)
    xs.flags.writeable = False
    return xs


def _hats(x: float, points: tuple[float, ...]) -> np.ndarray:
    """The weights of the points in the linear interpolation at x (summing to 1; the nearest edge's beyond)."""
    return _weights(float(min(x, points[-1])), points)


@lru_cache(maxsize=4096)
def _weights(x: float, points: tuple[float, ...]) -> np.ndarray:
    """The weights of the points (ascending) in the interpolation at x: linear between them, along the last segment
    beyond the last (a call wider than the grid costs more, not the same), the first point's value before the first.
    Kept per x and grid (read-only): every step asks for the same few, and host work right after a target call runs
    with cold caches (on the 2-core CPU `observe` took 42 us in a loop, ~300 us after a call)."""
    weights = np.zeros(len(points))
    if len(points) == 1:
        weights[0] = 1.0
    else:
        k = min(max(bisect.bisect_left(points, x), 1), len(points) - 1)  # points[k - 1] < x <= points[k], or an end
        share = max((x - points[k - 1]) / (points[k] - points[k - 1]), 0.0)
        weights[k - 1], weights[k] = 1.0 - share, share
    weights.flags.writeable = False
    return weights


def share(curves: list[np.ndarray], latency: BatchLatency, host_s: float, kept: list[bool] | None = None,
          row_s: float = 0.0, sampled: list[bool] | None = None) -> np.ndarray:
    """How many nodes each tree keeps (1..its size) for the most expected tokens per second, the trees' expected
    tokens cut to 1, 2, ... nodes being `curves` (AcceptanceRates.curves); the trees marked `kept` stay whole. The
    draft nodes of all trees are ranked together by the tokens each adds per second its row costs, made
    non-increasing along its tree (so the first k of the ranking keep a prefix of every tree: the nodes its cut
    keeps); the call is padded to the widest cut, so for each width W the step may take the first k of the ranked
    nodes that fit in W, and it takes the W and k with the most expected tokens per second, the call costed by
    `latency` at W with its real rows (a graph without ragged rows pays W for every sequence: there a width's nodes
    cost nothing more, but for a sampled tree's host time). Besides the call, the step costs `host_s` (its host time)
    and `row_s` for each row of a `sampled` tree (the host accepts those from the target's distribution, row by
    row)."""
    n = len(curves)
    kept = np.array(kept or [False] * n)
    sampled = np.array(sampled or [False] * n)
    sizes = np.array([len(c) for c in curves])
    cut = np.flatnonzero(~kept & (sizes > 1))  # the trees whose cut is chosen
    counts = np.where(kept, sizes, 1)
    if not len(cut):
        return counts
    gains = [np.diff(curves[i]) for i in cut]
    owner = np.repeat(cut, sizes[cut] - 1)  # each candidate node's tree
    place = np.concatenate([np.arange(2, len(g) + 2) for g in gains])  # each node's place in its tree's cut
    # a row's cost, for the ranking: the call's (a real row more at width 2) and, a sampled tree's, the host's
    one, more = np.broadcast_to(latency(n, 2, np.array([n, n + 1.0])), 2)
    row = max(more - one, 1e-9) + row_s * sampled[cut]
    ranked = np.concatenate([np.minimum.accumulate(g) / r for g, r in zip(gains, row)])
    order = np.argsort(-ranked, kind="stable")
    widths = np.arange(max(counts.max(), 1), sizes.max() + 1)  # the call's width: the widest cut, kept trees too
    fits = np.zeros((len(widths), len(order) + 1), bool)  # each width's nodes, in ranked order (the first: none)
    fits[:, 1:] = place[order] <= widths[:, None]
    taken = np.cumsum(fits, axis=1)  # nodes taken by the width's first k of the ranking, at each place of it
    gain = np.concatenate(([0.0], np.concatenate(gains)[order]))
    tokens = sum(float(curves[i][k - 1]) for i, k in enumerate(counts)) + np.cumsum(fits * gain, axis=1)
    sampled_rows = counts[sampled].sum() + np.cumsum(fits * np.concatenate(([0], sampled[owner[order]])), axis=1)
    seconds = latency(n, widths[:, None], counts.sum() + taken)
    rate = tokens / (seconds + host_s + row_s * sampled_rows)
    w, k = np.unravel_index(int(np.argmax(rate)), rate.shape)  # the first best: the narrowest, fewest rows of equals
    chosen = order[:k][fits[w, 1:k + 1]]
    return counts + np.bincount(owner[chosen], minlength=n)


def worth_drafting(sequences: int, tokens: float, rows: float, width: float, latency: BatchLatency, host_s: float,
                   draft_s: float, row_s: float = 0.0, sampled: int = 0) -> bool:
    """Whether a step of `sequences` sequences should propose trees, expecting what the last proposing steps chose
    (`share`): `tokens` and `rows` per sequence from a call `width` wide, at the cost of `draft_s` (the proposals'
    time) and the host's acceptance of the `sampled` ones' rows (`row_s` each), against plain decoding's one row per
    sequence."""
    drafting = sequences * tokens / (latency(sequences, width, sequences * rows) + host_s + draft_s
                                     + row_s * sampled * rows)
    return bool(drafting > sequences / (latency(sequences, 1) + host_s + row_s * sampled))
