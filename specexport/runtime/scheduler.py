"""Many requests on one engine: continuous batching of speculative steps.

A front end (a server, a benchmark, a script with threads) `submit`s requests to a `Scheduler` and holds a
`Request` for each: it streams the request's text as steps accept it, waits for the result, or cancels it. The
scheduler runs one loop (its own thread, or `run_until_idle` called by the owner) whose every step is:

1. Requests cancelled since the last step stop (their slots are free for the next step).
2. Waiting requests are admitted while there are free slots (`max_batch` admitted at most, decoding or prefilling).
3. The admitted prompts are fed (`_prefill`; with the trees of step 4 in one call where the graph's attention takes
   each sequence's rows alone, `_mixed`): each its next chunk (at most `prefill_chunk` tokens), in the order
   they came, one prompt a step by default, or several in one call up to `prefill_tokens` prompt tokens a step; a
   long prompt holds the running streams back by a chunk a step, never by its whole length. A prompt's last chunk
   gives its first token. A prompt whose leading chunks an earlier prompt began with (the template's system prompt,
   a conversation's earlier turns) copies their rows, kept by that prompt, into its slot instead of computing them
   (runtime/prefix.py).
4. One target call verifies every running sequence's tree (`_decode`): trees -> cut -> verify -> accept -> commit.
   The drafting governor (runtime/governor.py) first decides whether the step drafts at all; where it does, each
   sequence proposes its tree with its own proposer and the governor cuts the trees to the rows worth their cost
   (runtime/budget.share). The trees are laid out in one call (runtime/batch.PaddedBatch: each in its slot's row,
   padded to the widest; a graph with ragged rows computes the real rows only, exporter/graph.py). Each sequence
   accepts its rows with its own sampling settings and random stream (a seeded request keeps its whole tree and
   gives the same tokens whatever else is in the batch), commits its path in its slot, and emits. A sequence running
   alone takes the engine's own step (Engine.step, governed by the same governor), as a batch-1 generation does.

The KV cache is a pool of slots (runtime/kvcache.KVPool) with the running sequences in a prefix, bound in place:
the batched call takes a view of the first n slots, no copy. A finished sequence's slot is refilled by moving the
last running one down (one copy of its rows); the prefilling requests sit right after the running ones, in order,
and join them as their prompts finish (a prompt never finishes before one that came earlier).

Each sequence's acceptance route is decided in one place (runtime/verify.Accepting.route): greedy sequences are
accepted by the graph's batched acceptance (exporter/fused.add_batch_accept: each sequence's accepted rows and bonus
token from its own rows; the call then brings back no logits when every sequence is greedy), or, where the graph has
none (plain decoding's chain-only graph, older bundles), on the host from one argmax over the call's rows. Sampled sequences accept on the host from their rows' logits (runtime/verify.accept), each with
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
from specexport.runtime import drafting, kernels, tree
from specexport.runtime.backends.layout import MARGIN
from specexport.runtime.batch import Entry, PaddedBatch
from specexport.runtime.budget import BatchLatency, grid
from specexport.runtime.drafting import DraftingProposer
from specexport.runtime.generate import (
    PREFILL_CHUNK,
    Engine,
    Output,
    Stats,
    StepRecord,
    chunk_logprobs,
    first_logprobs,
    pruned,
)
from specexport.runtime.governor import WHOLE, Governor, HostClock, Plan, profiled_latency
from specexport.runtime.request import Request
from specexport.runtime.sampling import Context, Sampler, SamplingParams
from specexport.runtime.verify import Acceptance, Route, accept, accept_greedy

MIXED_CHUNK = 128  # a prompt chunk beside the trees: the call's width (its tree masks are [B, W, W])
MIXED_PROMPT_TOKENS = 256  # the prompt tokens of a mixed step
WIDTHS_KEPT = 10_000  # target calls whose (sequences, width) the scheduler keeps (a server runs for weeks)


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
    pending_logprobs: list | None = None  # theirs, where asked
    fed: int = 0  # the prompt's chunks in its cache

    @property
    def scores_prompt(self) -> bool:
        """Whether its prompt's logprobs are asked: every chunk computed, every row's logits brought back."""
        return self.output.prompt_logprobs is not None

    @property
    def history(self) -> list[int]:
        return self.ids + self.output.tokens

    def context(self) -> Context | None:
        """What its next rows follow, where its sampling depends on it (runtime/sampling.conditioned)."""
        if not self.sampler.params.conditional:
            return None
        return Context(self.history, len(self.ids), self.output.stop_ids, self.sampler.grammar)

    @property
    def last(self) -> int:
        """history[-1], without building it."""
        return self.output.tokens[-1] if self.output.tokens else self.ids[-1]


class Scheduler:
    """Continuous batching on one engine (see the module docstring). `max_batch`: the most sequences admitted at
    once, decoding or prefilling (more requests wait their turn, never refused); `prefill_chunk`: the most tokens of
    one prompt in one call (None: PREFILL_CHUNK, MIXED_CHUNK where mixed); `prefill_tokens`: the most prompt tokens
    a step computes, several prompts' chunks in one call (None: one prompt's chunk a step: on a 2-core CPU, where a
    prompt's prefill is compute-bound, a bigger call costs as much per token and makes every prompt in it wait for
    the whole call: see `_prefill`; MIXED_PROMPT_TOKENS where mixed); `plain`: plain decoding instead of the bundle's
    method; `budget`: the drafting governor (runtime/governor.py: whether a step drafts, and the trees' width), else
    every tree as its proposer made it; `background`: run the loop in a thread of its own (else the owner calls
    `run_until_idle`); `mixed`: the prompts' chunks in the trees' call (`_mixed`; None: where the target graph's
    attention is specexport's own, which takes each sequence's rows alone)."""

    def __init__(self, engine: Engine, max_batch: int = 8, prefill_chunk: int | None = None, plain: bool = False,
                 budget: bool = True, background: bool = True, prefill_tokens: int | None = None,
                 mixed: bool | None = None):
        if max_batch < 1:
            raise UserError(f"max_batch must be >= 1, got {max_batch}")
        # prompts beside the trees in one call (`_mixed`), where the graph's attention takes each sequence alone
        # (not where a prompt's first token goes alone: int8 whose activations set the call's scale)
        self.mixed = kernels.ATTENTION_ROWS in getattr(engine.target, "info", {}).get("kernels", ()) \
            and not engine.first_token_alone if mixed is None else mixed
        prefill_chunk = (MIXED_CHUNK if self.mixed else PREFILL_CHUNK) if prefill_chunk is None else prefill_chunk
        if prefill_chunk < 1:
            raise UserError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        if prefill_tokens is not None and prefill_tokens < 1:
            raise UserError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        # (1: a step's first prompt's chunk only)
        self.prefill_tokens = prefill_tokens or (MIXED_PROMPT_TOKENS if self.mixed else 1)
        if not hasattr(engine.target, "new_pool"):
            raise UserError("batched generation runs on ONNX Runtime (--device cpu, cuda or cpu-iobinding) in this "
                            "version")
        self.engine, self.max_batch, self.prefill_chunk, self.plain = engine, max_batch, prefill_chunk, plain
        self.step_rows = 1 if plain else engine.method.tokens_per_step(engine.settings)
        self.accepting = engine.accepting  # what the graph accepts itself (runtime/verify.Accepting)
        self.pool = engine.target.new_pool(max_batch, engine.max_context + self.step_rows + MARGIN)  # backends/layout.py
        self.governor = None  # the drafting policy (runtime/governor.py); None: every tree whole
        if budget and self.step_rows > 1:
            widths = grid(self.step_rows)  # at 128 rows of context, or what the model's positions leave
            latency = profiled_latency(engine) or BatchLatency.measure(
                engine.target, self.pool, grid(max_batch), widths, min(128, engine.max_context - max(widths)))
            self.governor = Governor(self.step_rows, latency)
        self.clock = HostClock(engine)
        self.draft_pool = None  # the draft graph's caches, slot for slot with `pool` (made for the first proposer)
        self.draft_limit = self.step_rows + 1  # the widest draft call made with the others (runtime/drafting.py)
        self.widths: deque[tuple[int, int]] = deque(maxlen=WIDTHS_KEPT)  # (sequences, width) of the last calls
        self.on_step = None  # called with (sequences, width) after each target call (the scheduler's thread)
        self.running: list[_Sequence] = []  # decoding, slot k = index k
        self.prefilling: list[_Sequence] = []  # admitted, their prompts being fed; slots len(running)... in order
        self.waiting: deque[_Sequence] = deque()
        self._lock = threading.Condition()
        self._ids = 0
        self._closed = False
        self.prefill_calls = self.prefill_chunks = 0  # prompt chunks computed so far, and the calls they took
        self.mixed_calls = 0  # of those, the calls that verified trees too (`_mixed`)
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
               on_text=None, on_end=None, on_tokens=None, cancel=None, on_logprobs=None) -> Request:
        """Queue a generation; returns its handle at once. A bad request (an empty or too long prompt, a bad
        setting) raises UserError here and never enters the batch. `on_text(piece)` receives the text as it is
        accepted instead of `Request.stream`; `on_tokens(ids)` the token ids each step emitted (after their text);
        `on_logprobs(entries)` their logprobs (runtime/sampling.TokenLogprob), where the sampling asks for them;
        `on_end(request)` is called once the request has ended (all on the scheduler's thread: they must be quick
        and must not raise). `cancel`: a threading.Event or a callable returning True to stop, read by the scheduler
        before each step as `Request.cancel` is (a submitter whose cancellation comes from elsewhere, the C ABI's
        specexport_cancel, needs no thread of its own watching it)."""
        engine = self.engine
        ids, budget = engine.request(prompt, max_new_tokens, stop, chat)
        sampler = engine.sampler(sampling)
        proposer = engine.proposer(sampler, self.plain) if self.plain else \
            engine.method.proposer(engine, engine.settings, sampler)
        with self._lock:
            if self._closed:
                raise UserError("the scheduler is closed")
            self._ids += 1
            request = Request(self._ids, len(ids), on_end, on_tokens, cancel, on_logprobs)
            text = on_text if on_text is not None else request._text
            chunks = engine.prefill_chunks(ids, self.prefill_chunk)
            output = Output(engine.tokenizer, stop, stop_ids, max_new_tokens, budget, text, sampler.params)
            seq = _Sequence(request, ids, output, sampler, proposer, chunks, Stats(len(ids)),
                            len(ids) + budget + proposer.max_drafts)
            if seq.scores_prompt:
                output.prompt_logprobs.append(None)  # the first token follows nothing
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
        for seq in list(self.running) + list(self.prefilling) + list(self.waiting):
            seq.output.reason = seq.output.reason or "cancelled"
            self._end(seq)
        self.running, self.prefilling, self.waiting = [], [], deque()

    @property
    def alive(self) -> bool:
        """Whether steps run: the loop's thread is up (a scheduler without one runs when its owner calls it)."""
        return self._thread is None or self._thread.is_alive()

    @property
    def active(self) -> int:
        """Requests admitted or waiting."""
        return len(self.running) + len(self.prefilling) + len(self.waiting)

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
        seqs = self.running + self.prefilling
        self.running, self.prefilling = [], []
        self.pool.empty()
        if self.draft_pool is not None:
            self.draft_pool.empty()
        for seq in seqs:
            if not seq.request.done:
                self._end(seq, message)

    def step(self) -> bool:
        """One scheduler step (the module docstring); returns whether any request is left."""
        mark = self.clock.mark()
        self._drop_cancelled()
        self._admit()
        if self.prefilling and self.running and self.mixed:
            self._mixed()
        else:
            if self.prefilling:
                self._prefill()
            if self.running:
                self._decode()
        self.overhead_s += self.clock.since(mark)[0]
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
        for seq in [s for s in self.prefilling if s.request.cancelled]:
            seq.output.reason = "cancelled"
            self._unprefill(seq)

    def _admit(self) -> None:
        """Admit waiting requests while slots are free: each after the last admitted (runtime/kvcache.SlotPool)."""
        while True:
            with self._lock:
                if not self.waiting or len(self.running) + len(self.prefilling) >= self.max_batch:
                    return
                seq = self.waiting.popleft()
            seq.slot = len(self.running) + len(self.prefilling)
            self.pool.empty(seq.slot)
            self.engine.prefixes.asked(len(seq.ids))
            try:
                seq.proposer.start(len(seq.ids), seq.capacity, self._draft_cache(seq))
            except Exception as e:  # noqa: BLE001 - one request's failure ends that request only
                self._end(seq, error=_message(e))
                continue
            self.prefilling.append(seq)

    def _draft_cache(self, seq: _Sequence):
        """The slot of the draft pool for a proposer with a draft graph (the pool made for the first), else None."""
        proposer = seq.proposer
        if not isinstance(proposer, DraftingProposer):
            return None
        if self.draft_pool is None:
            capacity = self.pool.capacity + proposer.extra_rows + self.draft_limit  # the limit: a batched call's padding
            self.draft_pool = proposer.session.new_pool(self.max_batch, capacity)
        self.draft_pool.empty(seq.slot)
        return self.draft_pool.slot(seq.slot)

    def _prefill(self) -> None:
        """Feed the admitted prompts' next chunks, several in one call (runtime/batch.PaddedBatch over their slots),
        at most `prefill_tokens` tokens a step (the padded rows, where the graph computes them), in the order they
        came (`_chosen`). On a 2-core CPU (2026-12-04, 16 clients, int4) one prompt a step gave TTFT p50 ~0.2 s and
        p99 ~1.4-1.7 s, 512 tokens a step p99 ~1.6 s and p50 up to ~1 s (docs/benchmarks): hence the default of one
        prompt a step. The prompts that finish emit their first token."""
        chosen = self._chosen()
        if not chosen:
            return
        try:
            first = chosen[0].slot
            batch = PaddedBatch.lay_out(self.pool.lengths[first:first + len(chosen)], self._chunks(chosen, first))
            out = self._forward(self.pool.span(first, first + len(chosen)), batch, self._prefill_wants(chosen))
        except Exception as e:  # noqa: BLE001 - the call failed: every prompt in it fails with its message
            for seq in chosen:
                self._unprefill(seq, _message(e))
            return
        self._prefilled(chosen, [self._placed(seq, batch, out, self._prefill_wants([seq])) for seq in chosen])

    def _chosen(self) -> list[_Sequence]:
        """The prompts whose next chunks this step computes, in the order they came, at most `prefill_tokens` tokens.
        Chunks an earlier prompt kept are copied first (Engine.restore_kept). A prompt never finishes before one
        admitted earlier (the finished ones join the running slots in order, with no move), and on a bundle that
        feeds a prompt's first token alone (int8: its activations would set the call's quantization scale) first
        tokens go in calls of their own (every prompt's is the same token at position 0). A prompt whose next chunk
        ends a beginning being computed in this step (the same system prompt, say) waits a step and copies it then."""
        engine, chosen, tokens, behind, solo, computing = self.engine, [], 0, False, None, set()
        ragged, widest = engine.target.ragged, 0  # a graph without ragged rows computes every padded row
        for seq in list(self.prefilling):
            try:
                fed = seq.fed
                if not seq.scores_prompt:  # (a kept beginning's rows come without their logits)
                    seq.fed = engine.restore_kept(self.pool.slot(seq.slot), seq.chunks, seq.fed, seq.proposer,
                                                  fused=False)
                seq.stats.cached_tokens += sum(len(c) for c in seq.chunks[fed:seq.fed])
            except Exception as e:  # noqa: BLE001 - one request's failure ends that request only
                self._unprefill(seq, _message(e))
                continue
            size, alone = len(seq.chunks[seq.fed]), engine.first_token_alone and seq.fed == 0
            finishes = seq.fed + 1 == len(seq.chunks)
            beginning = tuple(tuple(c) for c in seq.chunks[:seq.fed + 1])
            widest = max(widest, size)
            rows = tokens + size if ragged else widest * (len(chosen) + 1)  # what the call computes
            if chosen and (rows > self.prefill_tokens or alone != solo or (behind and finishes)
                           or beginning in computing):
                break
            chosen.append(seq)
            computing.add(beginning)
            tokens, behind, solo = tokens + size, behind or not finishes, alone
        if chosen:
            self.prefill_calls, self.prefill_chunks = self.prefill_calls + 1, self.prefill_chunks + len(chosen)
        return chosen

    def _prefilled(self, chosen: list[_Sequence], outs: list[dict]) -> None:
        """After the call that computed `chosen`'s chunks (`outs`: each one's outputs): their rows in, their
        proposers told, the finished prompts' first tokens sampled and emitted as they join the running ones."""
        engine = self.engine
        for seq in chosen:  # every row in before any request leaves (a slot move copies committed rows)
            self.pool.slot(seq.slot).advance(len(seq.chunks[seq.fed]))
        for seq, out in zip(chosen, outs):
            try:
                engine.computed(self.pool.slot(seq.slot), seq.chunks, seq.fed, out, seq.proposer, fused=False)
                if seq.scores_prompt:
                    seq.output.prompt_logprobs.extend(chunk_logprobs(seq.chunks, seq.fed, out["logits"],
                                                                     seq.sampler.params.prompt_logprobs))
                seq.fed += 1
                if seq.fed == len(seq.chunks):
                    seq.pending = [seq.sampler(out["logits"][-1], seq.context())]
                    seq.pending_logprobs = first_logprobs(out["logits"][-1], seq.pending[0], seq.sampler.params)
            except Exception as e:  # noqa: BLE001
                self._unprefill(seq, _message(e))
        while self.prefilling and self.prefilling[0].pending:  # finished, in order: slot len(running) already
            seq = self.prefilling.pop(0)
            seq.stats.ttft_s = time.perf_counter() - seq.request.submitted
            self.running.append(seq)
            if self._emit(seq, seq.pending, seq.pending_logprobs):
                self._retire(seq)

    def _chunks(self, seqs: list[_Sequence], first: int) -> list[Entry]:
        """The entries of `seqs`' next chunks in a call over the slots from `first` on: the rows whose outputs come
        back are the last (all, where the prompt is scored)."""
        entries = []
        for seq in seqs:
            chunk, past = seq.chunks[seq.fed], self.pool.lengths[seq.slot]
            rows = list(range(len(chunk))) if seq.scores_prompt else [len(chunk) - 1]
            entries.append(Entry(seq.request.id, seq.slot - first, chunk, past + np.arange(len(chunk)),
                                 tree.causal_mask(len(chunk)), rows))
        return entries

    @staticmethod
    def _prefill_wants(seqs: list[_Sequence]) -> tuple[str, ...]:
        """What a prefill call brings back for `seqs`: the logits (the last row's gives the first token) and what
        their proposers read of the prompt's rows."""
        return ("logits",) + tuple(sorted({w for seq in seqs for w in seq.proposer.wants(False)}))

    def _forward(self, cache, batch: PaddedBatch, want: tuple[str, ...]) -> dict:
        return self.engine.target.forward(cache, batch.ids, batch.positions, batch.mask, batch.selected, want=want,
                                          live=batch.live)

    def _unprefill(self, seq: _Sequence, error: str | None = None) -> None:
        """A prefilling request leaves (cancelled, or failed with `error`): the ones after it move down a slot."""
        k = self.prefilling.index(seq)
        self.prefilling.pop(k)
        for later in self.prefilling[k:]:
            self._move(later, later.slot - 1)
        self._end(seq, error)

    def _decode(self) -> None:
        """One target call over every running sequence's tree, then each sequence's acceptance, commit and emission:
        trees -> cut -> verify -> accept -> commit. Sequences that end leave after every sequence has committed (a
        slot move copies committed rows only)."""
        if len(self.running) == 1 and not self.running[0].request.cancelled \
                and self.running[0].proposer.wants(True) == self.running[0].proposer.wants(False):
            return self._single_step(self.running[0])
        mark = self.clock.mark()
        plan, seqs, trees, leaving = self._trees()
        sampled_s = 0.0
        if seqs:
            out, batch, call = self._verify(seqs, trees)
            sampled_s = self._decoded(plan, seqs, trees, out, batch, call, leaving, mark)
        self._record(plan, mark, sampled_s, len(seqs) + len(leaving))
        for seq, error in leaving:
            self._retire(seq, error)

    def _mixed(self) -> None:
        """One target call over the running sequences' trees and the prompts' next chunks (`_chosen`) beside them:
        for a graph whose attention takes each sequence's rows alone (AttentionRows), where a chunk costs its own
        rows only. The running streams do not wait for a call of prompts, and the weights are read once."""
        chosen = self._chosen()
        if not chosen:
            return self._decode()
        mark = self.clock.mark()
        plan, seqs, trees, leaving = self._trees()
        n = len(self.running) + len(chosen)
        entries = self._tree_entries(seqs, trees) + self._chunks(chosen, 0)
        batch = PaddedBatch.lay_out(self.pool.lengths[:n], entries)
        finishing = [seq for seq in chosen if seq.fed + 1 == len(seq.chunks) or seq.scores_prompt]
        want = self._tree_wants(seqs) + self._prefill_wants(chosen)[1:]
        want += ("logits",) if finishing and "logits" not in want else ()  # a chunk's logits, where read
        before = self.engine.target.seconds
        out = self._forward(self.pool.rows(n), batch, tuple(dict.fromkeys(want)))
        self.mixed_calls += 1
        self._count_call(n, batch.width, batch.real_rows())
        outs = [self._placed(seq, batch, out, self._prefill_wants([seq]) if seq in finishing else
                             tuple(seq.proposer.wants(False))) for seq in chosen]
        call = (len(seqs), batch.width, self.engine.target.seconds - before, batch.real_rows())
        sampled_s = self._decoded(plan, seqs, trees, out, batch, call, leaving, mark, learn=False) if seqs else 0.0
        self._record(plan, mark, sampled_s, len(seqs) + len(leaving))
        self._prefilled(chosen, outs)  # (no slot moves before: the leaving ones retire last)
        for seq, error in leaving:
            self._retire(seq, error)

    def _trees(self) -> tuple[Plan, list[_Sequence], list, list]:
        """This step's plan, the running sequences that verify a tree and their trees (proposed, cut to the
        budget, made exact), and the ones leaving with their errors."""
        live = [seq for seq in self.running if not seq.request.cancelled]  # a cancelled one's row is padding
        plan = self._plan(live)
        proposals = self._propose(live) if plan.propose else [tree.DraftTree.root_only(s.last) for s in live]
        seqs, trees, leaving = [], [], []
        for seq, draft in zip(live, proposals):
            if isinstance(draft, Exception):  # one request's failure ends that request only
                leaving.append((seq, _message(draft)))
                continue
            room = self.pool.capacity - int(self.pool.lengths[seq.slot])
            trees.append(pruned(draft.truncated(min(room, self.step_rows)), seq.sampler))
            seqs.append(seq)
        if seqs and self.governor is not None and plan.propose:  # the budget shares the step's rows among the trees
            # seeded sampling keeps its tree: its tokens must not depend on the batch
            trees = self.governor.cut(plan, trees, [_seeded(s) for s in seqs],
                                      [not s.sampler.params.greedy for s in seqs])
        trees = [self.engine.exact(t, self.pool.slot(s.slot)) for s, t in zip(seqs, trees)]
        return plan, seqs, trees, leaving

    def _decoded(self, plan: Plan, seqs: list[_Sequence], trees: list, out: dict, batch: PaddedBatch, call: tuple,
                 leaving: list, mark, learn: bool = True) -> float:
        """After the call that verified `seqs`' trees: each one's acceptance, commit, proposer's news and emission
        (the ones that end join `leaving`); the governor learns the call's cost (`learn`: a call of trees alone).
        Returns the host's time accepting sampled rows."""
        verified = time.perf_counter()
        accepted, sampled_s = self._accept_all(seqs, trees, out, batch)
        if self.governor is not None and learn:
            fine = [(t, a.path) for t, a in zip(trees, accepted) if not isinstance(a, Exception)]
            self.governor.verified([t for t, _ in fine], [path for _, path in fine], *call)
        for seq, draft, acceptance in zip(seqs, trees, accepted):
            try:
                if isinstance(acceptance, Exception):
                    raise acceptance
                self.pool.slot(seq.slot).commit(acceptance.path)
                if plan.propose:
                    seq.proposer.accepted(acceptance.path)
                if mine := self._placed(seq, batch, out):
                    seq.proposer.observe(mine, acceptance.path)
            except Exception as e:  # noqa: BLE001
                leaving.append((seq, _message(e)))
                continue
            context = len(seq.ids) + len(seq.output.tokens)  # len(history), without building it
            seq.stats.record(StepRecord(draft, acceptance, context, 0.0, verified - mark[0],
                                        time.perf_counter() - mark[0]))
            if self._emit(seq, acceptance.tokens, acceptance.logprobs):
                leaving.append((seq, None))
        return sampled_s

    def _record(self, plan: Plan, mark, sampled_s: float, sequences: int) -> None:
        if self.governor is not None:  # the requests leaving (a slot move) are not the kind's cost
            host, _, side = self.clock.since(mark)
            self.governor.record(plan, host + side - sampled_s, max(sequences, 1))

    def _plan(self, seqs: list[_Sequence]) -> Plan:
        """Whether this step proposes (runtime/governor.Governor.decide): always without a governor."""
        if self.governor is None or not seqs:
            return WHOLE
        sampled = sum(not s.sampler.params.greedy for s in seqs)
        return self.governor.decide(len(seqs), sampled=sampled, seeded=any(_seeded(s) for s in seqs))

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
        try:
            record = self.engine.step(self.pool.slot(seq.slot), seq.history, seq.proposer, seq.sampler,
                                      self.governor, seq.context())
        except Exception as e:  # noqa: BLE001 - one request's failure ends that request only
            return self._retire(seq, _message(e))
        width = len(record.tree)
        self._count_call(1, width, width)
        seq.stats.record(record)
        if self._emit(seq, record.acceptance.tokens, record.acceptance.logprobs):
            self._retire(seq)

    def _verify(self, seqs: list[_Sequence], trees: list) -> tuple[dict, PaddedBatch, tuple]:
        """The batched target call over the running slots (runtime/batch.PaddedBatch: each tree in its slot's row,
        padded to the widest); returns the outputs, the layout (where each request's are: `_placed`) and the call's
        (sequences, width, seconds, real rows)."""
        n = len(self.running)
        batch = PaddedBatch.lay_out(self.pool.lengths[:n], self._tree_entries(seqs, trees))
        target = self.engine.target
        before = target.seconds
        out = self._forward(self.pool.rows(n), batch, self._tree_wants(seqs))
        computed = batch.real_rows() if target.ragged else n * batch.width
        self._count_call(n, batch.width, computed)
        return out, batch, (n, batch.width, target.seconds - before, batch.real_rows())

    def _tree_entries(self, seqs: list[_Sequence], trees: list) -> list[Entry]:
        lengths = self.pool.lengths
        return [Entry(seq.request.id, seq.slot, draft.tokens, lengths[seq.slot] + tree.depths(draft.parents),
                      tree.ancestor_mask(draft.parents), list(range(len(draft)))) for seq, draft in zip(seqs, trees)]

    def _tree_wants(self, seqs: list[_Sequence]) -> tuple[str, ...]:
        """What a verification brings back: the logits only for what the graph does not accept itself (sampled
        sequences, or every sequence where the graph has no batched acceptance), and what the proposers read."""
        routes = {self.accepting.route(seq.sampler.params, batched=True) for seq in seqs}
        return tuple(name for route in Route for name in route.outputs if route in routes) + \
            tuple(sorted({w for seq in seqs for w in seq.proposer.wants(False)}))

    def _placed(self, seq: _Sequence, batch: PaddedBatch, out: dict, names: tuple[str, ...] | None = None) -> dict:
        """What a sequence's proposer wants of a batched call's outputs (or `names`): per-row outputs by its rows,
        per-batch-row outputs by its slot."""
        names = seq.proposer.wants(False) if names is None else names
        return batch.placed(seq.request.id, out, names, self.engine.target.batch_outputs)

    def _accept_all(self, seqs: list[_Sequence], trees: list, out: dict, batch: PaddedBatch) -> tuple[list, float]:
        """Each sequence's acceptance (or the exception it raised), and the host's time accepting sampled rows, by
        the call's acceptance route (runtime/verify.Route): greedy ones from the graph's batched acceptance
        (exporter/fused.add_batch_accept) where it has one, else from one argmax over every row of the call; sampled
        ones on the host from their rows' logits, each with its own settings and random stream."""
        top = None
        if any(self.accepting.route(s.sampler.params, batched=True) is Route.HOST and s.sampler.params.greedy
               and not s.sampler.params.host_only for s in seqs):
            top = out["logits"].argmax(-1)  # one pass for the whole batch
        accepted, sampled_rows, began = [], 0, time.perf_counter()
        for seq, draft in zip(seqs, trees):
            entry, start = batch.entries[seq.request.id]
            try:
                if not seq.sampler.params.greedy or seq.sampler.params.host_only:  # (a logit bias: greedy, its own)
                    logits = self._placed(seq, batch, out, ("logits",))["logits"]
                    sampled_rows += len(draft)
                    accepted.append(accept(draft, logits, seq.sampler.params, seq.sampler.rng, seq.context()))
                elif top is not None and len(draft) == 1:  # a root alone (plain steps): accept_greedy's result
                    accepted.append(Acceptance([0], [int(top[start])]))
                elif top is not None:
                    accepted.append(accept_greedy(draft.tokens, draft.parents, top[start:start + len(draft)]))
                else:
                    path = np.flatnonzero(out["batch_accept_mask"][entry.b, :len(draft)]).tolist()
                    accepted.append(Acceptance(path, [draft.tokens[r] for r in path[1:]]
                                               + [int(out["batch_bonus"][entry.b])]))
            except Exception as e:  # noqa: BLE001 - one request's failure ends that request only
                accepted.append(e)
        seconds = time.perf_counter() - began if sampled_rows else 0.0  # the greedy ones' share: a lookup each
        if sampled_rows and self.governor is not None:
            self.governor.sampled_rows(seconds, sampled_rows)
        return accepted, seconds

    def _count_call(self, sequences: int, width: int, rows: int) -> None:
        self.steps, self.rows = self.steps + 1, self.rows + rows
        self.widths.append((sequences, width))
        if self.on_step is not None:
            self.on_step(sequences, width)

    @staticmethod
    def _emit(seq: _Sequence, tokens: list[int], scores=None) -> bool:
        """Emit a step's tokens (and their logprobs, where asked); True when the sequence ends. Their arrival is
        noted on the request."""
        before = len(seq.output.tokens)
        if seq.sampler.grammar is not None:
            seq.sampler.grammar.advance(tokens)
        ended = seq.output.emit(tokens, scores) is not None
        seq.request.arrivals.append((time.perf_counter(), len(seq.output.tokens) - before))
        if seq.request._on_tokens is not None:
            seq.request._on_tokens(seq.output.tokens[before:])
        if seq.request._on_logprobs is not None and seq.output.logprobs is not None:
            seq.request._on_logprobs(seq.output.logprobs[before:])
        return ended

    # -- leaving ----------------------------------------------------------------------------------
    def _retire(self, seq: _Sequence, error: str | None = None) -> None:
        """A running sequence leaves: the last running one moves into its slot, the prefilling ones down after it."""
        k = self.running.index(seq)
        last = self.running.pop()
        if last is not seq:
            self._move(last, k)
            self.running[k] = last
        for j, later in enumerate(self.prefilling):
            self._move(later, len(self.running) + j)
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


def _seeded(seq: _Sequence) -> bool:
    """A request sampled with a seed: its tree stays whole, so that its tokens never depend on the batch."""
    return not seq.sampler.params.greedy and seq.sampler.params.seed is not None


def _message(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__
