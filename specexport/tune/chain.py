"""Draft length in `specexport profile` for draft-model and n-gram bundles: predict every length from recorded
proposals, then measure.

A greedy proposal of length K is the first K levels of the proposal of a longer length made from the same
history: the draft model's chain (or top-k levels) is built level by level, and prompt lookup copies the same
continuations, only shorter. So one calibration run at the longest length records each step's tree, and the accept
length of every K follows exactly on those steps (its nodes at depth <= K, replayed with the runtime's acceptance
rule). Cost per step: verify(nodes + 1) from the latency curve at each step's own size, the draft model's K calls
(one over the newly committed tokens, one per further level; their mean time is measured), and the rest of the
step (python) as measured. The best predicted lengths then run side by side with the bundle's own and plain
decoding; the best measured wins.
"""

from __future__ import annotations

import numpy as np

from specexport.options import fields
from specexport.tune.measure import Measured, Recording, cut_depth, record_runs, replay

LENGTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12)


def settings_at(engine, length: int) -> dict:
    """The bundle's settings with draft length `length` (as the method normalises them), as a dict."""
    s = engine.method.settings(engine.bundle.manifest["method"], {"draft_length": length})
    return {f.name: getattr(s, f.name) for f in fields(type(s)) if f.build}


def predict(measured: Measured, rec: Recording, settings: dict, length: int, context: int,
            name: str | None = None) -> dict:
    """Draft length `length`: its accept length and step time on the recorded steps, and tokens/s."""
    taus, verify_ms, sizes = [], [], []
    for draft, emitted in rec.samples:
        tokens, parents = cut_depth(draft.tokens, draft.parents, length)
        taus.append(replay(tokens, parents, emitted))
        verify_ms.append(measured.verify_at(len(tokens), context))
        sizes.append(len(tokens))
    tau = float(np.mean(taus))
    ms = float(np.mean(verify_ms)) + length * rec.draft_call_ms + rec.python_ms  # n-gram: no draft calls
    return {"tree": name or f"draft length {length}", "short": f"K={length}" + ("\n(bundle)" if name else ""),
            "tokens": max(sizes), "depth": length, "settings": settings, "expected_tau": round(tau, 3),
            "predicted_ms": round(ms, 3), "predicted_tokens_per_s": round(1000 * tau / ms, 2)}


class ChainTuner:
    def lengths(self, engine, max_tokens: int) -> list[int]:
        """The draft lengths whose largest tree fits `max_tokens` on this bundle."""
        return [k for k in LENGTHS if engine.method.tokens_per_step(
            engine.method.settings(engine.bundle.manifest["method"], {"draft_length": k})) <= max_tokens]

    def progress_steps(self, engine, prompts: int, tokens: int, rounds: int) -> int:
        return 2 * tokens + prompts * (rounds + 1)

    def tune(self, engine, measured: Measured, recording: Recording, t, count: int = 3) -> None:
        lengths = self.lengths(engine, t.max_tokens)
        before = t.curve()
        longest, bundle_length = max(lengths), engine.settings.draft_length
        try:
            engine.configure(draft_length=longest)
            rec = record_runs(engine, t.ids, t.new_tokens, t.progress)
        finally:
            engine.configure()
        ranked = sorted((predict(measured, rec, settings_at(engine, k), k, t.context) for k in lengths),
                        key=lambda r: -r["predicted_tokens_per_s"])
        rows = ranked[:count]
        if all(r["depth"] != bundle_length for r in rows):  # the bundle's own length is the yardstick
            rows.append({**predict(measured, rec, settings_at(engine, bundle_length), bundle_length, t.context,
                                   f"the bundle's (draft length {bundle_length})"), "preset": True})
        measured.calibration["plain_tokens_per_s"] = t.side_by_side(rows)
        t.curve(before)
        for r in rows:  # again with the averaged latency curve
            again = predict(measured, rec, r["settings"], r["depth"], t.context)
            r.update({k: again[k] for k in ("predicted_ms", "predicted_tokens_per_s")})
        measured.overhead_ms = rec.python_ms
        measured.candidates = rows
        measured.chosen = max((r for r in rows if not r.get("preset")), key=lambda r: r["measured_tokens_per_s"])


TUNER = ChainTuner()
