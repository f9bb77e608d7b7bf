"""DFlash in `specexport profile`: predict every (depth, top-k, total tokens) from recorded blocks, then measure.

A step's block gives every position's candidates in one draft call, whatever the settings: the tree of any depth,
top-k and total is the best paths through the first `depth` positions' first `top_k` candidates
(runtime/methods/dflash.best_paths), a function of the recorded block alone. So one greedy calibration run at the
widest setting, each step's block kept, gives the accept length of every setting exactly on those steps. Cost
per step: verify(total) from the latency curve, the draft call (one per step, its mean time measured), and the
rest of the step (python) as measured. The best predicted settings, and the bundle's own, then run side by side
with plain decoding; the best measured wins.
"""

from __future__ import annotations

import numpy as np

from specexport.runtime.methods.dflash import best_paths
from specexport.tune.measure import Measured, Recording, record_runs, replay

TOP_KS = (1, 2, 3, 4)
TOTALS = (2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)


def predict(measured: Measured, rec: Recording, depth: int, k: int, total: int, context: int,
            name: str | None = None) -> dict:
    taus = []
    for draft, emitted in rec.samples:
        tokens, logps = draft.candidates
        cut = best_paths(draft.tokens[0], tokens[:depth, :k], logps[:depth, :k], total - 1)
        taus.append(replay(cut.tokens, cut.parents, emitted))
    tau = float(np.mean(taus))
    ms = measured.verify_at(total, context) + rec.draft_call_ms + rec.python_ms
    return {"tree": name or f"depth {depth}, top-k {k}, {total} tokens", "short": f"d{depth} k{k}\n{total} tok",
            "tokens": total, "depth": depth, "top_k": k,
            "settings": {"depth": depth, "top_k": k, "total_tokens": total}, "expected_tau": round(tau, 3),
            "predicted_ms": round(ms, 3), "predicted_tokens_per_s": round(1000 * tau / ms, 2)}


class DFlashTuner:
    def progress_steps(self, engine, prompts: int, tokens: int, rounds: int) -> int:
        return 2 * tokens + prompts * (rounds + 1)

    def tune(self, engine, measured: Measured, recording: Recording, t, count: int = 3) -> None:
        section = engine.bundle.manifest["method"]
        block, own = section["block_size"], engine.settings
        before = t.curve()
        widest = max(k for k in TOP_KS if k <= section["graph_top_k"])
        try:  # every position, the widest candidates: what every setting's tree is cut from
            engine.configure(depth=block - 1, top_k=widest, total_tokens=min(t.max_tokens, 2 * (block - 1)))
            rec = record_runs(engine, t.ids, t.new_tokens, t.progress)
        finally:
            engine.configure()
        rows = [predict(measured, rec, d, k, n, t.context) for k in TOP_KS if k <= widest
                for d in range(1, block) for n in TOTALS
                if n <= t.max_tokens and n - 1 <= sum(k ** i for i in range(1, d + 1)) and (k > 1 or n == d + 1)]
        rows = sorted(rows, key=lambda r: -r["predicted_tokens_per_s"])[:count]
        if all(r["settings"] != {"depth": own.depth, "top_k": own.top_k, "total_tokens": own.total_tokens}
               for r in rows):  # the bundle's own settings are the yardstick
            rows.append({**predict(measured, rec, own.depth, own.top_k, own.total_tokens, t.context,
                                   "the bundle's"), "preset": True})
        measured.calibration["plain_tokens_per_s"] = t.side_by_side(rows)
        t.curve(before)
        measured.overhead_ms = rec.python_ms
        measured.candidates = rows
        measured.chosen = max((r for r in rows if not r.get("preset")), key=lambda r: r["measured_tokens_per_s"])


TUNER = DFlashTuner()
