"""Draft graphs' calls: one sequence's alone, or many sequences' made together in one batched call.

A proposer with a draft graph of its own (EAGLE's, a draft model's) writes its proposal as a generator, `drafting
(history)`: it yields each draft call it needs (`DraftCall`: nodes of a tree on its own cache), receives that call's
outputs, and returns the step's DraftTree. Its cache bookkeeping (rewind, advance) stays in the generator, between
its calls. `alone` runs one generator on its own cache (batch 1: `propose`); `together` runs the generators of the
running sequences of a batched step in lockstep on a pool of draft caches whose slots mirror the target's
(runtime/kvcache.KVPool): each round, every sequence still drafting gives one call, and the calls are made as one,
laid out as the target's verification call is (runtime/batch.PaddedBatch). A call wider than `limit` (a
prompt's first feed) runs alone on its slot, after the batched one (whose padding writes past every slot's length):
padding every sequence to a prompt's length would cost more than it saves. A generator that raises fails its own
sequence only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from specexport.runtime.batch import Entry, PaddedBatch
from specexport.runtime.proposer import Proposer


@dataclass(frozen=True)
class DraftCall:
    """One draft graph call: `ids` [t] at `positions` [t], `mask` [t, k] (the nodes' ancestors among the last k rows,
    k - t of them already in the cache), the rows whose per-row outputs are read, the outputs wanted, and the
    graph's other per-node inputs ([t, ...] each)."""

    ids: list[int]
    positions: np.ndarray
    mask: np.ndarray
    rows: list[int]
    want: tuple[str, ...]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)


class DraftingProposer(Proposer):
    """A proposer with a draft graph of its own: `session` (that graph), `cache` (its rows: its own, or a slot of the
    scheduler's draft pool), `extra_rows` (the rows its trees take past the target's) and `drafting(history)`, the
    generator of its draft calls; `propose` runs it alone."""

    session: object
    cache: object
    extra_rows: int

    def drafting(self, history: list[int]): ...

    def propose(self, history: list[int]):
        return alone(self.drafting(history), self.session, self.cache)


def alone(drafting, session, cache):
    """Run a proposer's generator with its calls made on `cache` alone; returns what it returns (its tree)."""
    out = None
    try:
        while True:
            call = drafting.send(out)
            out = _one(session, cache, call)
    except StopIteration as stop:
        return stop.value


def together(draftings: list, slots: list[int], session, pool, n: int, limit: int) -> list:
    """Run the generators of sequences in pool slots `slots` (among the first n, the running ones) in lockstep, each
    round's calls made as one over the first n slots (slots without a call are padding). Returns each generator's
    tree, or the exception it raised (or its call raised)."""
    results: list = [None] * len(draftings)
    outs: list = [None] * len(draftings)
    live = list(range(len(draftings)))
    while live:
        calls = {}
        for i in live:
            try:
                calls[i] = draftings[i].send(outs[i])
            except StopIteration as stop:
                results[i] = stop.value
            except Exception as e:  # noqa: BLE001 - one sequence's failure is its own
                results[i] = e
        live = list(calls)
        narrow = {i: c for i, c in calls.items() if len(c.ids) <= limit}
        behind = max((c.mask.shape[1] - len(c.ids) for c in narrow.values()), default=0)
        if len(narrow) < 2 or behind > int(pool.lengths[:n].min()):  # nothing to batch, or a slot too short for it
            narrow = {}
        if narrow:  # before the calls made alone: its padding writes past every other slot's length
            try:
                for i, o in _batched(session, pool, n, {i: (slots[i], c) for i, c in narrow.items()}, behind).items():
                    outs[i] = o
            except Exception as e:  # noqa: BLE001 - the call failed: every sequence in it fails with its message
                for i in narrow:
                    results[i] = e
                    live.remove(i)
        for i in [i for i in calls if i not in narrow]:
            try:
                outs[i] = _one(session, pool.slot(slots[i]), calls[i])
            except Exception as e:  # noqa: BLE001
                results[i] = e
                live.remove(i)
    return results


def _one(session, cache, call: DraftCall) -> dict:
    return session.forward(cache, np.asarray([call.ids]), np.asarray(call.positions)[None], call.mask,
                           np.asarray(call.rows), want=call.want,
                           inputs={name: value[None] for name, value in call.inputs.items()})


def _batched(session, pool, n: int, calls: dict[int, tuple[int, DraftCall]], behind: int) -> dict:
    """One call over the first n slots, `calls` {key: (slot b, call)}, laid out by runtime/batch.PaddedBatch; the
    mask's columns cover `behind` cached rows before each row's first node. Returns each key's outputs: per-row
    outputs by its call's rows, per-batch-row outputs ([1, t, ...]) by its slot."""
    batch = PaddedBatch.lay_out(pool.lengths[:n], [Entry(key, b, c.ids, np.asarray(c.positions), c.mask, c.rows,
                                                         c.inputs) for key, (b, c) in calls.items()], behind)
    want = tuple(sorted({w for _, c in calls.values() for w in c.want}))
    out = session.forward(pool.rows(n), batch.ids, batch.positions, batch.mask, batch.selected, want=want,
                          inputs=batch.inputs, live=batch.live)
    return {key: batch.placed(key, out, call.want, session.batch_outputs) for key, (_, call) in calls.items()}


def own_cache(proposer, capacity: int, cache=None):
    """A proposer's draft cache for a generation of `capacity` target rows, with the `extra_rows` its trees take:
    `cache` where given (a slot of a scheduler's draft pool), else a cache of its own."""
    need = capacity + proposer.extra_rows
    if cache is None:
        return proposer.session.new_cache(need)
    if cache.capacity < need:
        raise ValueError(f"a draft cache of {cache.capacity} rows for {need}")
    return cache
