"""`specexport profile`: measure a bundle on this hardware and choose the tree that maximises tokens/s.

1. Verification latency as a function of tree tokens (chains of 1..max tokens, the step's real outputs) at
   one or more context lengths.
2. The method's acceptance on calibration prompts (greedy): the accept-length histogram, the proposer's cost
   per step, and for Medusa how often head d's rank-r candidate is the token the target emits d + 1 places
   after the step's root.
3. For Medusa, the tree for every node budget from those rates (greedy expected-acceptance construction), and
   its accept length replayed on the recorded steps: the path of the emitted tokens' ranks, as far as the tree
   has it (exact on those steps, where the rates' product assumes the heads independent). The predicted
   tokens/s is tau / (verify(T) + per-step overhead), verify(T) measured at the calibration's typical context;
   the best budget wins. Then every candidate tree (the chosen one and the presets that fit) runs side by side
   on the prompts, so the report shows predicted against measured; the latency curve is measured again after
   those runs and the predictions use the mean of both (a shared machine drifts). Rates are decode rates:
   tokens after the first over the time after the first (the prompt's prefill is the same for every tree).
4. Draft-model and n-gram bundles get their draft length the same way (profiles/chains.py), EAGLE its depth,
   top-k and total tokens (profiles/eagle.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from specexport.runtime.medusa_tree import PRESETS, MedusaTree, expected_accept_length, make_tree, tree_from_accuracy

TREE_TOKENS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
RANKS = 10


@dataclass
class Measured:
    context: list[int]
    tree_tokens: list[int]
    verify_ms: dict[int, list[float]]  # context -> ms per entry of tree_tokens
    heads_ms: float = 0.0  # Medusa: the heads' share of a step (in the fused graph)
    draft_ms: dict = field(default_factory=dict)  # EAGLE: one draft call's ms by nodes fed
    overhead_ms: float = 0.0  # per step outside the graph call (python: propose, accept, commit, emit)
    rank_rates: list[list[float]] = field(default_factory=list)  # [head][rank]
    calibration: dict = field(default_factory=dict)
    candidates: list[dict] = field(default_factory=list)  # per tree: size, expected tau, predicted / measured tok/s
    chosen: dict | None = None

    def verify_at(self, tokens: int, context: int | None = None) -> float:
        """Verification ms for `tokens` tree tokens, interpolated on the measured curve."""
        curve = self.verify_ms[context if context is not None else self.context[0]]
        return float(np.interp(tokens, self.tree_tokens, curve))


def step_outputs(engine, proposer) -> tuple[str, ...]:
    fused = engine.fused_accept
    return (("accept_rows", "bonus_token") if fused else ("logits",)) + proposer.wants(fused)


def median_ms(call, reps: int) -> float:
    """Median milliseconds of `call()` over `reps` runs, after one warm-up run (a shape's first run is slower)."""
    call()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1000


def verify_latency(engine, proposer, tree_tokens, context: int, reps: int, progress) -> list[float]:
    """Median ms of one verification call of T chained tokens after `context` tokens, per T."""
    rng = np.random.default_rng(0)
    vocab = engine.bundle.manifest["model"]["vocab"]
    cache = engine.target.new_cache(context + max(tree_tokens) + 1)
    engine.prefill(cache, rng.integers(3, vocab, context).tolist())
    want = step_outputs(engine, proposer)
    out = []
    for t in tree_tokens:
        tokens, parents = rng.integers(3, vocab, t).tolist(), [-1] + list(range(t - 1))
        out.append(round(median_ms(lambda: engine.verify(cache, tokens, parents, want=want), reps), 3))
        progress(1)
    return out


def heads_latency(engine, reps: int) -> float:
    """Median ms of the Medusa heads on one row: the bundle's stand-alone heads graph, the same computation the
    fused step adds at its accepted row."""
    session = engine._heads_session()
    info = session.get_inputs()[0]
    hidden = np.zeros((1, info.shape[-1]), np.float16 if info.type == "tensor(float16)" else np.float32)
    return round(median_ms(lambda: session.run(None, {info.name: hidden}), reps), 3)


class Recorder:
    """Wraps a Medusa proposer: keeps each step's candidates with the position of the step's root."""

    def __init__(self, inner):
        self.inner, self.records = inner, []
        self.max_nodes = inner.max_nodes

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, history):
        if self.inner.candidates is not None:
            self.records.append((len(history) - 1, np.array(self.inner.candidates)))
        return self.inner.propose(history)


def replayed_accept_length(choices, samples) -> float:
    """Mean tokens a greedy step emits with the tree `choices` (rank paths) over recorded steps: each sample is
    (candidates [heads, ranks], the tokens the target emitted after the step's root). The heads' candidates are
    distinct per head, so the step follows the path of the emitted tokens' ranks while the tree has it."""
    tree = {tuple(c) for c in choices}
    lengths = []
    for candidates, emitted in samples:
        path = ()
        for d, token in enumerate(emitted[:len(candidates)]):
            rank = np.flatnonzero(candidates[d] == token)
            if not rank.size or path + (int(rank[0]),) not in tree:
                break
            path += (int(rank[0]),)
        lengths.append(len(path) + 1)
    return float(np.mean(lengths))


def rank_hits(records, tokens: list[int], heads: int) -> tuple[np.ndarray, np.ndarray]:
    """hits[d, r]: steps where head d's rank-r candidate is the emitted token d + 1 after the root; counts[d]."""
    hits, counts = np.zeros((heads, RANKS)), np.zeros(heads)
    for root, candidates in records:
        for d in range(heads):
            at = root + d + 1  # the root came from the row the heads read; head d predicts d + 2 past that row
            if at >= len(tokens):
                break
            counts[d] += 1
            where = np.flatnonzero(candidates[d][:RANKS] == tokens[at])
            if where.size:
                hits[d, where[0]] += 1
    return hits, counts


def typical_curve(engine, proposer, measured: Measured, context: int, reps: int, progress,
                  before: list[float] | None = None) -> list[float]:
    """The latency curve at the calibration's typical context, kept in `measured` (returned). Called again after
    the side-by-side runs with the first curve as `before`: the mean of both is kept (a shared machine drifts)."""
    curve = verify_latency(engine, proposer, measured.tree_tokens, context, reps, progress)
    if before is not None:
        curve = [round((a + b) / 2, 3) for a, b in zip(before, curve)]
        if context not in measured.context:
            measured.context.append(context)
    measured.verify_ms[context] = curve
    return curve


class CallTimer:
    """Times the calls of one object's method (patched on the instance) until `close`."""

    def __init__(self, obj, name: str):
        self.seconds, self.calls = 0.0, 0
        method = getattr(obj, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = method(*args, **kwargs)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return out

        setattr(obj, name, timed)
        self.close = lambda: delattr(obj, name)  # back to the class's method

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def recorded_runs(engine, prompts: list[list[int]], new_tokens: int, recorder, progress) -> dict:
    """Greedy runs of the bundle's method with each proposer wrapped by `recorder(proposer)`, which keeps
    `records` [(root position, what the step proposed)], times the draft's calls in `draft` (a CallTimer or
    None) and has `close`. Returns the samples (what a step proposed, the tokens the target emitted after its
    root), the mean draft call, and the time per step outside the target's verify calls and the draft's."""
    from specexport.runtime.sampling import Sampler, SamplingParams

    steps, seconds, draft_s, calls, samples = 0, 0.0, 0.0, 0, []
    with CallTimer(engine, "verify") as in_verify:
        for ids in prompts:
            wrapped = recorder(engine.proposer(engine.bundle.method, Sampler(SamplingParams())))
            try:
                result = engine.generate(ids, max_new_tokens=new_tokens, proposer=wrapped)
            finally:
                wrapped.close()
            text = ids + result.tokens
            samples += [(proposed, text[root + 1:]) for root, proposed in wrapped.records]
            steps += result.stats.steps
            seconds += result.stats.seconds - result.stats.ttft_s
            if wrapped.draft is not None:
                draft_s, calls = draft_s + wrapped.draft.seconds, calls + wrapped.draft.calls
            progress(1)
    python_ms = 1000 * max(0.0, seconds - in_verify.seconds - draft_s) / max(steps, 1)
    return {"samples": samples, "python_ms": round(python_ms, 3), "steps": steps,
            "draft_call_ms": round(1000 * draft_s / calls, 3) if calls else 0.0}


def calibrate(engine, prompts: list[list[int]], new_tokens: int, progress) -> dict:
    """Greedy runs with the bundle's method: accept lengths, the per-step time outside the verification
    calls (timed around each), Medusa rank rates."""
    from specexport.runtime.sampling import Sampler, SamplingParams

    lengths, seconds, steps, samples = [], 0.0, 0, []
    heads = engine.bundle.manifest["method"].get("heads_count", 0)
    hits, counts = np.zeros((heads, RANKS)), np.zeros(heads)
    with CallTimer(engine, "verify") as in_graph:
        for ids in prompts:
            proposer = engine.proposer(engine.bundle.method, Sampler(SamplingParams()))
            recorder = Recorder(proposer) if heads else None
            result = engine.generate(ids, max_new_tokens=new_tokens, proposer=recorder or proposer)
            lengths += result.stats.accept_lengths
            seconds += result.stats.seconds - result.stats.ttft_s
            steps += result.stats.steps
            if recorder is not None:
                # the root of the step that proposed at history length n is token n - 1 of prompt + output
                text = ids + result.tokens
                h, c = rank_hits(recorder.records, text, heads)
                hits, counts = hits + h, counts + c
                samples += [(candidates, text[root + 1:root + 1 + heads]) for root, candidates in recorder.records]
            progress(1)
    return {"accept_lengths": lengths, "step_ms": 1000 * seconds / max(steps, 1), "steps": steps,
            "overhead_ms": round(1000 * max(0.0, seconds - in_graph.seconds) / max(steps, 1), 3),
            "rank_rates": (hits / np.maximum(counts, 1)[:, None]).round(4).tolist() if heads else [],
            "samples": samples}


def predict(measured: Measured, row: dict, context: int) -> dict:
    """Fill a candidate row's expected tau and predicted step ms and tokens/s (in place; returns it)."""
    tree = make_tree(row["choices"])
    samples = measured.calibration.get("samples")
    tau = (replayed_accept_length(tree.choices, samples) if samples
           else expected_accept_length(tree, measured.rank_rates))
    ms = measured.verify_at(tree.size, context) + measured.overhead_ms
    row.update(tokens=tree.size, depth=tree.depth, expected_tau=round(tau, 3), predicted_ms=round(ms, 3),
               predicted_tokens_per_s=round(1000 * tau / ms, 2))
    return row


def choose_tree(measured: Measured, max_tokens: int, context: int) -> list[dict]:
    """Predicted tokens/s of the greedy-accuracy tree for every budget up to max_tokens, best first."""
    rows = [predict(measured, {"tree": f"auto:{n}", "choices": tree_from_accuracy(measured.rank_rates, n).as_lists()},
                    context) for n in range(1, max_tokens)]
    return sorted(rows, key=lambda r: -r["predicted_tokens_per_s"])


def preset_rows(measured: Measured, max_tokens: int, heads: int, context: int) -> list[dict]:
    rows = []
    for name, choices in PRESETS.items():
        tree = make_tree(choices)
        if tree.size <= max_tokens and tree.depth <= heads and tree.top_k <= RANKS:
            rows.append(predict(measured, {"tree": name, "choices": tree.as_lists()}, context))
    return rows


def side_by_side(engine, prompts: list[list[int]], new_tokens: int, rows: list[dict], rounds: int, progress,
                 apply=None) -> float:
    """Measured tokens/s and tau of each tree (in place), alternating the trees and plain decoding within each
    prompt, `rounds` times; returns plain decoding's tokens/s from the same runs. `apply(row)` puts a row's tree
    on the engine (default: a Medusa tree from its choices)."""
    totals = {r["tree"]: [0, 0.0, []] for r in rows}
    totals[None] = [0, 0.0, []]
    if apply is None:
        trees: dict[str, MedusaTree] = {r["tree"]: make_tree(r["choices"]) for r in rows}

        def apply(row):
            engine.medusa_tree = trees[row["tree"]]
    for _ in range(rounds):
        for ids in prompts:
            for r in rows + [{"tree": None}]:
                if r["tree"] is not None:
                    apply(r)
                result = engine.generate(ids, max_new_tokens=new_tokens, method=None if r["tree"] else "none")
                t = totals[r["tree"]]
                t[0] += result.stats.new_tokens - 1
                t[1] += result.stats.seconds - result.stats.ttft_s
                t[2] += result.stats.accept_lengths
            progress(1)
    for r in rows:
        tokens, seconds, lengths = totals[r["tree"]]
        r["measured_tokens_per_s"] = round(tokens / seconds, 2) if seconds else 0.0
        r["measured_tau"] = round(float(np.mean(lengths)), 3) if lengths else 0.0
        r["accept_lengths"] = lengths
    tokens, seconds, _ = totals[None]
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


def plain_speed(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Plain decoding's tokens/s after the first token."""
    tokens = seconds = 0.0
    for ids in prompts:
        result = engine.generate(ids, max_new_tokens=new_tokens, method="none")
        tokens += result.stats.new_tokens - 1
        seconds += result.stats.seconds - result.stats.ttft_s
    return round(tokens / seconds, 2) if seconds else 0.0
