"""Draft length in `specexport profile` for draft-model and n-gram bundles: predict every length from recorded
proposals, then measure.

A greedy proposal of length K is the first K levels of the proposal of a longer length made from the same
history: the draft model's chain (or top-k levels) is built level by level, and prompt lookup copies the same
continuations, only shorter. So one calibration run at the longest length records each step's proposal, and
the accept length of every K follows exactly on those steps (`accept_length`). Cost per step: verify(nodes + 1)
from the latency curve at each step's own size, the draft model's K calls (one over the newly committed
tokens, one per further level; their mean time is measured), and the rest of the step (python) as measured.
The best predicted lengths then run side by side with the bundle's own and plain decoding.
"""

from __future__ import annotations

import numpy as np

LENGTHS = (1, 2, 3, 4, 5, 6, 8, 10, 12)


class ProposalRecorder:
    """Wraps a draft or n-gram proposer: keeps each step's proposal with the position of its root, and times
    the draft model's calls."""

    def __init__(self, inner):
        from specexport.profiles.measure import CallTimer

        self.inner, self.records = inner, []
        self.max_nodes = inner.max_nodes
        session = getattr(inner, "session", None)
        self.draft = CallTimer(session, "forward") if session is not None else None

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, history):
        proposal = self.inner.propose(history)
        self.records.append((len(history) - 1, (list(proposal.tokens), list(proposal.parents))))
        return proposal

    def close(self):
        if self.draft is not None:
            self.draft.close()


def cut(parents: list[int], length: int) -> list[int]:
    """The nodes of a proposal (parents relative to the draft list, -1 = the root) at depth <= length."""
    depth, keep = [], []
    for i, p in enumerate(parents):
        depth.append(1 if p < 0 else depth[p] + 1)
        if depth[i] <= length:
            keep.append(i)
    return keep


def accept_length(tokens: list[int], parents: list[int], keep: list[int], emitted: list[int]) -> int:
    """Tokens a greedy step emits with the proposal's nodes `keep`: the path matching `emitted` (the target's
    tokens after the root; the first matching child wins, as in verify.accept_greedy) plus the bonus."""
    node, n = -1, 0
    while n < len(emitted):
        node = next((c for c in keep if parents[c] == node and tokens[c] == emitted[n]), None)
        if node is None:
            break
        n += 1
    return n + 1


def calibrate(engine, prompts: list[list[int]], new_tokens: int, length: int, progress) -> dict:
    """Greedy runs at draft length `length`: the recorded proposals with what the target emitted, the mean draft
    call, and the per-step time outside the target's verify calls and the draft calls."""
    from specexport.profiles.measure import recorded_runs

    before, engine.draft_length = engine.draft_length, length
    try:
        return recorded_runs(engine, prompts, new_tokens, ProposalRecorder, progress)
    finally:
        engine.draft_length = before


def predict(measured, cal: dict, length: int, context: int, name: str | None = None) -> dict:
    """Draft length `length`: its accept length and step time on the calibration's steps, and tokens/s."""
    taus, verify_ms, sizes = [], [], []
    for (tokens, parents), emitted in cal["samples"]:
        keep = cut(parents, length)
        taus.append(accept_length(tokens, parents, keep, emitted))
        verify_ms.append(measured.verify_at(len(keep) + 1, context))
        sizes.append(len(keep) + 1)
    tau = float(np.mean(taus))
    ms = float(np.mean(verify_ms)) + length * cal["draft_call_ms"] + cal["python_ms"]  # n-gram: no draft calls
    return {"tree": name or f"draft length {length}", "short": f"K={length}" + ("\n(bundle)" if name else ""),
            "tokens": max(sizes), "depth": length, "choices": {"draft_length": length},
            "expected_tau": round(tau, 3), "predicted_ms": round(ms, 3), "predicted_tokens_per_s": round(1000 * tau / ms, 2)}


def rows(measured, cal: dict, lengths: list[int], bundle_length: int, context: int, count: int = 3) -> list[dict]:
    """The `count` best predicted lengths, then the bundle's own (the yardstick) when it is not among them."""
    ranked = sorted((predict(measured, cal, k, context) for k in lengths), key=lambda r: -r["predicted_tokens_per_s"])
    picked = ranked[:count]
    if all(r["depth"] != bundle_length for r in picked):
        picked.append({**predict(measured, cal, bundle_length, context, f"the bundle's (draft length {bundle_length})"),
                       "preset": True})
    return picked
