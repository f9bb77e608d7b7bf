"""Suffix lookup and the hybrid in `specexport profile`: the node budget and the suffix settings, predicted from
recorded steps, then measured.

A step's candidates (each index's best-first continuations; the hybrid's EAGLE candidate tree too) do not depend on
the node budget, the adaptive-length factor or the probability floor except by where they are cut: a smaller budget,
a smaller factor or a higher floor takes a prefix of each index's list, a smaller EAGLE depth the candidates up to
that depth (EAGLE-2's tree is nested in depth), and the step verifies the best nodes of the merged tree
(runtime/methods/suffix.select). So one greedy calibration run at the loosest settings, recording each step's
candidates, gives the accept length of every tighter setting exactly on those steps (replayed with the runtime's
acceptance rule). Cost per step: verify(nodes) from the latency curve at each step's own tree size, the hybrid's
EAGLE draft calls (one per level, at their measured mean time), and the rest of the step (lookup, python) as
measured. The best predicted settings, and the bundle's own, then run side by side with plain decoding; the best
measured wins. Every run is a fresh engine's (no response store): the calibration prompts run once per candidate,
and a store would draft each run's answer from the one before.
"""

from __future__ import annotations

import numpy as np

from specexport.runtime.methods.suffix import ANY_DEPTH, fresh_requests, profile_budget, select
from specexport.tune.measure import Measured, Recording, record_runs, replay

TOTALS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
FACTORS = (0.5, 1.0, 2.0, 4.0)
MIN_PROBS = (0.02, 0.05, 0.1, 0.2, 0.4)


def predict(measured: Measured, rec: Recording, total: int, factor: float, min_prob: float, context: int,
            depth: int | None = None, name: str | None = None) -> dict:
    """One setting's accept length, step time and tokens/s on the recorded steps (recorded at looser settings;
    `depth`: the hybrid's EAGLE depth, at most the recording's, one draft call per level)."""
    taus, verify_ms = [], []
    for draft, emitted in rec.samples:
        tree = select(draft.tokens[0], draft.candidates, total, factor, min_prob, ANY_DEPTH if depth is None else depth)
        taus.append(replay(tree.tokens, tree.parents, emitted))
        verify_ms.append(measured.verify_at(len(tree), context))
    tau = float(np.mean(taus))
    calls = rec.draft_calls / max(rec.steps, 1) if depth is None else depth  # EAGLE: a call per level
    ms = float(np.mean(verify_ms)) + calls * rec.draft_call_ms + rec.python_ms
    what = f"{total} tokens, factor {factor:g}, min prob {min_prob:g}" + ("" if depth is None else f", depth {depth}")
    label = f"{total} tok\nf{factor:g} p{min_prob:g}" + ("" if depth is None else f" d{depth}") + \
        ("\n(bundle)" if name else "")
    settings = {"total_tokens": total, "match_factor": factor, "min_prob": min_prob}
    return {"tree": name or what, "short": label, "tokens": total, "depth": depth or total - 1,
            "settings": settings if depth is None else {**settings, "depth": depth},
            "expected_tau": round(tau, 3), "predicted_ms": round(ms, 3),
            "predicted_tokens_per_s": round(1000 * tau / ms, 2)}


def predict_rows(measured: Measured, rec: Recording, max_tokens: int, context: int, depths: list) -> list[dict]:
    rows = [predict(measured, rec, n, f, p, context, d) for n in TOTALS if n <= max_tokens for f in FACTORS
            for p in MIN_PROBS for d in depths]
    return sorted(rows, key=lambda r: -r["predicted_tokens_per_s"])


def finalists(rows: list[dict], count: int = 3) -> list[dict]:
    """The best predicted row, then the next best with another node budget (or EAGLE depth), `count` in all."""
    picked = [rows[0]]
    for r in rows[1:]:
        if len(picked) == count:
            break
        if all((r["tokens"], r["depth"]) != (p["tokens"], p["depth"]) for p in picked):
            picked.append(r)
    return picked


class SuffixTuner:
    def progress_steps(self, engine, prompts: int, tokens: int, rounds: int) -> int:
        return 2 * tokens + prompts * (rounds + 1)

    def tune(self, engine, measured: Measured, recording: Recording, t) -> None:
        with fresh_requests(engine):
            self._tune(engine, measured, t)

    def _tune(self, engine, measured: Measured, t) -> None:
        before = t.curve()
        s = engine.settings
        most = min(t.max_tokens, profile_budget(engine) or t.max_tokens)  # a run refuses more than the profile's
        loosest = {"total_tokens": max(n for n in TOTALS if n <= most), "match_factor": max(FACTORS),
                   "min_prob": min(MIN_PROBS)}
        try:
            engine.configure(**loosest)
            rec = record_runs(engine, t.ids, t.new_tokens, t.progress)
        finally:
            engine.configure()
        depth = getattr(s, "depth", None)  # the hybrid's EAGLE depth: every smaller one is replayed too
        depths = [None] if depth is None else list(range(1, depth + 1))
        rows = finalists(predict_rows(measured, rec, most, t.context, depths))
        own = (s.total_tokens, s.match_factor, s.min_prob)
        if own[0] <= loosest["total_tokens"] and all(
                (r["tokens"], r["settings"]["match_factor"], r["settings"]["min_prob"], r["settings"].get("depth"))
                != (*own, depth) for r in rows):
            rows.append({**predict(measured, rec, *own, t.context, depth,
                                   f"the bundle's ({own[0]} tokens, factor {own[1]:g}, min prob {own[2]:g})"),
                         "preset": True})
        measured.calibration["plain_tokens_per_s"] = t.side_by_side(rows)
        t.curve(before)
        for r in rows:  # again with the averaged latency curve
            again = predict(measured, rec, r["tokens"], r["settings"]["match_factor"], r["settings"]["min_prob"],
                            t.context, r["settings"].get("depth"))
            r.update({k: again[k] for k in ("predicted_ms", "predicted_tokens_per_s")})
        measured.overhead_ms = rec.python_ms
        measured.candidates = rows
        measured.chosen = max((r for r in rows if not r.get("preset")), key=lambda r: r["measured_tokens_per_s"])


TUNER = SuffixTuner()
