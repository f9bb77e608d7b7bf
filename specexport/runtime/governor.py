"""The drafting governor: whether a step drafts at all, and how much of each tree it verifies.

One policy for a generation alone (`Engine.generate`) and for the batched engine (runtime/scheduler.py), so that
speculation never costs more than it brings, on any machine and at any load:

1. `decide(sequences, ...)` before the proposers run: a `Plan` that proposes when drafting paid at the last proposing
   steps (budget.worth_drafting: their expected tokens and rows, at what a proposing step costs outside the target's
   call, against a plain step's one row at its own cost), else verifies every root alone and runs no proposer.
   Each kind is tried now and then (a probe), so that both stay measured at the load of the moment: while drafting
   does not pay, a step proposes anyway after PROBE_STEPS that did not, then after twice as many each time the
   probe finds it still does not pay (up to PROBE_MAX: a probe costs its proposal and a row or two); while it pays,
   one step in PLAIN_PROBE_STEPS does not.
2. `cut(trees, ...)` after they proposed: each tree cut to the nodes worth their rows (budget.share, with the
   acceptance rates of this engine's own steps and the target's measured latency). A tree cut to its root is a
   plain step: width 1, no drafting.
3. `record(plan, host_s, sequences)` after the step: its time outside the graph calls (`HostClock`), per sequence,
   averaged per kind (a probe's replaces the average).

Example: suffix lookup on random text. Its drafts are never accepted, so the rates fall, `cut` keeps roots alone,
the last proposing steps chose one row each, and `decide` stops proposing; a probe looks up again and verifies the
best draft (about 0.2 ms and one row) after 16 steps, then 32, 64, ... 256, and the generation runs at plain
decoding's speed.

A sequence running alone (a generation alone, or the batched engine with one request) is governed by the same
rules, with its choices made once per ALONE_TREES trees rather than every step (`_cut_alone`).

A request sampled with a seed keeps its whole tree: speculative sampling's tokens depend on the tree (their
distribution does not), and a seeded request gives the same tokens on every run and in any batch.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from specexport.runtime import cpu, kernels
from specexport.runtime.budget import AcceptanceRates, BatchLatency, share, worth_drafting
from specexport.runtime.tree import DraftTree

BLEND = 0.1  # the last step's weight in the running averages (a step's host cost, the host's per sampled row)
PROBE_STEPS = 16  # while drafting does not pay, a step proposes anyway after this many that did not...
PROBE_MAX = 256  # ... and after twice as many each time the probe found it still does not pay, up to this
PLAIN_PROBE_STEPS = 16  # while drafting pays, one step in this many verifies the roots alone
ALONE_TREES = 16  # a sequence alone: its trees' cut is chosen again once per this many trees (and at each probe)
ALONE_OBSERVED = 4  # ... and the latency table learns from one of this many of its calls


def blend(average: float | None, value: float) -> float:
    """A running average with the last value weighted BLEND (the first value starts it)."""
    return value if average is None else average + BLEND * (value - average)


@dataclass(frozen=True)
class Plan:
    """What a step does: `propose` (the proposers run; else every root is verified alone), and whether it is a
    `probe` (its cost replaces its kind's average, which is as old as the last step of that kind)."""

    propose: bool
    probe: bool = False


WHOLE = Plan(True)  # every tree as its proposer made it (no governor)


class HostClock:
    """Wall time less the time inside the engine's graph calls (`Backend.seconds` of the target and side graphs):
    what the host itself spent. `mark()` then `host(mark)`, `graphs(mark)`."""

    def __init__(self, engine):
        self.engine = engine

    def mark(self) -> tuple[float, float, float]:
        """(now, time inside the target, inside the side graphs)."""
        side = sum(g.seconds for g in self.engine.side_graphs())
        return time.perf_counter(), self.engine.target.seconds, side

    def since(self, mark) -> tuple[float, float, float]:
        """(host seconds, target seconds, side-graph seconds) since `mark`."""
        now, target, side = self.mark()
        target_s, side_s = target - mark[1], side - mark[2]
        return now - mark[0] - target_s - side_s, target_s, side_s


class Governor:
    """The drafting policy of one engine (the module docstring): the acceptance rates of its steps (`rates`), the
    target's latency by sequences and width (`latency`), and what each kind of step costs outside the target's call.
    `rows`: the most rows a tree has (the method's tokens per step)."""

    def __init__(self, rows: int, latency: BatchLatency):
        self.lock = threading.Lock()  # held by callers whose generations share an engine in several threads
        self.rows = rows
        self.rates = AcceptanceRates(rows)
        self.latency = latency
        # a step's time outside the target's call, per sequence, by whether it proposed (True) or not (False): the
        # host's work (the proposals, their scoring, the cut, the bookkeeping of the accepted paths) and the draft
        # graphs' calls, less the acceptance of sampled rows (priced per row, `row_s`); None before the first
        self.cost: dict[bool, float | None] = {True: None, False: None}
        # what the last proposing steps chose, averaged: expected tokens and real rows per sequence, the call's width
        self.choice = (float(self.rates.expected(rows)[-1]), float(rows), float(rows))
        self.unproposed = 0  # steps since the last that proposed
        self.proposed = 0  # steps that proposed since the last that did not
        self.probe_every = PROBE_STEPS  # steps without proposing before a probe proposes
        self._probed = False  # the last step was a probe that proposed
        self.row_s: float | None = None  # the host's time to accept one sampled row (None: not measured yet)
        # one sequence alone (`_cut_alone`): its trees' last trees, the node count they are cut to, and whether
        # drafting pays at it, chosen once per ALONE_TREES trees (a step alone lasts a few ms: choosing every step
        # cost more than it gained, ~0.3 ms a step on the 2-core CPU against ~1% more tokens a second)
        self._recent: list[DraftTree] = []
        self._alone_nodes: int | None = None
        self._alone_pays: bool | None = None
        self._alone_calls = 0

    def decide(self, sequences: int, sampled: int = 0, seeded: bool = False) -> Plan:
        """Whether this step of `sequences` sequences (`sampled` of them sampled) proposes: always before a proposing
        step's cost is known, at a probe, and while a request sampled with a seed runs (its tree stays whole)."""
        probe_due, probed, self._probed = self.unproposed >= self.probe_every, self._probed, False
        plain_probe = self.proposed >= PLAIN_PROBE_STEPS * (ALONE_TREES if sequences == 1 else 1)
        if self.cost[True] is None or probe_due or seeded:
            propose = True
        elif plain_probe:
            propose = False  # a plain probe (alone, rarer: its step forgoes a draft's tokens, and its cost is steady)
        else:
            if sequences == 1 and self._alone_pays is not None:  # alone: decided when its cut was chosen (`_cut_alone`)
                propose = self._alone_pays
            else:
                plain = (self.cost[False] or 0.0) * sequences  # before a plain step: a proposing step's cost counts
                drafting = max(self.cost[True] * sequences - plain, 0.0)
                propose = worth_drafting(sequences, *self.choice, self.latency, plain, drafting,
                                         row_s=self.row_s or 0.0, sampled=sampled)
            if propose:
                self.probe_every = PROBE_STEPS
            elif probed:  # the probe found that drafting still does not pay: the next comes later
                self.probe_every = min(2 * self.probe_every, PROBE_MAX)
        self._probed = propose and probe_due
        probe = probe_due if propose else plain_probe
        self.unproposed, self.proposed = (0, self.proposed + 1) if propose else (self.unproposed + 1, 0)
        return Plan(propose, probe)

    def cut(self, plan: Plan, trees: list[DraftTree], kept: list[bool], sampled: list[bool]) -> list[DraftTree]:
        """The step's trees, each cut to the nodes worth their rows (budget.share; `kept` ones stay whole, `sampled`
        ones cost the host a row's acceptance each), and what was chosen kept for `decide`."""
        if len(trees) == 1:
            return [self._cut_alone(plan, trees[0], kept[0], sampled[0])]
        curves = self.rates.curves(trees)
        host = (self.cost[True] or 0.0) * len(trees)
        nodes = share(curves, self.latency, host, kept, row_s=self.row_s or 0.0, sampled=sampled)
        chosen = (float(np.mean([c[k - 1] for c, k in zip(curves, nodes)])), float(nodes.mean()), float(nodes.max()))
        self.choice = chosen if plan.probe else tuple(blend(a, b) for a, b in zip(self.choice, chosen))
        return [t.truncated(int(k)) for t, k in zip(trees, nodes)]

    def _cut_alone(self, plan: Plan, tree: DraftTree, kept: bool, sampled: bool) -> DraftTree:
        """A sequence alone: its trees cut to the node count that pays best on its last ALONE_TREES trees (their mean
        expected tokens against the call's cost by rows and the host's), chosen again once per ALONE_TREES trees and
        at each probe, with whether drafting pays at all (`decide`). A probe verifies at least the tree's best draft,
        so that the rates go on learning where drafting stopped paying (a text that becomes predictable again)."""
        if kept:
            return tree
        self._recent.append(tree)
        if self._alone_nodes is None or plan.probe or len(self._recent) >= ALONE_TREES:
            curves = self.rates.curves(self._recent)
            width = max(len(c) for c in curves)
            mean = np.mean([np.pad(c, (0, width - len(c)), mode="edge") for c in curves], axis=0)
            k = np.arange(1, width + 1, dtype=float)
            call = np.asarray(self.latency(1, k, k), float)
            plain = self.cost[False] or 0.0
            drafting = max((self.cost[True] or 0.0) - plain, 0.0)
            row_s = (self.row_s or 0.0) * sampled
            rate = mean / (call + plain + drafting + row_s * k)
            nodes = int(np.argmax(rate)) + 1
            self._alone_nodes, self._recent = (self.rows if nodes == width else nodes), []  # the widest: whole trees
            self._alone_pays = bool(rate[nodes - 1] > 1.0 / (call[0] + plain + row_s))
            self.choice = (float(mean[nodes - 1]), float(nodes), float(nodes))
        return tree.truncated(max(self._alone_nodes, 2) if plan.probe else self._alone_nodes)

    def verified(self, trees: list[DraftTree], paths: list[list[int]], sequences: int, width: int, seconds: float,
                 rows: int | None = None) -> None:
        """A target call's trees, their accepted paths, and its size and time (`rows`: its real rows); a call alone
        teaches the table one time in ALONE_OBSERVED."""
        self.rates.update(trees, paths)
        if sequences > 1 or self._alone_calls % ALONE_OBSERVED == 0:
            self.latency.observe(sequences, width, seconds, rows)
        self._alone_calls += sequences == 1

    def record(self, plan: Plan, host_s: float, sequences: int) -> None:
        """A step's time outside the target's call (the draft graphs' included, the sampled rows' acceptance not)."""
        cost, known = host_s / max(sequences, 1), self.cost[plan.propose]
        self.cost[plan.propose] = cost if plan.probe or known is None else blend(known, cost)

    def sampled_rows(self, seconds: float, rows: int) -> None:
        """The host's time accepting `rows` sampled rows."""
        self.row_s = blend(self.row_s, seconds / rows)


def profiled_latency(engine) -> BatchLatency | None:
    """The batched latency table of the profile the bundle was built with, where that profile measured it on a bundle
    of the same precision and int4 kernel (another precision's kernels scale differently with rows), on a CPU with this one's kernel
    features (runtime/cpu.py: another CPU's rows cost otherwise) and, for a graph with ragged rows, measured what a
    width costs alone (`BatchLatency.single`); None otherwise (the engine measures its own)."""
    manifest = engine.bundle.manifest
    profile, precision = manifest.get("profile") or {}, engine.bundle.precision
    measured_on = profile.get("engine") or {}
    if not profile.get("measured") or measured_on.get("precision") != precision:
        return None
    if precision == "int4" and (measured_on.get("int4_kernel") or "") != kernels.int4_kernel(manifest):
        return None  # the other int4 kernel's rows cost otherwise
    if kernels.ATTENTION_ROWS in kernels.used(manifest):
        return None  # the profiles' tables are GroupQueryAttention's, whose widths cost otherwise
    hardware = profile.get("hardware") or {}
    if hardware.get("kind") == "cpu" and set(hardware.get("features") or ()) != set(cpu.kernel_features()):
        return None
    measurements = dict(profile.get("measurements") or {})
    if not engine.target.ragged:  # every row computed: what ragged calls cost does not apply
        measurements.pop("batch_single_ms", None)
    latency = BatchLatency.from_measurements(measurements)
    return None if latency is None or (engine.target.ragged and latency.single is None) else latency
