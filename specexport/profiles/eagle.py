"""EAGLE in `specexport profile`: predict every (depth, top-k, total tokens) from recorded trees, then measure.

EAGLE-2's tree for a given top-k is nested in depth and total: the candidates a run with depth D and top-k k
scores are those of a deeper run at depth <= D (the same frontiers are expanded level by level), and the
`total - 1` verified ones are the best of them by cumulative score. So one greedy calibration run per top-k at
the deepest setting, recording each step's candidates, gives the accept length of every smaller depth and
total exactly on those steps (`accept_length`). Cost per step: verify(total) from the latency curve, one draft
call over the new pairs, depth - 1 draft calls over top-k nodes (draft latency curve), and the rest of the step
(python) as measured in calibration. The best predicted settings, and a few around them, then run side by
side with plain decoding.
"""

from __future__ import annotations

import time

import numpy as np

TOP_KS = (2, 3, 4, 6, 8, 10)
# hand-written settings the chosen ones run against: EAGLE-2's published default and our build default
PRESETS = {"EAGLE-2 paper (depth 5, top-k 10, 60 tokens)": (5, 10, 60),
           "build default (depth 2, top-k 2, 4 tokens)": (2, 2, 4)}
DEPTHS = (2, 3, 4, 5, 6, 7)
DRAFT_TOKENS = (1, 2, 3, 4, 6, 8)


class TreeRecorder:
    """Wraps an Eagle proposer: keeps each step's candidate tree with the position of its root, and times the
    draft calls."""

    def __init__(self, inner):
        from specexport.profiles.measure import CallTimer

        self.inner, self.records = inner, []
        self.max_nodes = inner.max_nodes
        self.draft = CallTimer(inner.session, "forward")
        self.close = self.draft.close

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, history):
        proposal = self.inner.propose(history)
        self.records.append((len(history) - 1, self.inner.last_candidates))
        return proposal


def accept_length(candidates, emitted: list[int], depth: int, total: int) -> int:
    """Tokens a greedy step emits with the best `total - 1` candidates of depth <= `depth`: the accepted drafts
    (the path matching `emitted`, the target's tokens after the root) plus the bonus."""
    keep = [i for i in range(len(candidates)) if candidates.depths[i] <= depth]
    chosen = set(candidates.top(keep, total - 1))
    node, n = -1, 0
    while n < len(emitted):
        nxt = next((c for c in chosen if candidates.parents[c] == node and candidates.tokens[c] == emitted[n]), None)
        if nxt is None:
            break
        node, n = nxt, n + 1
    return n + 1


def calibrate(engine, prompts: list[list[int]], new_tokens: int, top_k: int, depth: int, total: int, progress) -> dict:
    """Greedy runs at (depth, top_k, total): the recorded trees with what the target emitted, and the per-step
    time spent outside the target's verify calls and the draft calls."""
    from specexport.profiles.measure import recorded_runs

    engine.set_eagle(depth, top_k, total)
    try:
        return recorded_runs(engine, prompts, new_tokens, TreeRecorder, progress)
    finally:
        engine.set_eagle()


def draft_latency(engine, context: int, reps: int) -> list[float]:
    """Median ms of one draft call over T new nodes after `context` pairs, per T in DRAFT_TOKENS."""
    from specexport.runtime import tree
    from specexport.runtime.sampling import Sampler, SamplingParams

    proposer = engine.proposer(engine.bundle.method, Sampler(SamplingParams()))
    session = proposer.session
    cache = session.new_cache(context + max(DRAFT_TOKENS) + 1)
    hidden_size = engine.bundle.graphs["draft"]["outputs"][0]["shape"][-1]
    cache.advance(context)  # the rows' contents do not change the time
    out = []
    for t in DRAFT_TOKENS:
        bias = tree.causal_bias(context, t, session.bias_width(cache, context, t))
        args = (cache, np.zeros((1, t), np.int64), (context + np.arange(t))[None], bias, np.arange(t))
        kwargs = {"want": ("hidden_out", "draft_logp", "draft_tokens"),
                  "inputs": {"hidden": np.zeros((1, t, hidden_size), np.float32)}}
        session.forward(*args, **kwargs)
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            session.forward(*args, **kwargs)
            times.append(time.perf_counter() - start)
        out.append(round(float(np.median(times)) * 1000, 3))
    return out


def predict(measured, c: dict, draft_ms: list[float], d: int, k: int, n: int, context: int, name: str | None = None) -> dict:
    """One setting's predicted accept length, step time and tokens/s, from calibration `c` (top-k k, depth >= d)."""
    tau = float(np.mean([accept_length(cand, emitted, d, n) for cand, emitted in c["samples"]]))
    ms = (measured.verify_at(n, context) + float(np.interp(tau, DRAFT_TOKENS, draft_ms))
          + (d - 1) * float(np.interp(k, DRAFT_TOKENS, draft_ms)) + c["python_ms"])
    short = f"d{d} k{k}\n{n} tok" + ("\n(preset)" if name else "")  # a plot's tick label
    return {"tree": name or f"depth {d}, top-k {k}, {n} tokens", "short": short, "tokens": n, "depth": d, "top_k": k,
            "choices": {"depth": d, "top_k": k, "total_tokens": n}, "expected_tau": round(tau, 3),
            "predicted_ms": round(ms, 3), "predicted_tokens_per_s": round(1000 * tau / ms, 2)}


def predict_rows(measured, cal: dict[int, dict], draft_ms: list[float], max_tokens: int, context: int) -> list[dict]:
    """Predicted accept length, step time and tokens/s of every (depth, top_k, total), best first."""
    rows = []
    for k, c in cal.items():
        for d in DEPTHS:
            most = min(max_tokens, k + (d - 1) * k * k + 1)
            for n in sorted({t for t in measured.tree_tokens if 2 <= t <= most} | {most}):
                rows.append(predict(measured, c, draft_ms, d, k, n, context))
    return sorted(rows, key=lambda r: -r["predicted_tokens_per_s"])


def preset_rows(measured, cal: dict[int, dict], draft_ms: list[float], max_tokens: int, context: int) -> list[dict]:
    """The PRESETS that fit the token budget and the calibrated top-ks, predicted the same way."""
    return [{**predict(measured, cal[k], draft_ms, d, k, n, context, name), "preset": True}
            for name, (d, k, n) in PRESETS.items() if n <= max_tokens and k in cal]


def finalists(rows: list[dict], count: int = 4) -> list[dict]:
    """The best predicted row, then the next best with another depth or top-k, `count` in all."""
    picked = [rows[0]]
    for r in rows[1:]:
        if len(picked) == count:
            break
        if all((r["depth"], r["top_k"]) != (p["depth"], p["top_k"]) for p in picked):
            picked.append(r)
    return picked
