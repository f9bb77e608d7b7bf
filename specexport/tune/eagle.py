"""EAGLE in `specexport profile`: predict every (depth, top-k, total tokens) from recorded trees, then measure.

EAGLE-2's tree for a given top-k is nested in depth and total: the candidates a run with depth D and top-k k
scores are those of a deeper run at depth <= D (the same frontiers are expanded level by level), and the
`total - 1` verified ones are the best of them by cumulative score. So one greedy calibration run per top-k at
the deepest setting, recording each step's candidate tree, gives the accept length of every smaller depth and
total exactly on those steps (the runtime's CandidateTree.cut, replayed with its acceptance rule). Cost per step:
verify(total) from the latency curve, one draft call over the new pairs, depth - 1 draft calls over top-k nodes
(draft latency curve), and the rest of the step (python) as measured. The best predicted settings, and a few
around them, then run side by side with plain decoding; the best measured wins.
"""

from __future__ import annotations

import numpy as np

from specexport.runtime import tree
from specexport.tune.measure import Measured, Recording, median_ms, record_runs, replay

TOP_KS = (2, 3, 4, 6, 8, 10)
# hand-written settings the chosen ones run against: EAGLE-2's published default and our build default
PRESETS = {"EAGLE-2 paper (depth 5, top-k 10, 60 tokens)": (5, 10, 60),
           "build default (depth 2, top-k 2, 4 tokens)": (2, 2, 4)}
DEPTHS = (2, 3, 4, 5, 6, 7)
DRAFT_TOKENS = (1, 2, 3, 4, 6, 8)


def draft_latency(engine, context: int, reps: int) -> list[float]:
    """Median ms of one draft call over T new nodes after `context` pairs, per T in DRAFT_TOKENS."""
    session = engine.graph("draft")
    cache = session.new_cache(context + max(DRAFT_TOKENS) + 1)
    hidden_size = engine.bundle.graphs["draft"]["outputs"][0]["shape"][-1]
    cache.advance(context)  # the rows' contents do not change the time
    out = []
    for t in DRAFT_TOKENS:
        args = (cache, np.zeros((1, t), np.int64), (context + np.arange(t))[None], tree.causal_mask(t), np.arange(t))
        kwargs = {"want": ("hidden_out", "draft_logp", "draft_tokens"),
                  "inputs": {"hidden": np.zeros((1, t, hidden_size), np.float32)}}
        out.append(round(median_ms(lambda: session.forward(*args, **kwargs), reps), 3))
    return out


def predict(measured: Measured, rec: Recording, draft_ms: list[float], d: int, k: int, n: int, context: int,
            name: str | None = None) -> dict:
    """One setting's predicted accept length, step time and tokens/s, from a recording at top-k k, depth >= d."""
    tau = float(np.mean([replay(*draft.candidates.cut(d, n - 1), emitted) for draft, emitted in rec.samples]))
    ms = (measured.verify_at(n, context) + float(np.interp(tau, DRAFT_TOKENS, draft_ms))
          + (d - 1) * float(np.interp(k, DRAFT_TOKENS, draft_ms)) + rec.python_ms)
    short = f"d{d} k{k}\n{n} tok" + ("\n(preset)" if name else "")  # a plot's tick label
    return {"tree": name or f"depth {d}, top-k {k}, {n} tokens", "short": short, "tokens": n, "depth": d, "top_k": k,
            "settings": {"depth": d, "top_k": k, "total_tokens": n, "tree": "dynamic"}, "expected_tau": round(tau, 3),
            "predicted_ms": round(ms, 3), "predicted_tokens_per_s": round(1000 * tau / ms, 2)}


def predict_rows(measured: Measured, recs: dict[int, Recording], draft_ms, max_tokens: int, context: int) -> list:
    """Predicted accept length, step time and tokens/s of every (depth, top_k, total), best first."""
    rows = []
    for k, rec in recs.items():
        for d in DEPTHS:
            most = min(max_tokens, k + (d - 1) * k * k + 1)
            for n in sorted({t for t in measured.tree_tokens if 2 <= t <= most} | {most}):
                rows.append(predict(measured, rec, draft_ms, d, k, n, context))
    return sorted(rows, key=lambda r: -r["predicted_tokens_per_s"])


def finalists(rows: list[dict], count: int = 4) -> list[dict]:
    """The best predicted row, then the next best with another depth or top-k, `count` in all."""
    picked = [rows[0]]
    for r in rows[1:]:
        if len(picked) == count:
            break
        if all((r["depth"], r["top_k"]) != (p["depth"], p["top_k"]) for p in picked):
            picked.append(r)
    return picked


class EagleTuner:
    @staticmethod
    def top_ks(engine) -> list[int]:
        return [k for k in TOP_KS if k <= engine.bundle.manifest["method"]["graph_top_k"]]

    def progress_steps(self, engine, prompts: int, tokens: int, rounds: int) -> int:
        return 2 * tokens + prompts * (rounds + len(self.top_ks(engine)))

    def tune(self, engine, measured: Measured, recording: Recording, t) -> None:
        before = t.curve()
        draft_ms = draft_latency(engine, t.context, t.reps)
        deepest = max(DEPTHS)
        recs = {}
        try:
            for k in self.top_ks(engine):
                engine.configure(depth=deepest, top_k=k, total_tokens=min(t.max_tokens, k + (deepest - 1) * k * k + 1),
                                 tree="dynamic")
                recs[k] = record_runs(engine, t.ids, t.new_tokens, t.progress)
        finally:
            engine.configure()
        auto = finalists(predict_rows(measured, recs, draft_ms, t.max_tokens, t.context))
        presets = [{**predict(measured, recs[k], draft_ms, d, k, n, t.context, name), "preset": True}
                   for name, (d, k, n) in PRESETS.items() if n <= t.max_tokens and k in recs]
        rows = auto + presets
        measured.calibration["plain_tokens_per_s"] = t.side_by_side(rows)
        t.curve(before)
        for r in rows:  # the predictions again, with the averaged latency curve
            again = predict(measured, recs[r["top_k"]], draft_ms, r["depth"], r["top_k"], r["tokens"], t.context)
            r.update({k: again[k] for k in ("predicted_ms", "predicted_tokens_per_s")})
        measured.draft_ms = dict(zip(DRAFT_TOKENS, draft_ms))
        measured.overhead_ms = round(float(np.mean([rec.python_ms for rec in recs.values()])), 3)
        measured.candidates = rows
        measured.chosen = max(auto, key=lambda r: r["measured_tokens_per_s"])  # presets are the yardstick


TUNER = EagleTuner()
