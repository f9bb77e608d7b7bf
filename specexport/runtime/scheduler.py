"""Many requests on one engine: continuous batching of speculative steps.

A front end (a server, a benchmark, a script with threads) `submit`s requests to a `Scheduler` and holds a
`Request` for each: it streams the request's text as steps accept it, waits for the result, or cancels it. The
scheduler runs one loop (its own thread, or `run_until_idle` called by the owner) whose every step is:

1. Requests cancelled since the last step stop (their slots are free for the next step).
2. Waiting requests are admitted while there are free slots; one at a time prefills.
3. The prefilling request feeds one chunk of its prompt (at most `prefill_chunk` tokens): a long prompt holds the
   running streams back by one chunk per step, never by its whole length. Its last chunk gives its first token. A
   prompt whose leading chunks an earlier prompt began with (the template's system prompt, a conversation's earlier
   turns) copies their rows, kept by that prompt, into its slot instead of computing them (runtime/prefix.py), in the
   same step as its next chunk.
   (Filling the rest of a step's `prefill_chunk` with the next waiting prompts measured worse, README: requests
   prefilled together finish together and come back as a burst, whose prefill stalls every stream.)
4. One target call verifies every running sequence's tree: each sequence proposes its tree with its own proposer,
   the trees are padded to the widest (a padded row sees only itself and writes cache rows past its sequence's
   length, which nothing reads; a graph with ragged rows computes the real rows only, exporter/graph.py), each row
   with its sequence's past length and positions. Each sequence accepts
   its rows with its own sampling settings and random stream (runtime/verify.accept: a seeded request gives the
   same tokens whatever else is in the batch), commits its path in its slot, and emits. A sequence running alone
   takes the engine's own step (Engine.step: its whole tree, the acceptance fused into the graph), as batch 1 does.
   With a tree budget (runtime/budget.py) the step first asks whether drafting pays at all (what a proposing step
   costs outside the target's call against a plain one, both measured, weighed with what the last proposing steps
   chose); where it does not, every sequence verifies its root alone; where it does, the budget shares the step's
   rows among the trees.

The KV cache is a pool of slots (runtime/kvcache.KVPool) with the running sequences in a prefix, bound in place:
the batched call takes a view of the first n slots, no copy. A finished sequence's slot is refilled by moving the
last running one down (one copy of its rows); the prefilling request sits right after the running ones.

Greedy sequences are accepted by the graph's batched acceptance (exporter/fused.add_batch_accept: each sequence's
accepted rows and bonus token from its own rows; the call then brings back no logits when every sequence is greedy),
or, where the graph has none (plain decoding's chain-only graph, older bundles), on the host from one argmax over
the call's rows. Sampled sequences accept on the host from their rows' logits (runtime/verify.accept), each with
its own settings and random stream. The batch-1 acceptance fused into the graph runs on batch row 0 and is ignored.
Proposers with a draft graph (EAGLE's, a draft model's) draft together: their caches are the slots of a second pool
mirroring the target's (moved with them), and each round of their draft calls is one batched call over the running
slots (runtime/drafting.together). A request that fails (its proposer raises, its sampling fails) stops with its
message; the others go on.
"""

from __future__ import annotations

import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from specexport.errors import UserError
from specexport.runtime import drafting, tree
from specexport.runtime.budget import AcceptanceRates, BatchLatency, grid, share, worth_drafting
from specexport.runtime.drafting import DraftingProposer
from specexport.runtime.generate import PREFILL_CHUNK, Engine, Output, Stats, StepRecord
from specexport.runtime.request import Request
from specexport.runtime.sampling import Sampler, SamplingParams
from specexport.runtime.verify import Acceptance, accept, accept_greedy

BATCH_ACCEPT = ("batch_accept_mask", "batch_accept_len", "batch_bonus")  # the graph's batched greedy acceptance
STEP_BLEND = 0.1  # the last step's weight in the running averages (the steps' costs, the host's per sampled row)
PROBE_STEPS = 16  # while drafting does not pay, one batched step in this many proposes anyway (see _drafting_pays)
PLAIN_PROBE_STEPS = 16  # while drafting pays, one batched step in this many verifies the roots alone (likewise)
WIDTHS_KEPT = 10_000  # target calls whose (sequences, width) the scheduler keeps (a server runs for weeks)


def _blend(average: float | None, value: float) -> float:
    """A running average with the last step weighted STEP_BLEND (the first value starts it)."""
    return value if average is None else average + STEP_BLEND * (value - average)


@dataclass
class _Sequence:
    """A request inside the scheduler: its prompt, proposer, sampler, output, slot and progress."""

    request: Request
    ids: list[int]
    output: Output
    sampler: Sampler
    proposer: object
    chunks: list[list[int]]
    stats: Stats
    capacity: int  # the target rows the generation may take (its proposer's `start`)
    slot: int = -1
    pending: list[int] = field(default_factory=list)  # tokens accepted but not yet emitted
    fed: int = 0  # the prompt's chunks in its cache

    @property
    def history(self) -> list[int]:
        return self.ids + self.output.tokens

    @property
    def last(self) -> int:
        """history[-1], without building it."""
        return self.output.tokens[-1] if self.output.tokens else self.ids[-1]


class _HostAccepting:
    """The engine as a scheduled sequence's proposer sees it: its steps accept on the host (the acceptance fused into
    the graph is batch 1), so a proposer that reads the target's outputs asks for every row's."""

    def __init__(self, engine: Engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def accepts_in_graph(self, sampler, mode) -> bool:
        return False


class Scheduler:
    """Continuous batching on one engine (see the module docstring). `max_batch`: the most sequences in a step
    (more requests wait their turn, never refused); `prefill_chunk`: the most prompt tokens fed per step;
    `plain`: plain decoding instead of the bundle's method; `budget`: one tree budget for the batch
    (runtime/budget.py: the trees' width chosen per step), else every tree as its proposer made it; `background`: run
    the loop in a thread of its own (else the owner calls `run_until_idle`)."""

    def __init__(self, engine: Engine, max_batch: int = 8, prefill_chunk: int | None = None, plain: bool = False,
                 budget: bool = True, background: bool = True):
        if max_batch < 1:
            raise UserError(f"max_batch must be >= 1, got {max_batch}")
        prefill_chunk = PREFILL_CHUNK if prefill_chunk is None else prefill_chunk
        if prefill_chunk < 1:
            raise UserError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if not hasattr(engine.target, "new_pool"):
            raise UserError("batched generation runs on ONNX Runtime (--device cpu, cuda or cpu-iobinding) in this "
                            "version")
        self.engine, self.max_batch, self.prefill_chunk, self.plain = engine, max_batch, prefill_chunk, plain
        self._host = _HostAccepting(engine)
        self.step_rows = 1 if plain else engine.method.tokens_per_step(engine.settings)
        self.batch_accept = set(BATCH_ACCEPT) <= set(engine.target.outputs)
        self.pool = engine.target.new_pool(max_batch, engine.max_context + self.step_rows)
        self.rates = self.latency = None
        if budget and self.step_rows > 1:
            self.rates = AcceptanceRates(self.step_rows)
            widths = grid(self.step_rows)  # at 128 rows of context, or what the model's positions leave
            self.latency = profiled_latency(engine) or BatchLatency.measure(
                engine.target, self.pool, grid(max_batch), widths, min(128, engine.max_context - max(widths)))
        # a batched step's time outside the target's calls, by whether it proposed (True) or not (False): the host's
        # work (the proposals, their scoring, the width's choice, the bookkeeping of the accepted paths) and the
        # draft graphs' calls, less the acceptance of sampled rows (priced per row, `row_s`); an average over the
        # last steps of the kind, None before the first
        self.step_cost: dict[bool, float | None] = {True: None, False: None}
        # what the budget chose at its last proposing steps: (expected tokens and real rows per sequence, the call's
        # width), whole trees before the first; a step proposes where that, at its cost, beats plain decoding
        self.choice = None if self.rates is None else (float(self.rates.expected(self.step_rows)[-1]),
                                                       float(self.step_rows), float(self.step_rows))
        self.unproposed = 0  # batched steps since the last that proposed
        self.proposed = 0  # batched steps that proposed since the last that did not
        self.row_s = None  # the host's time to accept one sampled row (an average over the last steps; None: not yet)
        self.sampled_s = 0.0  # the host's time accepting sampled rows so far (part of overhead_s)
        self.draft_pool = None  # the draft graph's caches, slot for slot with `pool` (made for the first proposer)
        self.draft_limit = self.step_rows + 1  # the widest draft call made with the others (runtime/drafting.py)
        self.widths: deque[tuple[int, int]] = deque(maxlen=WIDTHS_KEPT)  # (sequences, width) of the last calls
        self.on_step = None  # called with (sequences, width) after each target call (the scheduler's thread)
        self.running: list[_Sequence] = []  # decoding, slot k = index k
        self.prefilling: _Sequence | None = None  # slot len(running)
        self.waiting: deque[_Sequence] = deque()
        self._lock = threading.Condition()
        self._ids = 0
        self._closed = False
        self.steps = 0  # batched target calls so far
        self.rows = 0  # rows they computed (padding included, where the graph computes it)
        self.overhead_s = 0.0  # the steps' time outside every graph call (the scheduler's own work)
        self._thread = None
        if background:
            self._thread = threading.Thread(target=self._loop, name="specexport-scheduler", daemon=True)
            self._thread.start()

    # -- the front end's side ---------------------------------------------------------------------
    def submit(self, prompt: str | list[int], max_new_tokens: int = 128, sampling: SamplingParams | None = None,
               stop: tuple[str, ...] = (), stop_ids: tuple[int, ...] | None = None, chat: bool = True,
               on_text=None, on_end=None, on_tokens=None, cancel=None) -> Request:
        """Queue a generation; returns its handle at once. A bad request (an empty or too long prompt, a bad
        setting) raises UserError here and never enters the batch. `on_text(piece)` receives the text as it is
        accepted instead of `Request.stream`; `on_tokens(ids)` the token ids each step emitted (after their text);
        `on_end(request)` is called once the request has ended (all on the scheduler's thread: they must be quick
        and must not raise). `cancel`: a threading.Event or a callable returning True to stop, read by the scheduler
        before each step as `Request.cancel` is (a submitter whose cancellation comes from elsewhere, the C ABI's
        specexport_cancel, needs no thread of its own watching it)."""
        engine = self.engine
        ids, budget = engine.request(prompt, max_new_tokens, stop, chat)
        sampler = Sampler(sampling or SamplingParams())
        proposer = engine.proposer(sampler, self.plain) if self.plain else \
            engine.method.proposer(self._host, engine.settings, sampler)
        with self._lock:
            if self._closed:
                raise UserError("the scheduler is closed")
            self._ids += 1
            request = Request(self._ids, len(ids), on_end, on_tokens, cancel)
            text = on_text if on_text is not None else request._text
            chunks = engine.prefill_chunks(ids, self.prefill_chunk)
            seq = _Sequence(request, ids, Output(engine.tokenizer, stop, stop_ids, max_new_tokens, budget, text),
                            sampler, proposer, chunks, Stats(len(ids)), len(ids) + budget + proposer.max_drafts)
            self.waiting.append(seq)
            self._lock.notify()
        return request

    def close(self) -> None:
        """Stop the loop; requests still queued or running end as cancelled."""
        with self._lock:
            self._closed = True
            self._lock.notify()
        if self._thread is not None:
            self._thread.join()
        for seq in list(self.running) + ([self.prefilling] if self.prefilling else []) + list(self.waiting):
            seq.output.reason = seq.output.reason or "cancelled"
            self._end(seq)
        self.running, self.prefilling, self.waiting = [], None, deque()

    @property
    def alive(self) -> bool:
        """Whether steps run: the loop's thread is up (a scheduler without one runs when its owner calls it)."""
        return self._thread is None or self._thread.is_alive()

    @property
    def active(self) -> int:
        """Requests admitted or waiting."""
        return len(self.running) + (self.prefilling is not None) + len(self.waiting)

    def run_until_idle(self) -> None:
        """Run steps until no request is left (for a scheduler without a background thread)."""
        while self.step():
            pass

    # -- the loop -------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self.active:
                    self._lock.wait()
                if self._closed:
                    return
            try:
                self.step()
            except Exception as e:  # noqa: BLE001 - a fault of the step itself: fail what is admitted, go on
                traceback.print_exc()
                self._fail_admitted(f"internal error in the batched step: {_message(e)}")

    def _fail_admitted(self, message: str) -> None:
        """End every admitted request with `message` and free the pool (the waiting ones are untouched)."""
        seqs = self.running + ([self.prefilling] if self.prefilling is not None else [])
        self.running, self.prefilling = [], None
        self.pool.lengths[:] = 0
        if self.draft_pool is not None:
            self.draft_pool.lengths[:] = 0
        for seq in seqs:
            if not seq.request.done:
                self._end(seq, message)

    def step(self) -> bool:
        """One scheduler step (the module docstring); returns whether any request is left."""
        graphs = [self.engine.target] + self.engine.side_graphs()
        start, inside = time.perf_counter(), sum(g.seconds for g in graphs)
        self._drop_cancelled()
        self._admit()
        if self.prefilling is not None:
            self._prefill_one_chunk()
        if self.running:
            self._decode()
        graphs = [self.engine.target] + self.engine.side_graphs()
        host = time.perf_counter() - start - (sum(g.seconds for g in graphs) - inside)
        self.overhead_s += host
        return self.active > 0

    def _drop_cancelled(self) -> None:
        for seq in [s for s in self.running if s.request.cancelled]:
            seq.output.reason = "cancelled"
            self._retire(seq)
        with self._lock:
            for seq in [s for s in self.waiting if s.request.cancelled]:
                self.waiting.remove(seq)
                seq.output.reason = "cancelled"
                self._end(seq)
        if self.prefilling is not None and self.prefilling.request.cancelled:
            seq, self.prefilling = self.prefilling, None
            seq.output.reason = "cancelled"
            self._end(seq)

    def _admit(self) -> None:
        with self._lock:
            if self.prefilling is not None or not self.waiting or len(self.running) >= self.max_batch:
                return
            seq = self.waiting.popleft()
        seq.slot = len(self.running)
        self.pool.lengths[seq.slot] = 0
        try:
            seq.proposer.start(len(seq.ids), seq.capacity, self._draft_cache(seq))
        except Exception as e:  # noqa: BLE001 - one request's failure ends that request only
            return self._end(seq, error=_message(e))
        self.prefilling = seq

    def _draft_cache(self, seq: _Sequence):
        """The slot of the draft pool for a proposer with a draft graph (the pool made for the first), else None."""
        proposer = seq.proposer
        if not isinstance(proposer, DraftingProposer):
            return None
        if self.draft_pool is None:
            capacity = self.pool.capacity + proposer.extra_rows + self.draft_limit  # the limit: a batched call's padding
            self.draft_pool = proposer.session.new_pool(self.max_batch, capacity)
        self.draft_pool.lengths[seq.slot] = 0
        return self.draft_pool.slot(seq.slot)

    def _prefill_one_chunk(self) -> None:
        seq, cache = self.prefilling, self.pool.slot(self.prefilling.slot)
        try:
            seq.fed, logits = self.engine.prefill_next(cache, seq.chunks, seq.fed, seq.proposer, fused=False)
            if seq.fed < len(seq.chunks):
                return
            seq.pending = [seq.sampler(logits)]
        except Exception as e:  # noqa: BLE001 - one request's failure ends that request only
            self.prefilling = None
            self._end(seq, error=_message(e))
            return
        seq.stats.ttft_s = time.perf_counter() - seq.request.submitted
        self.prefilling = None
        self.running.append(seq)  # its slot is len(running) already
        if self._emit(seq, seq.pending):
            self._retire(seq)

    def _decode(self) -> None:
        """One target call over every running sequence's tree, then each sequence's acceptance, commit and emission.
        Sequences that end leave after every sequence has committed (a slot move copies committed rows only)."""
        if len(self.running) == 1 and not self.running[0].request.cancelled \
                and self.running[0].proposer.wants(True) == self.running[0].proposer.wants(False):
            return self._single_step(self.running[0])
        graphs = [self.engine.target] + self.engine.side_graphs()
        seqs, trees, leaving, started = [], [], [], time.perf_counter()
        inside, sampled_s = sum(g.seconds for g in graphs), self.sampled_s
        live = [seq for seq in self.running if not seq.request.cancelled]  # a cancelled one's row is padding
        proposing = self._drafting_pays(live)
        probe = self._probe_due if proposing else self.proposed >= PLAIN_PROBE_STEPS
        drafts_s = sum(g.seconds for g in graphs[1:])  # draft graphs' calls (EAGLE's, a draft model's)
        proposals = self._propose(live) if proposing else [tree.DraftTree.root_only(s.last) for s in live]
        drafts_s = sum(g.seconds for g in graphs[1:]) - drafts_s
        self.unproposed, self.proposed = (0, self.proposed + 1) if proposing else (self.unproposed + 1, 0)
        for seq, draft in zip(live, proposals):
            if isinstance(draft, Exception):  # one request's failure ends that request only
                leaving.append((seq, _message(draft)))
                continue
            room = self.pool.capacity - int(self.pool.lengths[seq.slot])
            trees.append(draft.truncated(min(room, self.step_rows)))
            seqs.append(seq)
        if seqs:
            if self.rates is not None and proposing:  # the budget shares the step's rows among the trees
                # seeded sampling keeps its tree: its tokens must not depend on the batch
                kept, sampled = [_seeded(s) for s in seqs], [not s.sampler.params.greedy for s in seqs]
                curves = self.rates.curves(trees)
                nodes = share(curves, self.latency, self.step_cost[True] or 0.0, kept, row_s=self.row_s or 0.0,
                              sampled=sampled)
                trees = [t.truncated(int(k)) for t, k in zip(trees, nodes)]
                self._chose(curves, nodes, probe)
            out, placed, rows = self._verify(seqs, trees)
            verified = time.perf_counter()
            accepted = self._accept_all(seqs, trees, out, placed, rows)
            if self.rates is not None:
                fine = [(t, a.path) for t, a in zip(trees, accepted) if not isinstance(a, Exception)]
                self.rates.update([t for t, _ in fine], [path for _, path in fine])
            for seq, draft, acceptance in zip(seqs, trees, accepted):
                try:
                    if isinstance(acceptance, Exception):
                        raise acceptance
                    self.pool.slot(seq.slot).commit(acceptance.path)
                    if proposing:
                        seq.proposer.accepted(acceptance.path)
                    if mine := placed(seq, len(draft), out):
                        seq.proposer.observe(mine, acceptance.path)
                except Exception as e:  # noqa: BLE001
                    leaving.append((seq, _message(e)))
                    continue
                context = len(seq.ids) + len(seq.output.tokens)  # len(history), without building it
                seq.stats.record(StepRecord(draft, acceptance, context, 0.0, verified - started,
                                            time.perf_counter() - started))
                if self._emit(seq, acceptance.tokens):
                    leaving.append((seq, None))
        # what this kind of step costs outside the target's call: the host's work and the draft graphs' calls, less
        # the sampled rows' acceptance (priced per row); the requests leaving (a slot move) are not the kind's cost
        cost = time.perf_counter() - started - (sum(g.seconds for g in graphs) - inside) + drafts_s \
            - (self.sampled_s - sampled_s)
        known = self.step_cost[proposing]
        self.step_cost[proposing] = cost if probe or known is None else _blend(known, cost)
        for seq, error in leaving:
            self._retire(seq, error)

    def _drafting_pays(self, seqs: list[_Sequence]) -> bool:
        """Whether this step proposes (runtime/budget.worth_drafting, with the measured cost of each kind of step
        outside the target's call, `step_cost`): always without a budget, before a proposing step's cost is known,
        and while a request sampled with a seed runs (its tree stays whole). Each kind is tried now and then, so that
        both stay measured at the load of the moment: while drafting does not pay, one batched step in PROBE_STEPS
        proposes anyway (a slow moment on a shared machine, or a load that has passed, must not stop drafting for
        good); while it pays, one in PLAIN_PROBE_STEPS verifies the roots alone (what plain decoding's call and step
        cost, which the choice is made against: otherwise only the latency table, measured at another context and
        on another machine, would say). A probe's cost replaces its kind's average."""
        if self.rates is None or not seqs or self.step_cost[True] is None or self._probe_due:
            return True
        if any(_seeded(s) for s in seqs):
            return True
        if self.proposed >= PLAIN_PROBE_STEPS:
            return False
        plain = self.step_cost[False] or 0.0  # before a plain step: all of a proposing step's cost counts
        sampled = sum(not s.sampler.params.greedy for s in seqs)
        return worth_drafting(len(seqs), *self.choice, self.latency, plain, max(self.step_cost[True] - plain, 0.0),
                              row_s=self.row_s or 0.0, sampled=sampled)

    def _chose(self, curves: list, nodes: np.ndarray, probe: bool) -> None:
        """Keep what the budget chose (`choice`: expected tokens and real rows per sequence, the call's width),
        averaged over the last proposing steps (a probe's replaces)."""
        chosen = (float(np.mean([c[k - 1] for c, k in zip(curves, nodes)])), float(nodes.mean()), float(nodes.max()))
        self.choice = chosen if probe else tuple(_blend(a, b) for a, b in zip(self.choice, chosen))

    @property
    def _probe_due(self) -> bool:
        """Drafting was skipped for PROBE_STEPS batched steps: the next proposes, and its cost replaces the average
        (which is as old as the last proposal)."""
        return self.unproposed >= PROBE_STEPS

    def _propose(self, seqs: list[_Sequence]) -> list:
        """Each sequence's tree (or the exception its proposer raised); draft graphs' calls made together."""
        if self.draft_pool is not None and len(seqs) > 1:
            trees = drafting.together([s.proposer.drafting(s.history) for s in seqs], [s.slot for s in seqs],
                                      seqs[0].proposer.session, self.draft_pool, len(self.running), self.draft_limit)
        else:
            trees = []
            for seq in seqs:
                try:
                    trees.append(seq.proposer.propose(seq.history))
                except Exception as e:  # noqa: BLE001
                    trees.append(e)
        return trees

    def _single_step(self, seq: _Sequence) -> None:
        """One sequence running: the engine's own step (Engine.step), as a batch-1 generation runs it: the proposer's
        whole tree, accepted inside the graph where the graph can (same random numbers as the host's rule)."""
        target, before = self.engine.target, self.engine.target.seconds
        try:
            record = self.engine.step(self.pool.slot(seq.slot), seq.history, seq.proposer, seq.sampler)
        except Exception as e:  # noqa: BLE001 - one request's failure ends that request only
            return self._retire(seq, _message(e))
        width = len(record.tree)
        self._count_call(1, width, width)
        if self.rates is not None:
            self.rates.update([record.tree], [record.acceptance.path])
            self.latency.observe(1, width, target.seconds - before, width)
        seq.stats.record(record)
        if self._emit(seq, record.acceptance.tokens):
            self._retire(seq)

    def _verify(self, seqs: list[_Sequence], trees: list) -> tuple[dict, object, dict]:
        """The batched target call over the running slots, each tree padded to the widest (a padded row sees only
        itself); returns the outputs, a function giving a sequence what its proposer wants of them (per-row
        outputs by its rows, per-batch-row outputs by its slot), and each request's (slot, first selected row). The
        logits come back only for what the graph does not accept itself: sampled sequences, or every sequence where
        the graph has no batched acceptance."""
        n, width = len(self.running), max(len(t) for t in trees)
        ids = np.zeros((n, width), np.int64)
        positions = np.repeat(self.pool.lengths[:n, None], width, axis=1)
        mask = np.broadcast_to(np.eye(width, dtype=np.bool_), (n, width, width)).copy()
        rows, first, live = [], {}, np.zeros(n, np.int64)  # live: each batch row's real rows (a cancelled one's: 0)
        for seq, draft in zip(seqs, trees):
            b, t = seq.slot, len(draft)
            live[b] = t
            ids[b, :t] = draft.tokens
            positions[b, :t] += tree.depths(draft.parents)
            mask[b, :t, :t] = tree.ancestor_mask(draft.parents)
            first[seq.request.id] = (b, len(rows))
            rows.extend(range(b * width, b * width + t))
        wants = {seq.request.id: seq.proposer.wants(False) for seq in seqs}
        target = self.engine.target
        greedy = [seq.sampler.params.greedy for seq in seqs]
        in_graph = ("batch_accept_mask", "batch_bonus") if self.batch_accept and any(greedy) else ()
        logits = ("logits",) if not in_graph or not all(greedy) else ()
        want = logits + in_graph + tuple(sorted({w for ws in wants.values() for w in ws}))
        before = target.seconds
        out = target.forward(self.pool.rows(n), ids, positions, mask, np.array(rows, np.int64), want=want, live=live)
        computed = len(rows) if target.ragged else n * width
        self._count_call(n, width, computed)
        if self.latency is not None:
            self.latency.observe(n, width, target.seconds - before, len(rows))

        def placed(seq: _Sequence, t: int, out: dict, names: tuple[str, ...] | None = None) -> dict:
            b, start = first[seq.request.id]
            return {name: out[name][b:b + 1, :t] if name in target.batch_outputs else out[name][start:start + t]
                    for name in (wants[seq.request.id] if names is None else names)}
        return out, placed, first

    def _accept_all(self, seqs: list[_Sequence], trees: list, out: dict, placed, rows: dict) -> list:
        """Each sequence's acceptance (or the exception it raised): greedy ones from the graph's batched acceptance
        (exporter/fused.add_batch_accept) where it has one, else from one argmax over every row of the call;
        sampled ones on the host from their rows' logits, each with its own settings and random stream."""
        top = None
        if "batch_accept_mask" not in out and any(s.sampler.params.greedy for s in seqs):
            top = out["logits"].argmax(-1)  # one pass for the whole batch
        accepted, sampled_rows, began = [], 0, time.perf_counter()
        for seq, draft in zip(seqs, trees):
            b, start = rows[seq.request.id]
            try:
                if not seq.sampler.params.greedy:
                    logits = placed(seq, len(draft), out, ("logits",))["logits"]
                    sampled_rows += len(draft)
                    accepted.append(accept(draft, logits, seq.sampler.params, seq.sampler.rng))
                elif top is not None and len(draft) == 1:  # a root alone (plain steps): accept_greedy's result
                    accepted.append(Acceptance([0], [int(top[start])]))
                elif top is not None:
                    accepted.append(accept_greedy(draft.tokens, draft.parents, top[start:start + len(draft)]))
                else:
                    path = np.flatnonzero(out["batch_accept_mask"][b, :len(draft)]).tolist()
                    accepted.append(Acceptance(path, [draft.tokens[r] for r in path[1:]] + [int(out["batch_bonus"][b])]))
            except Exception as e:  # noqa: BLE001 - one request's failure ends that request only
                accepted.append(e)
        if sampled_rows:  # the greedy ones' share of this time is a lookup each
            seconds = time.perf_counter() - began
            self.sampled_s += seconds
            self.row_s = _blend(self.row_s, seconds / sampled_rows)
        return accepted

    def _count_call(self, sequences: int, width: int, rows: int) -> None:
        self.steps, self.rows = self.steps + 1, self.rows + rows
        self.widths.append((sequences, width))
        if self.on_step is not None:
            self.on_step(sequences, width)

    @staticmethod
    def _emit(seq: _Sequence, tokens: list[int]) -> bool:
        """Emit a step's tokens; True when the sequence ends. Their arrival is noted on the request."""
        before = len(seq.output.tokens)
        ended = seq.output.emit(tokens) is not None
        seq.request.arrivals.append((time.perf_counter(), len(seq.output.tokens) - before))
        if seq.request._on_tokens is not None:
            seq.request._on_tokens(seq.output.tokens[before:])
        return ended

    # -- leaving ----------------------------------------------------------------------------------
    def _retire(self, seq: _Sequence, error: str | None = None) -> None:
        """A running sequence leaves: the last running one moves into its slot, the prefilling one down after it."""
        k = self.running.index(seq)
        last = self.running.pop()
        if last is not seq:
            self._move(last, k)
            self.running[k] = last
        if self.prefilling is not None:
            self._move(self.prefilling, len(self.running))
        self._end(seq, error)

    def _move(self, seq: _Sequence, slot: int) -> None:
        """Move a sequence's rows (the target's, its draft's) to another slot."""
        self.pool.move_slot(seq.slot, slot)
        if self.draft_pool is not None and isinstance(seq.proposer, DraftingProposer):
            self.draft_pool.move_slot(seq.slot, slot)
            seq.proposer.cache = self.draft_pool.slot(slot)
        seq.slot = slot

    def _end(self, seq: _Sequence, error: str | None = None) -> None:
        seq.stats.seconds = time.perf_counter() - seq.request.submitted
        if error is not None:
            seq.request._finish(None, error)
            return
        seq.request._finish(seq.output.close(seq.stats))


def profiled_latency(engine: Engine) -> BatchLatency | None:
    """The batched latency table of the profile the bundle was built with, where that profile measured it on a bundle
    of the same precision (another precision's kernels scale differently with rows) and, for a graph with ragged rows,
    measured what a width costs alone (`BatchLatency.single`); None otherwise."""
    profile = engine.bundle.manifest.get("profile") or {}
    if not profile.get("measured") or (profile.get("engine") or {}).get("precision") != engine.bundle.precision:
        return None
    measurements = dict(profile.get("measurements") or {})
    if not engine.target.ragged:  # every row computed: what ragged calls cost does not apply
        measurements.pop("batch_single_ms", None)
    latency = BatchLatency.from_measurements(measurements)
    return None if latency is None or (engine.target.ragged and latency.single is None) else latency


def _seeded(seq: _Sequence) -> bool:
    """A request sampled with a seed: its tree stays whole, so that its tokens never depend on the batch."""
    return not seq.sampler.params.greedy and seq.sampler.params.seed is not None


def _message(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
