"""One tree budget for a batch: how many rows each sequence's tree gets in a batched step.

The batched target call pads every sequence's tree to the widest (runtime/scheduler.py), so it computes n x W rows
for n sequences at width W, whatever the trees hold: sharing rows unevenly would not make the call cheaper. The
budget is therefore one width W for the step, each tree cut to its first W nodes (a prefix of a tree in topological
order is a tree, and every proposer's truncation already works that way), W chosen to maximise the expected tokens
per second of the step:

    sum over sequences of E[tokens | W]  /  (latency(n * W rows) + the step's host time)

E[tokens | W] = 1 + sum of p_i over the first W - 1 draft nodes, p_i the probability that node i of a step's tree is
accepted, counted per node index over the steps this engine verified so far (`AcceptanceRates`, a Beta(1, 1) prior:
calibrated on the running method's own trees, whatever the method). The latency comes from `LatencyCurve`: the
target's call time by rows, measured when the scheduler starts and refined by every call it makes. With one stream
the budget weighs the same trade-off the profile tuned the method's tree for; as streams are added each row costs
more of the step and the trees shrink, smoothly, towards plain decoding (W = 1): no thresholds.

A request sampled with a seed keeps its proposer's whole tree: speculative sampling's tokens depend on the tree
(not their distribution, which is exact either way), and a seeded request must give the same tokens whatever it is
batched with.
"""

from __future__ import annotations

import time

import numpy as np

from specexport.runtime import tree

GRID = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # rows at which the latency is kept
BLEND = 0.05  # weight of a new call's time in the curve's scale


class AcceptanceRates:
    """P(node i of a step's tree is accepted), per node index i, over the steps seen (root: 1)."""

    def __init__(self, size: int):
        self.verified = np.zeros(size)
        self.accepted = np.zeros(size)

    def update(self, nodes: int, path: list[int]) -> None:
        self.verified[:nodes] += 1
        self.accepted[path] += 1

    def expected(self, nodes: int) -> np.ndarray:
        """Expected tokens of the first 1..nodes nodes: 1 (the bonus) + the accepted drafts among them."""
        p = (self.accepted[:nodes] + 1) / (self.verified[:nodes] + 2)
        p[0] = 1.0
        return np.cumsum(p)


class LatencyCurve:
    """Seconds of one target call by the rows it computes: measured at GRID points, linear between them."""

    def __init__(self, rows: list[int], seconds: list[float]):
        self.rows, self.seconds = np.array(rows, float), np.array(seconds, float)

    @classmethod
    def measure(cls, target, pool, max_rows: int, repeats: int = 2) -> "LatencyCurve":
        """Time chains of GRID rows (up to `max_rows`) on slot 0 of `pool` (nothing committed: its rows are
        scratch until a sequence prefills there)."""
        cache = pool.slot(0)
        rows = [r for r in GRID if r < max_rows] + [max_rows]
        seconds = []
        for r in rows:
            ids, positions = np.zeros((1, r), np.int64), np.arange(r)[None]
            best = float("inf")
            for _ in range(repeats + 1):  # the first call of a shape is a warm-up
                start = time.perf_counter()
                target.forward(cache, ids, positions, tree.causal_mask(r), np.arange(r), want=("logits",))
                best = min(best, time.perf_counter() - start)
            seconds.append(best)
        return cls(rows, seconds)

    def __call__(self, rows: int) -> float:
        return float(np.interp(rows, self.rows, self.seconds))

    def observe(self, rows: int, seconds: float) -> None:
        """A call's measured time rescales the whole curve towards it: what the start's calls did not see (longer
        contexts, several sequences' attention, a busier machine) scales every size alike, so the sizes a step
        compares keep the ratios they were measured with (refining one point alone would favour the sizes seldom
        called)."""
        self.seconds *= 1 + BLEND * (seconds / max(self(rows), 1e-9) - 1)


def choose_width(lengths: list[int], rates: AcceptanceRates, latency: LatencyCurve, host_s: float,
                 kept: list[bool] | None = None) -> int:
    """The width W (1..the longest tree) with the most expected tokens per second for trees of these lengths; the
    trees marked `kept` stay whole (their rows make the call at least as wide as the longest of them)."""
    kept = kept or [False] * len(lengths)
    longest, floor = max(lengths), max((n for n, k in zip(lengths, kept) if k), default=1)
    expected = rates.expected(longest)
    best, best_rate = 1, -1.0
    for w in range(1, longest + 1):
        tokens = sum(expected[(n if k else min(w, n)) - 1] for n, k in zip(lengths, kept))
        rate = tokens / (latency(len(lengths) * max(w, floor)) + host_s)
        if rate > best_rate:
            best, best_rate = w, rate
    return best
