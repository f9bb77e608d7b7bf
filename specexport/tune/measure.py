"""What every tuner measures: verification latency against tree tokens and context, greedy runs recorded step by
step (through the engine's `on_step`), accept lengths replayed on recorded trees with the runtime's own
acceptance rule, and candidate settings run side by side with plain decoding.

Rates are decode rates: tokens after the first over the time after the first (the prompt's prefill is the same
for every setting).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from specexport.runtime import tree
from specexport.runtime.backends.protocol import pools
from specexport.runtime.budget import BatchLatency
from specexport.runtime.generate import Engine
from specexport.runtime.sampling import Sampler, SamplingParams
from specexport.runtime.tree import DraftTree
from specexport.runtime.verify import Route, accept_greedy

TREE_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)


@dataclass
class Measured:
    context: list[int]
    tree_tokens: list[int]
    verify_ms: dict[int, list[float]]  # context -> ms per entry of tree_tokens
    heads_ms: float = 0.0  # Medusa: the heads' share of a step (in the fused graph)
    draft_ms: dict = field(default_factory=dict)  # EAGLE: one draft call's ms by nodes fed
    overhead_ms: float = 0.0  # per step outside the graph call (python: propose, accept, commit, emit)
    rank_rates: list[list[float]] = field(default_factory=list)  # Medusa: [head][rank]
    calibration: dict = field(default_factory=dict)
    candidates: list[dict] = field(default_factory=list)  # per setting: size, expected tau, predicted/measured tok/s
    chosen: dict | None = None
    batch_context: int = 0  # the batched call's latency: sequences x width, each sequence after this context
    batch_sequences: list[int] = field(default_factory=list)
    batch_widths: list[int] = field(default_factory=list)
    batch_ms: list[list[float]] = field(default_factory=list)
    batch_single_ms: list[list[float]] = field(default_factory=list)  # one real row a sequence (ragged rows)

    def verify_at(self, tokens: int, context: int | None = None) -> float:
        """Verification ms for `tokens` tree tokens, interpolated on the measured curve."""
        curve = self.verify_ms[context if context is not None else self.context[0]]
        return float(np.interp(tokens, self.tree_tokens, curve))


@dataclass
class Recording:
    """Greedy runs of a bundle's method, step by step."""

    samples: list[tuple[DraftTree, list[int]]]  # each step's tree, and the tokens the target emitted after its root
    accept_lengths: list[int]
    steps: int
    seconds: float  # decode time (after the first token)
    verify_s: float  # in the target's step calls
    draft_s: float  # in the draft's graph calls (draft models, EAGLE)
    draft_calls: int

    @property
    def step_ms(self) -> float:
        return 1000 * self.seconds / max(self.steps, 1)

    @property
    def overhead_ms(self) -> float:
        """Per step outside the target's call (proposing included)."""
        return round(1000 * max(0.0, self.seconds - self.verify_s) / max(self.steps, 1), 3)

    @property
    def python_ms(self) -> float:
        """Per step outside the target's and the draft's calls."""
        return round(1000 * max(0.0, self.seconds - self.verify_s - self.draft_s) / max(self.steps, 1), 3)

    @property
    def draft_call_ms(self) -> float:
        return round(1000 * self.draft_s / self.draft_calls, 3) if self.draft_calls else 0.0


def record_runs(engine: Engine, prompts: list[list[int]], new_tokens: int, progress) -> Recording:
    """Greedy runs of the engine's method with its current settings. The proposer's own graph calls (a draft
    model's, EAGLE's) are counted apart from the rest of the step (GraphSession keeps its call count and time)."""
    rec = Recording([], [], 0, 0.0, 0.0, 0.0, 0)
    before = {id(g): (g.calls, g.seconds) for g in engine.side_graphs()}
    for ids in prompts:
        records = []
        result = engine.generate(ids, max_new_tokens=new_tokens, on_step=records.append, budget=False)
        text = ids + result.tokens
        rec.samples += [(r.tree, text[r.history_length:]) for r in records]
        rec.accept_lengths += result.stats.accept_lengths
        rec.steps += result.stats.steps
        rec.seconds += result.stats.seconds - result.stats.ttft_s
        rec.verify_s += sum(r.verify_s for r in records)
        progress(1)
    for g in engine.side_graphs():
        calls, seconds = before.get(id(g), (0, 0.0))
        rec.draft_calls, rec.draft_s = rec.draft_calls + g.calls - calls, rec.draft_s + g.seconds - seconds
    return rec


def replay(tokens: list[int], parents: list[int], emitted: list[int]) -> int:
    """The accept length greedy verification gives a tree when the target emits `emitted` after its root: the
    runtime's own rule (verify.accept_greedy), with the target's argmax at each node known along the emitted
    path (nodes off it are never entered)."""
    depths = tree.depths(parents)
    argmax = [emitted[d] if d < len(emitted) else -1 for d in depths]
    return accept_greedy(tokens, parents, argmax).accept_length


def cut_depth(tokens: list[int], parents: list[int], depth: int) -> tuple[list[int], list[int]]:
    """The nodes of a tree at depth <= `depth` (what a shorter draft length proposes from the same history)."""
    keep = [i for i, d in enumerate(tree.depths(parents)) if d <= depth]
    return tree.subtree(tokens, parents, keep)


def median_ms(call, reps: int) -> float:
    """Median milliseconds of `call()` over `reps` runs, after one warm-up run (a shape's first run is slower)."""
    call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1000


def step_outputs(engine: Engine, proposer) -> tuple[str, ...]:
    route = engine.accepting.route(SamplingParams())
    return route.outputs + proposer.wants(route is Route.GRAPH)


def verify_latency(engine: Engine, tree_tokens, context: int, reps: int, progress) -> list[float]:
    """Median ms of one verification call of T chained tokens after `context` tokens, per T."""
    rng = np.random.default_rng(0)
    vocab = engine.bundle.manifest["model"]["vocab"]
    cache = engine.target.new_cache(context + max(tree_tokens) + 1)
    engine.prefill(cache, rng.integers(3, vocab, context).tolist())
    want = step_outputs(engine, engine.proposer(Sampler(SamplingParams())))
    out = []
    for t in tree_tokens:
        draft = DraftTree(rng.integers(3, vocab, t).tolist(), [-1] + list(range(t - 1)))
        out.append(round(median_ms(lambda: engine.verify(cache, draft, want=want), reps), 3))
        progress(1)
    return out


def batch_latency(engine: Engine, measured: Measured, sequences: list[int], widths: list[int], context: int,
                  reps: int, progress) -> None:
    """The batched engine's call (runtime/scheduler.py: n sequences' chains of W tokens, each after `context` rows of
    its own, and where the graph takes ragged rows with one real row a sequence), best of `reps` per point, kept in
    `measured` (nothing where the backend has no batched pool)."""
    if not pools(engine.target) or not sequences:
        return
    pool = engine.target.new_pool(max(sequences), context + max(widths))
    table, single = [], []
    for n in sequences:  # a row at a time, for the progress bar
        latency = BatchLatency.measure(engine.target, pool, [n], widths, context, reps)
        table += latency.as_ms()
        single += latency.as_ms(single=True) if latency.single is not None else []
        progress(1)
    measured.batch_sequences, measured.batch_widths, measured.batch_ms = list(sequences), list(widths), table
    measured.batch_single_ms = single
    measured.batch_context = context


def latency_curve_at_context(engine: Engine, measured: Measured, context: int, reps: int, progress,
                             before: list[float] | None = None) -> list[float]:
    """The latency curve at the calibration's context, kept in `measured` (returned). Called again after the
    side-by-side runs with the first curve as `before`: the mean of both is kept (a shared machine drifts)."""
    curve = verify_latency(engine, measured.tree_tokens, context, reps, progress)
    if before is not None:
        curve = [round((a + b) / 2, 3) for a, b in zip(before, curve)]
        if context not in measured.context:
            measured.context.append(context)
    measured.verify_ms[context] = curve
    return curve


def side_by_side(engine: Engine, prompts: list[list[int]], new_tokens: int, rows: list[dict], rounds: int,
                 progress) -> float:
    """Measured tokens/s and tau of each candidate (in place), alternating the candidates (each row's "settings",
    put on the engine with Engine.configure) and plain decoding within each prompt, `rounds` times; returns plain
    decoding's tokens/s from the same runs. The engine is left with the bundle's settings."""
    totals = {r["tree"]: [0, 0.0, []] for r in rows}
    totals[None] = [0, 0.0, []]
    try:
        for _ in range(rounds):
            for ids in prompts:
                for r in rows + [{"tree": None}]:
                    if r["tree"] is not None:
                        engine.configure(**r["settings"])
                    result = engine.generate(ids, max_new_tokens=new_tokens, plain=r["tree"] is None, budget=False)
                    t = totals[r["tree"]]
                    t[0] += result.stats.new_tokens - 1
                    t[1] += result.stats.seconds - result.stats.ttft_s
                    t[2] += result.stats.accept_lengths
                progress(1)
    finally:
        engine.configure()
    for r in rows:
        tokens, seconds, lengths = totals[r["tree"]]
        r["measured_tokens_per_s"] = round(tokens / seconds, 2) if seconds else 0.0
        r["measured_tau"] = round(float(np.mean(lengths)), 3) if lengths else 0.0
        r["accept_lengths"] = lengths
    tokens, seconds, _ = totals[None]
    return round(tokens / seconds, 2) if seconds else 0.0


def plain_speed(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Plain decoding's tokens/s after the first token."""
    tokens = seconds = 0.0
    for ids in prompts:
        result = engine.generate(ids, max_new_tokens=new_tokens, plain=True)
        tokens += result.stats.new_tokens - 1
        seconds += result.stats.seconds - result.stats.ttft_s
    return round(tokens / seconds, 2) if seconds else 0.0


def anchor(measured: Measured, rows: list[dict], context: int) -> None:
    """Each row's predicted speedup over plain decoding (both predicted from the latency curve: plain decoding is
    its T=1 point), its measured speedup (both measured side by side), and the prediction at the run's measured
    plain rate (in place). A shared machine's speed drifts between the curve and the runs; the ratios do not."""
    plain = measured.calibration.get("plain_tokens_per_s") or 0.0
    curve_plain = 1000 / measured.verify_at(1, context)
    for r in rows:
        r["predicted_speedup"] = round(r["predicted_tokens_per_s"] / curve_plain, 3)
        r["measured_speedup"] = round(r["measured_tokens_per_s"] / plain, 3) if plain else 0.0
        r["anchored_tokens_per_s"] = round(r["predicted_speedup"] * plain, 2)


def errors(row: dict) -> tuple[float, float]:
    """(% error of the predicted tokens/s, % error at the run's plain rate) against the measured tokens/s."""
    measured = row.get("measured_tokens_per_s") or 0.0
    if not measured:
        return 0.0, 0.0
    return ((row["predicted_tokens_per_s"] / measured - 1) * 100,
            (row.get("anchored_tokens_per_s", row["predicted_tokens_per_s"]) / measured - 1) * 100)
