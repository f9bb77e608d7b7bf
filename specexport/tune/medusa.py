"""Medusa's tree in `specexport profile`: from how often head d's rank-r candidate is the token the target emits d + 1
places after the step's root, the tree for every node budget (runtime/rank_tree.from_accuracy), its accept length
replayed on the recorded steps (exact there, where the rates' product assumes the heads independent), the
predicted tokens/s = tau / (verify(T) + per-step overhead); the best budgets and the presets that fit then run side
by side."""

from __future__ import annotations

import json

import numpy as np

from specexport.runtime import rank_tree
from specexport.tune.measure import Measured, Recording, median_ms, replay

RANKS = 10


def rank_rates(recording: Recording, heads: int) -> list[list[float]]:
    """rates[d][r]: the share of steps where head d's rank-r candidate is the token emitted d + 1 after the root."""
    hits, counts = np.zeros((heads, RANKS)), np.zeros(heads)
    for draft, emitted in recording.samples:
        if draft.candidates is None:
            continue
        for d in range(min(heads, len(emitted))):
            counts[d] += 1
            where = np.flatnonzero(draft.candidates[d][:RANKS] == emitted[d])
            if where.size:
                hits[d, where[0]] += 1
    return (hits / np.maximum(counts, 1)[:, None]).round(4).tolist()


def heads_latency(engine, reps: int) -> float:
    """Median ms of the heads on one row: the bundle's stand-alone heads graph, the computation the fused step adds
    at its accepted row."""
    session = engine.graph("medusa_heads")
    info = session.session.get_inputs()[0]
    hidden = np.zeros((1, info.shape[-1]), np.float16 if info.type == "tensor(float16)" else np.float32)
    return round(median_ms(lambda: session.run({info.name: hidden}), reps), 3)


def predict(measured: Measured, recording: Recording, row: dict, context: int) -> dict:
    """Fill a candidate row's expected tau (replayed) and predicted step ms and tokens/s (in place; returns it)."""
    tree = rank_tree.make(row["paths"])
    taus = [replay(tree.medusa_tokens(draft.tokens[0], draft.candidates), tree.parents, emitted)
            for draft, emitted in recording.samples if draft.candidates is not None]
    tau = float(np.mean(taus)) if taus else rank_tree.expected_accept_length(tree, measured.rank_rates)
    ms = measured.verify_at(tree.size, context) + measured.overhead_ms
    row.update(tokens=tree.size, depth=tree.depth, expected_tau=round(tau, 3), predicted_ms=round(ms, 3),
               predicted_tokens_per_s=round(1000 * tau / ms, 2), settings={"tree": json.dumps(tree.as_lists())})
    return row


class MedusaTuner:
    def progress_steps(self, engine, prompts: int, tokens: int, rounds: int) -> int:
        return 2 * tokens + prompts * rounds

    def tune(self, engine, measured: Measured, recording: Recording, t) -> None:
        """The tree: every budget predicted, the best and the presets side by side; the best predicted wins."""
        heads = engine.bundle.manifest["method"]["heads_count"]
        measured.heads_ms = heads_latency(engine, t.reps)
        measured.rank_rates = rank_rates(recording, heads)
        before = t.curve()
        rows = sorted((predict(measured, recording, {"tree": f"auto:{n}", "paths": tree.as_lists()}, t.context)
                       for n in range(1, t.max_tokens)
                       for tree in [rank_tree.from_accuracy(measured.rank_rates, n)]),
                      key=lambda r: -r["predicted_tokens_per_s"])
        best = rows[0]
        rows = [best] + [r for r in self.preset_rows(measured, recording, t.max_tokens, heads, t.context)
                         if r["paths"] != best["paths"]]
        measured.calibration["plain_tokens_per_s"] = t.side_by_side(rows)
        t.curve(before)
        for row in rows:
            predict(measured, recording, row, t.context)
        measured.candidates, measured.chosen = rows, rows[0]

    @staticmethod
    def preset_rows(measured: Measured, recording: Recording, max_tokens: int, heads: int, context: int) -> list:
        rows = []
        for name, paths in rank_tree.PRESETS.items():
            tree = rank_tree.make(paths)
            if tree.size <= max_tokens and tree.depth <= heads and tree.top_k <= RANKS:
                rows.append(predict(measured, recording, {"tree": name, "paths": tree.as_lists()}, context))
        return rows


TUNER = MedusaTuner()
