"""Continuous batching (runtime/scheduler.py) on tiny bundles: every request's tokens are its batch-1 tokens, whatever
else runs with it; slots are refilled, prompts prefilled in chunks, requests cancelled, failures kept to their
request; and the KV pool's slot bookkeeping on hand-built cases."""

import dataclasses
import threading
import time
from types import SimpleNamespace

import chisquare
import numpy as np
import pytest
from conftest import method_export
from helpers import check_prefix_copied

from specexport.errors import UserError
from specexport.exporter.export import ExportOptions, export_bundle
from specexport.exporter.graph import GraphOptions
from specexport.runtime.budget import AcceptanceRates, BatchLatency, share, worth_drafting
from specexport.runtime.generate import Engine
from specexport.runtime.governor import PLAIN_PROBE_STEPS, PROBE_STEPS, profiled_latency
from specexport.runtime.kvcache import KVPool
from specexport.runtime.prefix import PrefixStore
from specexport.runtime.sampling import SamplingParams
from specexport.runtime.scheduler import Scheduler
from specexport.runtime.tree import DraftTree

PROMPTS = ["hello there hello there hello", "the cat sat on the mat, the cat sat", "x", "abcabcabcabc",
           "a much longer prompt that takes several chunks to prefill, " * 2, "zz"]


@pytest.fixture(scope="module")
def engines(tiny_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("sched")

    def build(name, fused=True, **given):
        options = ExportOptions(graph=GraphOptions(fused_accept=fused), max_context=256, validate=False,
                                **method_export(name, **given))
        export_bundle(str(tiny_folder), root / name, options, quiet=True)
        return Engine.load(root / name, threads=1)

    return {"none": build("none"), "ngram": build("ngram", draft_length=4, max_matches=2),
            "self1-tree": build("draft", draft_model="self:1", draft_length=3, draft_branching=(2, 2))}


def batch_one(engine, prompts, lengths, **kw):
    return [engine.generate(p, max_new_tokens=n, stop_ids=(), **kw) for p, n in zip(prompts, lengths)]


@pytest.mark.parametrize("name, in_graph", [("none", False), ("ngram", True), ("ngram", False),
                                            ("self1-tree", True), ("self1-tree", False)])
def test_batched_greedy_equals_batch_one(engines, name, in_graph):
    """Six requests of different lengths on four slots, prompts fed 5 tokens per step: requests wait, finish at
    different steps, their slots are refilled by moves, and every request emits its batch-1 tokens; greedy steps
    accepted by the graph's batched acceptance (speculative graphs have it; plain decoding's chain-only graph has
    not), or on the host from one argmax over the call's rows."""
    engine = engines[name]
    lengths = [20, 7, 33, 12, 25, 3]
    draft_calls = lambda: sum(g.calls for g in engine.side_graphs())  # noqa: E731 - a draft model's graph
    before = draft_calls()
    want = batch_one(engine, PROMPTS, lengths, budget=False)
    alone = draft_calls() - before
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=5, background=False)
    assert scheduler.accepting.batched == (name != "none")
    scheduler.accepting = dataclasses.replace(scheduler.accepting, batched=in_graph)
    requests = [scheduler.submit(p, max_new_tokens=n, stop_ids=()) for p, n in zip(PROMPTS, lengths)]
    scheduler.run_until_idle()
    for request, expected in zip(requests, want):
        got = request.result(timeout=0)
        assert got.tokens == expected.tokens and got.stop_reason == expected.stop_reason
        assert got.text == expected.text
    assert scheduler.steps < sum(r.stats.steps for r in want)  # steps were shared
    assert scheduler.active == 0 and not scheduler.running
    if alone:  # the draft model's calls were made together (runtime/drafting.together)
        assert scheduler.draft_pool is not None and draft_calls() - before - alone < alone


@pytest.mark.parametrize("name", ["none", "ngram", "self1-tree"])
def test_a_logit_bias_in_a_batch_keeps_each_requests_tokens(engines, name):
    """Greedy requests with and without logit biases or penalties in one batch: those accept on the host from their
    own rows (their bias or penalties applied), the others by the graph's batched acceptance; each emits its batch-1
    tokens."""
    engine = engines[name]
    lengths = [20, 7, 33, 12]
    free = batch_one(engine, PROMPTS[:4], lengths, budget=False)
    params = [SamplingParams(logit_bias=((r.tokens[1], -100.0),)) if k % 2 else SamplingParams()
              for k, r in enumerate(free)]
    params[2] = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5)  # penalised by its own history
    want = [engine.generate(p, max_new_tokens=n, stop_ids=(), sampling=s, budget=False)
            for p, n, s in zip(PROMPTS, lengths, params)]
    assert want[1].tokens != free[1].tokens and want[0].tokens == free[0].tokens
    scheduler = Scheduler(engine, max_batch=4, background=False)
    requests = [scheduler.submit(p, max_new_tokens=n, stop_ids=(), sampling=s)
                for p, n, s in zip(PROMPTS, lengths, params)]
    scheduler.run_until_idle()
    assert [r.result(timeout=0).tokens for r in requests] == [w.tokens for w in want]


@pytest.mark.parametrize("name", ["none", "ngram", "self1-tree"])
def test_constrained_requests_in_a_batch_keep_their_batch_one_tokens(engines, name):
    """Requests under a JSON schema, a regex or a choice (greedy, and one seeded sample) batched with free ones, fed
    5 tokens a call: each emits its batch-1 tokens, its rows masked by its own grammar on their paths."""
    from conftest import constraint, follows

    engine = engines[name]
    prompts = ['{"a": "x", "b": true} and', "hello there hello", "abcabcabcabc", "the cat sat", "x"]
    params = [SamplingParams(constraint=constraint("json")), SamplingParams(),
              SamplingParams(constraint=constraint("regex")),
              SamplingParams(temperature=0.9, seed=4, constraint=constraint("choice")), SamplingParams()]
    want = [engine.generate(p, max_new_tokens=30, sampling=s, budget=False) for p, s in zip(prompts, params)]
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=5, background=False)
    requests = [scheduler.submit(p, max_new_tokens=30, sampling=s) for p, s in zip(prompts, params)]
    scheduler.run_until_idle()
    got = [r.result(timeout=0) for r in requests]
    assert [g.tokens for g in got] == [w.tokens for w in want]
    for g, kind in zip(got, ["json", None, "regex", "choice"]):
        if kind is not None and g.stop_reason == "eos":
            assert follows(kind, g.text)


@pytest.mark.parametrize("name", ["none", "ngram", "self1-tree"])
def test_logprobs_in_a_batch_are_each_requests_batch_one_logprobs(engines, name):
    """Requests asking for logprobs (greedy and seeded sampling) or their prompt's, batched with requests that ask
    for neither and fed 5 tokens a call: each gets its batch-1 tokens and logprobs. The scored prompt begins as an
    earlier one does, whose chunks are kept; it computes them again (kept rows come without their logits)."""
    engine = engines[name]
    shared = "the cat sat on the mat, the cat sat "
    prompts = [shared + "a", "hello there hello there hello", shared + "b", "abcabcabcabc"]
    params = [SamplingParams(), SamplingParams(logprobs=2), SamplingParams(logprobs=0, prompt_logprobs=1),
              SamplingParams(temperature=0.9, seed=5, logprobs=4)]
    lengths = [12, 20, 9, 16]
    want = [engine.generate(p, max_new_tokens=n, stop_ids=(), sampling=s, budget=False)
            for p, n, s in zip(prompts, lengths, params)]
    scheduler = Scheduler(engine, max_batch=4, prefill_chunk=5, background=False)
    streamed = []
    requests = [scheduler.submit(p, max_new_tokens=n, stop_ids=(), sampling=s,
                                 on_logprobs=streamed.extend if k == 3 else None)
                for k, (p, n, s) in enumerate(zip(prompts, lengths, params))]
    scheduler.run_until_idle()
    got = [r.result(timeout=0) for r in requests]
    assert [g.tokens for g in got] == [w.tokens for w in want]
    assert got[0].logprobs is None and got[0].prompt_logprobs is None
    for g, w in zip(got[1:], want[1:]):
        assert [x.token for x in g.logprobs] == g.tokens
        assert np.allclose([x.logprob for x in g.logprobs], [x.logprob for x in w.logprobs], atol=1e-4)
        assert [[i for i, _ in x.top] for x in g.logprobs] == [[i for i, _ in x.top] for x in w.logprobs]
    assert streamed == got[3].logprobs
    scored, alone = got[2].prompt_logprobs, want[2].prompt_logprobs
    assert scored[0] is None and [x.token for x in scored[1:]] == engine.encode(prompts[2])[1:]
    assert np.allclose([x.logprob for x in scored[1:]], [x.logprob for x in alone[1:]], atol=1e-4)
    assert got[2].stats.cached_tokens == 0
    again = scheduler.submit(prompts[2], max_new_tokens=2, stop_ids=())  # unscored: it copies the kept beginning
    scheduler.run_until_idle()
    assert again.result(timeout=0).stats.cached_tokens > 0


@pytest.mark.parametrize("name, device", [("none", "cpu"), ("ngram", "cpu"), ("self1-tree", "cpu"),
                                          ("ngram", "cpu-iobinding")])
def test_a_burst_prefills_several_prompts_in_one_call(engines, name, device):
    """Six requests at once, prompts in chunks of 5 tokens and up to 24 prompt tokens a step: several prompts' chunks
    go in one call (fewer calls than chunks), no step computes more than 24 rows (real rows in a graph with ragged
    rows, padded ones in plain decoding's chain-only graph), prompts join the running slots in the order they came,
    and every request emits its batch-1 tokens (whole trees both ways)."""
    engine = engines[name] if device == "cpu" else Engine.load(engines[name].bundle.path, threads=1, device=device)
    lengths = [20, 7, 33, 12, 25, 3]
    want = batch_one(engines[name], PROMPTS, lengths, budget=False)
    saved, engine.prefixes = engine.prefixes, PrefixStore.of(engine.tokenizer)  # nothing kept: every chunk computed
    scheduler = Scheduler(engine, max_batch=6, prefill_chunk=5, prefill_tokens=24, budget=False, background=False)
    calls, joined = [], []
    chosen = scheduler._chosen

    def counted():  # the prompt rows of each call that computes prompts
        seqs = chosen()
        sizes = [len(s.chunks[s.fed]) for s in seqs]
        if seqs:
            calls.append(sum(sizes) if engine.target.ragged else max(sizes) * len(seqs))
        return seqs

    scheduler._chosen = counted
    requests = [scheduler.submit(p, max_new_tokens=n, stop_ids=(), on_tokens=lambda ids, k=k: joined.append(k))
                for k, (p, n) in enumerate(zip(PROMPTS, lengths))]
    try:
        scheduler.run_until_idle()
    finally:
        engine.prefixes = saved
    assert [r.result(timeout=0).tokens for r in requests] == [w.tokens for w in want]
    assert list(dict.fromkeys(joined)) == sorted(set(joined))  # first tokens in the order the prompts came
    chunks = sum(len(engine.prefill_chunks(engine.encode(p), 5)) for p in PROMPTS)
    assert scheduler.prefill_chunks == chunks and scheduler.prefill_calls == len(calls) < chunks
    assert max(calls) <= 24


@pytest.mark.parametrize("name", ["none", "ngram", "self1-tree"])
def test_batched_on_the_device_path_equals_batch_one_on_the_host(engines, name):
    """The same bundle on ONNX Runtime's device path (I/O binding, run on the CPU: `cpu-iobinding`, the code CUDA
    runs): its KV pool on the device, bound by address, each slot's accepted rows compacted there and freed slots
    refilled there; six requests on four slots, budget on, give the host's batch-1 tokens; and a cancelled request
    leaves at the next step."""
    from specexport.runtime.backends.iobinding import DevicePool

    host = engines[name]
    lengths = [20, 7, 33, 12, 25, 3]
    want = batch_one(host, PROMPTS, lengths)
    device = Engine.load(host.bundle.path, threads=1, device="cpu-iobinding")
    scheduler = Scheduler(device, max_batch=4, prefill_chunk=5, background=False)
    assert isinstance(scheduler.pool, DevicePool)
    requests = [scheduler.submit(p, max_new_tokens=n, stop_ids=()) for p, n in zip(PROMPTS, lengths)]
    scheduler.run_until_idle()
    assert [r.result(timeout=0).tokens for r in requests] == [w.tokens for w in want]
    graphs = device.target.kv_graphs
    assert "slot_copy" in graphs  # a finished request's slot was refilled by a move on the device
    if name == "self1-tree":  # some accepted path was not a prefix (a branching tree): compacted on the device
        assert "pool_compact" in graphs
    cancelled, other = (scheduler.submit(p, max_new_tokens=30, stop_ids=()) for p in PROMPTS[:2])
    while len(scheduler.running) < 2:
        scheduler.step()
    cancelled.cancel()
    scheduler.step()
    assert cancelled.done and len(scheduler.running) == 1
    scheduler.run_until_idle()
    assert other.result().tokens == batch_one(host, PROMPTS[1:2], [30])[0].tokens


@pytest.mark.parametrize("name", ["none", "ngram", "self1-tree"])
def test_kept_prompt_beginning_gives_the_computed_tokens(engines, name):
    check_prefix_copied(engines[name])


@pytest.mark.parametrize("name", ["ngram", "self1-tree"])
def test_kept_prompt_beginning_on_the_device_path(engines, name):
    """The same on ONNX Runtime's device path (cpu-iobinding): the kept rows copied on the device."""
    check_prefix_copied(Engine.load(engines[name].bundle.path, threads=1, device="cpu-iobinding"))


def test_seeded_sampling_does_not_depend_on_the_batch(engines):
    engine = engines["self1-tree"]
    sampling = [SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=1.0, top_p=0.9, seed=3)]
    alone = [engine.generate(PROMPTS[k], max_new_tokens=24, stop_ids=(), sampling=s) for k, s in enumerate(sampling)]
    scheduler = Scheduler(engine, max_batch=3, background=False)
    mixed = [scheduler.submit(PROMPTS[3], max_new_tokens=30, stop_ids=()),  # a greedy neighbour
             *(scheduler.submit(PROMPTS[k], max_new_tokens=24, stop_ids=(), sampling=s) for k, s in enumerate(sampling))]
    scheduler.run_until_idle()
    assert [r.result().tokens for r in mixed[1:]] == [a.tokens for a in alone]


def test_cancel_frees_the_slot_at_the_next_step_and_the_others_go_on(engines):
    """Two ways to cancel: the handle's `cancel()`, and the submitter's own event given to `submit` (the C ABI's
    specexport_cancel): both stop at the next step with what was emitted, the third request goes on."""
    engine = engines["ngram"]
    want = batch_one(engine, PROMPTS[:3], [30, 30, 30])
    scheduler = Scheduler(engine, max_batch=3, prefill_chunk=64, background=False)
    own = threading.Event()
    requests = [scheduler.submit(p, max_new_tokens=30, stop_ids=(), cancel=own if k == 1 else None)
                for k, p in enumerate(PROMPTS[:3])]
    while len(scheduler.running) < 3:
        scheduler.step()
    scheduler.step()
    requests[0].cancel()
    own.set()
    scheduler.step()
    assert len(scheduler.running) == 1 and requests[0].done and requests[1].done
    for k in (0, 1):
        cancelled = requests[k].result()
        assert cancelled.stop_reason == "cancelled" and cancelled.tokens == want[k].tokens[:len(cancelled.tokens)]
        assert 0 < len(cancelled.tokens) < len(want[k].tokens)
    scheduler.run_until_idle()
    assert requests[2].result().tokens == want[2].tokens


def test_a_request_joining_mid_run_changes_no_one_else(engines):
    engine = engines["self1-tree"]
    want = batch_one(engine, PROMPTS[:2], [40, 40])
    scheduler = Scheduler(engine, max_batch=4, background=False)
    first = scheduler.submit(PROMPTS[0], max_new_tokens=40, stop_ids=())
    for _ in range(4):
        scheduler.step()
    late = scheduler.submit(PROMPTS[1], max_new_tokens=40, stop_ids=())
    scheduler.run_until_idle()
    assert first.result().tokens == want[0].tokens and late.result().tokens == want[1].tokens


def test_a_failing_proposer_fails_its_request_only(engines):
    engine = engines["ngram"]
    want = batch_one(engine, PROMPTS[:2], [16, 16])
    scheduler = Scheduler(engine, max_batch=3, background=False)
    good = scheduler.submit(PROMPTS[0], max_new_tokens=16, stop_ids=())
    bad = scheduler.submit(PROMPTS[2], max_new_tokens=16, stop_ids=())
    other = scheduler.submit(PROMPTS[1], max_new_tokens=16, stop_ids=())
    seq = next(s for s in scheduler.waiting if s.request is bad)

    def broken(history):
        raise RuntimeError("datastore unreadable")
    seq.proposer.propose = broken
    scheduler.run_until_idle()
    with pytest.raises(UserError, match="datastore unreadable"):
        bad.result()
    assert good.result().tokens == want[0].tokens and other.result().tokens == want[1].tokens


def test_bad_requests_are_refused_at_submit(engines):
    scheduler = Scheduler(engines["none"], max_batch=2, background=False)
    with pytest.raises(UserError, match="context limit"):
        scheduler.submit([5] * 300)
    with pytest.raises(UserError, match="empty"):
        scheduler.submit([])
    with pytest.raises(UserError, match="max_new_tokens"):
        scheduler.submit("hi", max_new_tokens=0)
    with pytest.raises(UserError, match="temperature"):
        scheduler.submit("hi", sampling=SamplingParams(temperature=-1))
    assert scheduler.active == 0


def test_the_background_loop_streams_text(engines):
    engine = engines["ngram"]
    want = batch_one(engine, PROMPTS[:4], [24] * 4)
    scheduler = Scheduler(engine, max_batch=2)
    try:
        requests = [scheduler.submit(p, max_new_tokens=24, stop_ids=()) for p in PROMPTS[:4]]
        texts = ["".join(r.stream(timeout=60)) for r in requests]
        assert texts == [w.text for w in want]
        assert [r.result(timeout=60).tokens for r in requests] == [w.tokens for w in want]
    finally:
        scheduler.close()


# ---- the KV pool, by hand --------------------------------------------------------------------------------------

def test_the_device_pool_moves_rows_and_slots_as_the_host_pool_does(engines):
    """A pool on the device path (cpu-iobinding) against a host KVPool holding the same random rows: a slot's
    non-prefix path compacted, a prefix path, a slot moved into another: the same committed rows after each."""
    device = Engine.load(engines["ngram"].bundle.path, threads=1, device="cpu-iobinding").target
    pool = device.new_pool(3, 16)
    g, slots, heads, capacity, width = pool.shape
    rows = np.random.default_rng(0).normal(size=pool.shape).astype(np.float32)
    pool.value.update_inplace(rows)
    host = KVPool(g // 2, slots, heads, capacity, width)
    for buf, layer in zip(host.buffers, rows):
        buf[:] = layer

    def same():  # every slot's committed rows (past them: what the last call left, never read)
        np.testing.assert_array_equal(pool.lengths, host.lengths)
        got, want = pool.value.numpy(), np.stack(host.buffers)
        for j, n in enumerate(host.lengths):
            np.testing.assert_array_equal(got[:, j, :, :n], want[:, j, :, :n])

    for p in (pool, host):
        p.lengths[:] = [4, 5, 7]
        p.slot(1).commit([0, 2, 3])  # rows 5, 7, 8 to 5, 6, 7 in slot 1 alone
        p.slot(2).commit([0, 1])  # a prefix: nothing moves
    same()
    assert list(pool.rows(3).past_lengths(3)) == [4, 8, 9] and pool.slot(1).length == 8
    for p in (pool, host):
        p.slot(0).commit([1, 5, 6, 9])
        p.move_slot(2, 0)
    same()
    with pytest.raises(ValueError, match="outside a pool"):
        pool.slot(3)


def test_device_caches_copy_rows_out_and_back_as_host_caches_do(engines):
    """runtime/prefix.py's row copies on the device path (cpu-iobinding): a pool slot's and a one-sequence cache's
    rows [start, start + n) of every layer taken out, and written back into another slot or cache at another offset,
    touching nothing else; a batch's view keeps none."""
    device = Engine.load(engines["ngram"].bundle.path, threads=1, device="cpu-iobinding").target
    pool = device.new_pool(3, 16)
    rows = np.random.default_rng(1).normal(size=pool.shape).astype(np.float32)
    pool.value.update_inplace(rows)
    host = KVPool(pool.shape[0] // 2, *pool.shape[1:])
    for buf, layer in zip(host.buffers, rows):
        buf[:] = layer
    assert pool.slot(1).keeps_rows and not pool.rows(2).keeps_rows and not host.rows(2).keeps_rows
    sizes = []
    for p in (pool, host):
        kept = p.slot(1).rows_at(3, 5)
        p.slot(2).put_rows(9, kept)
        p.slot(0).put_rows(0, kept)
        sizes.append(sum(r.nbytes for r in kept))
    assert sizes == [pool.shape[0] * pool.shape[2] * 5 * pool.shape[4] * 4] * 2  # what the store's budget counts
    kept = pool.slot(1).rows_at(3, 5)
    got, want = pool.value.numpy(), np.stack(host.buffers)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got[:, 2, :, 9:14], rows[:, 1, :, 3:8])
    np.testing.assert_array_equal(got[:, 1], rows[:, 1])  # the source slot as it was
    cache, other = device.new_cache(16), device.new_cache(16)
    cache.value.update_inplace(rows[:, :1])
    other.value.update_inplace(np.zeros(other.shape, np.float32))
    other.put_rows(4, cache.rows_at(2, 6))
    np.testing.assert_array_equal(other.value.numpy()[:, :, :, 4:10], rows[:, :1, :, 2:8])
    assert not other.value.numpy()[:, :, :, :4].any() and not other.value.numpy()[:, :, :, 10:].any()
    with pytest.raises(ValueError, match="outside a cache"):
        cache.rows_at(12, 5)
    with pytest.raises(ValueError, match="do not fit"):
        pool.slot(0).put_rows(14, kept)


def test_pool_views_share_the_buffers_and_keep_their_own_lengths():
    pool = KVPool(layers=1, slots=3, kv_heads=1, capacity=8, head_dim=1)
    for j in range(3):
        pool.buffers[0][j, 0, :, 0] = 10 * j + np.arange(8)
        pool.lengths[j] = j + 2
    rows = pool.rows(2)
    assert rows.batch == 2 and np.shares_memory(rows.buffers[0], pool.buffers[0])
    assert rows.past_lengths(2).tolist() == [2, 3] and pool.slot(2).length == 4
    pool.slot(1).commit([0, 2, 3])  # slot 1 keeps rows 3, 5, 6 after its 3 committed
    assert pool.lengths[1] == 6 and pool.buffers[0][1, 0, :6, 0].tolist() == [10, 11, 12, 13, 15, 16]
    pool.move_slot(2, 0)  # the last slot refills slot 0: its committed rows and length
    assert pool.lengths[0] == 4 and pool.buffers[0][0, 0, :4, 0].tolist() == [20, 21, 22, 23]
    assert pool.rows(2) is rows  # views are made once
    with pytest.raises(ValueError):
        pool.rows(4)


# ---- the batch's tree budget, by hand -------------------------------------------------------------------------

def chain(n: int, scores=None) -> DraftTree:
    return DraftTree(list(range(10, 10 + n)), [-1] + list(range(n - 1)), scores=scores)


def curves(rates: AcceptanceRates, sizes: list[int]) -> list[np.ndarray]:
    """The expected-token curves of unscored chains of these sizes."""
    return rates.curves([chain(n) for n in sizes])


def ragged(sequences, widths, seconds, width_s=0.0) -> BatchLatency:
    """A table for a graph with ragged rows: a call costs its real rows, and each width past the first `width_s`."""
    seconds = np.array(seconds, float).reshape(len(sequences), len(widths))
    single = seconds[:, :1] + width_s * (np.array(widths, float) - 1)
    return BatchLatency(sequences, widths, np.maximum(seconds, single), single)


def test_acceptance_rates_count_per_node_index():
    rates = AcceptanceRates(4)
    for path in ([0, 1, 2], [0, 1], [0]):
        rates.update([chain(4)], [path])
    # node 1 accepted 2 of 3, node 2 1 of 3, node 3 0 of 3 (Beta(1, 1) prior); the root always emits the bonus
    np.testing.assert_allclose(rates.expected(4), np.cumsum([1, 3 / 5, 2 / 5, 1 / 5]))


def test_the_trees_shrink_smoothly_as_sequences_are_added():
    rates, rng = AcceptanceRates(8), np.random.default_rng(0)
    for _ in range(400):  # a chain whose node i is accepted with probability 0.75^i
        depth = min(int(rng.geometric(0.25)) - 1, 7)
        rates.update([chain(8)], [list(range(depth + 1))])
    rows = lambda n, w: float(np.interp(n * w, [1, 8, 64, 128], [0.010, 0.014, 0.060, 0.115]))  # noqa: E731
    table = [[rows(n, w) for w in (1, 2, 4, 8)] for n in (1, 2, 4, 8, 16)]
    sizes = ([1, 2, 4, 8, 16], [1, 2, 4, 8])
    # a CPU-like call: its real rows computed (a width alone costing nothing, or 1 ms), or every tree padded
    for curve in (ragged(*sizes, table), ragged(*sizes, table, 0.001), BatchLatency(*sizes, table)):
        nodes = [share(curves(rates, [8] * n), curve, 0.001) for n in (1, 2, 4, 8, 16)]
        widths = [k.max() for k in nodes]
        assert widths[0] >= 6 and widths[-1] <= 3, nodes
        assert all(a >= b for a, b in zip(widths, widths[1:])), nodes  # never wider with more sequences
        assert all(k.max() - k.min() <= 1 for k in nodes), nodes  # alike trees: alike cuts
        if curve.single is None:
            assert all(len(set(k)) == 1 for k in nodes), nodes  # one width: every tree cut to it
    free = ragged([1, 16], [1, 16], [[0.01, 0.01], [0.01, 0.01]])  # rows cost nothing: every tree whole
    assert share(curves(rates, [8, 5, 3]), free, 0.0).tolist() == [8, 5, 3]
    hopeless = AcceptanceRates(8)
    for _ in range(100):
        hopeless.update([chain(8)], [[0]])
    curve = ragged(*sizes, table)
    assert share(curves(hopeless, [8] * 4), curve, 0.0).tolist() == [1] * 4  # nothing is ever accepted: plain decoding
    # a kept (seeded) tree of 6 stays whole; padded, its width is paid anyway: the others may use those rows
    assert share(curves(hopeless, [8, 8, 6]), curve, 0.0, kept=[False, False, True]).tolist() == [1, 1, 6]
    padded = BatchLatency(*sizes, table)
    assert share(curves(hopeless, [8, 8, 6]), padded, 0.0, kept=[False, False, True]).tolist() == [6, 6, 6]
    # sampled trees cost the host per row it accepts: the dearer, the fewer rows, only the sampled ones counted
    sampled = [share(curves(rates, [8] * 4), free, 0.0, row_s=cost, sampled=[True] * 4).sum()
               for cost in (0.0, 1e-3, 1e-2)]
    assert sampled[0] == 32 and sampled[0] > sampled[1] > sampled[2] == 4, sampled
    assert share(curves(rates, [8] * 4), free, 0.0, row_s=1e-2, sampled=[False] * 4).sum() == 32
    mixed = share(curves(rates, [8] * 4), free, 0.0, row_s=1e-2, sampled=[True, False] * 2)
    assert mixed.tolist() == [1, 8, 1, 8]  # the rows go where they cost no host time


def test_the_rows_go_to_the_likeliest_nodes_of_the_batch():
    """With ragged rows (the call costs its real rows) the budget shares the step's rows unevenly: nodes of confident
    drafts anywhere in the batch first; padded, every tree pays the widest's width, so it cuts them all to one."""
    fresh = AcceptanceRates(4)
    likely = DraftTree([9, 1, 2, 3], [-1, 0, 1, 2], scores=np.log([1.0, 0.95, 0.9, 0.85]).tolist())
    unlikely = DraftTree([9, 1, 2, 3], [-1, 0, 1, 0], scores=np.log([1.0, 0.12, 0.05, 0.04]).tolist())
    # 8 sequences, a row costs the call about a third of one sequence's token: only likely nodes pay
    sizes, table = ([1, 8], [1, 2, 4]), [[0.010, 0.013, 0.019], [0.010, 0.013, 0.019]]
    trees = [likely, unlikely] * 4
    real = share(fresh.curves(trees), ragged(*sizes, table), 0.0)
    assert real.tolist() == [4, 1] * 4, real
    padded = share(fresh.curves(trees), BatchLatency(*sizes, table), 0.0)
    assert len(set(padded.tolist())) == 1, padded  # one width: the unlikely trees pay the likely ones' rows
    tokens = lambda nodes: sum(c[k - 1] for c, k in zip(fresh.curves(trees), nodes))  # noqa: E731
    rate = lambda nodes, latency: tokens(nodes) / latency(8, nodes.max(), nodes.sum())  # noqa: E731
    assert rate(real, ragged(*sizes, table)) > rate(padded, BatchLatency(*sizes, table))  # ragged rows buy more
    # where a width costs much alone (attention runs on the padded rows), the likely trees stop short of it
    dear = ragged(*sizes, table, width_s=0.004)
    assert share(fresh.curves(trees), dear, 0.0).max() < 4
    assert share(fresh.curves(trees), ragged(*sizes, table, width_s=0.03), 0.0).tolist() == [1] * 8


def test_a_scored_tree_keeps_its_best_nodes_and_is_rated_by_its_calibrated_scores():
    """DraftTree.scores (a proposer's estimate of each node's acceptance, as a log): `truncated` keeps the best nodes,
    and the budget rates each node by its estimate, calibrated by what nodes of the same depth and half-octave did."""
    scored = DraftTree([9, 5, 6, 7], [-1, 0, 0, 2], scores=np.log([1.0, 0.3, 0.6, 0.5]).tolist())
    cut = scored.truncated(3)  # 6 (0.6) and 6 7 (0.5) beat 5 (0.3), whatever their index
    assert (cut.tokens, cut.parents) == ([9, 6, 7], [-1, 0, 1])
    np.testing.assert_allclose(np.exp(cut.scores), [1.0, 0.6, 0.5])
    assert scored.truncated(1).tokens == [9] and chain(4).truncated(2).tokens == [10, 11]  # unscored: the first nodes
    rates = AcceptanceRates(4)
    np.testing.assert_allclose(rates.curves([scored])[0], [1.0, 1.6, 2.1, 2.4])  # nothing seen yet: the estimates as given
    pair = DraftTree([9, 1, 2], [-1, 0, 0], scores=np.log([1.0, 0.9, 0.3]).tolist())
    for k in range(100):  # the node estimated at 0.9 accepted one time in ten, the one at 0.3 every other time
        rates.update([pair], [[0, 1] if k % 10 == 0 else [0, 2] if k % 2 else [0]])
    confident = rates.curves([DraftTree([9, 1], [-1, 0], scores=[0.0, np.log(0.9)])])[0]
    doubtful = rates.curves([DraftTree([9, 1], [-1, 0], scores=[0.0, np.log(0.3)])])[0]
    assert confident[1] - 1 == pytest.approx((10 + 2 * 0.9) / (100 + 2))  # the estimate counts as two nodes
    assert doubtful[1] - 1 == pytest.approx((50 + 2 * 0.3) / (100 + 2))
    assert rates.curves([DraftTree([9, 1], [-1, 0], scores=[0.0, np.log(0.05)])])[0][1] == pytest.approx(1.05)  # unseen
    deeper = rates.curves([DraftTree([9, 1, 2], [-1, 0, 1], scores=[0.0, np.log(0.9), np.log(0.9)])])[0]  # depth 2: unseen
    np.testing.assert_allclose(deeper, [1.0, 1 + 11.8 / 102, 1 + 11.8 / 102 + 0.9])
    # the same four sequences, a row dearer per sequence than one token in three: their drafts decide the width
    sizes, table = ([1, 4], [1, 2]), [[0.010, 0.013], [0.010, 0.013]]
    dear = ragged(*sizes, table)
    likely = DraftTree([9, 1], [-1, 0], scores=[0.0, np.log(0.95)])
    unlikely = DraftTree([9, 1], [-1, 0], scores=[0.0, np.log(0.12)])
    fresh = AcceptanceRates(2)
    assert share(fresh.curves([likely] * 4), dear, 0.0).tolist() == [2] * 4
    assert share(fresh.curves([unlikely] * 4), dear, 0.0).tolist() == [1] * 4
    assert share(fresh.curves([likely] * 2 + [unlikely] * 2), dear, 0.0).tolist() == [2, 2, 1, 1]
    assert share(fresh.curves([likely] * 2 + [unlikely] * 2), BatchLatency(*sizes, table), 0.0).tolist() == [2] * 4



def test_a_steps_trees_count_and_rate_at_once_as_one_by_one():
    """AcceptanceRates.update and .curves take a step's trees together (scored and unscored, of any size, roots alone
    among them): the same counts and curves as the trees taken one at a time."""
    rng = np.random.default_rng(1)
    drafts, paths = [], []
    for k in range(60):
        n = int(rng.integers(1, 7))
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
        scores = None if k % 3 == 0 else np.log(rng.uniform(0.01, 1.0, n)).tolist()
        drafts.append(DraftTree(list(range(n)), parents, scores=scores))
        path, node = [0], 0
        while (kids := [i for i in range(n) if parents[i] == node]) and rng.random() < 0.6:
            node = int(rng.choice(kids))
            path.append(node)
        paths.append(path)
    together, alone = AcceptanceRates(6), AcceptanceRates(6)
    for start in range(0, 60, 12):
        together.update(drafts[start:start + 12], paths[start:start + 12])
    for draft, path in zip(drafts, paths):
        alone.update([draft], [path])
    for mine, theirs in zip(together.counts(), alone.counts()):
        np.testing.assert_array_equal(mine, theirs)
    counted = [(d, p) for d, p in zip(drafts, paths) if len(d) > 1]  # a root alone tells nothing
    verified, accepted, scored_verified, scored_accepted = together.counts()
    np.testing.assert_array_equal(verified, [sum(len(d) > i for d, _ in counted) for i in range(6)])
    np.testing.assert_array_equal(accepted, [sum(i in p for _, p in counted) for i in range(6)])
    scored = [(d, p) for d, p in counted if d.scores is not None]
    assert scored_verified.sum() == sum(len(d) - 1 for d, _ in scored) > 0
    assert scored_accepted.sum() == sum(len(p) - 1 for _, p in scored) > 0
    for got, draft in zip(together.curves(drafts), drafts):
        np.testing.assert_allclose(got, together.curves([draft])[0])
        assert len(got) == len(draft) and got[0] == 1.0 and np.all(np.diff(got) >= 0)

def test_drafting_pays_only_where_its_cost_is_covered():
    """budget.worth_drafting: what the last proposing steps chose (tokens and rows per sequence, the call's width)
    against plain decoding, with the proposals' time and the host's acceptance of sampled rows counted."""
    flat = BatchLatency([1, 8], [1, 4], [[0.01, 0.012], [0.02, 0.024]])
    assert worth_drafting(8, 1.5, 2.0, 2.0, flat, 0.001, 0.002)
    assert not worth_drafting(8, 1.5, 2.0, 2.0, flat, 0.001, 0.1)  # proposals dearer than the tokens they bring
    assert not worth_drafting(8, 1.0, 1.0, 1.0, flat, 0.001, 0.0)  # the last steps kept no draft: nothing to gain
    assert worth_drafting(8, 1.5, 2.0, 2.0, flat, 0.001, 0.002, row_s=1e-4, sampled=8)
    assert not worth_drafting(8, 1.5, 2.0, 2.0, flat, 0.001, 0.002, row_s=5e-3, sampled=8)  # sampled rows are dear
    # ragged rows: 1.3 real rows a sequence, padded to 4, pay where the width alone is cheap, not where it is dear
    cheap = ragged([1, 8], [1, 4], [[0.01, 0.03], [0.02, 0.08]], width_s=0.0005)
    assert worth_drafting(8, 1.4, 1.3, 4.0, cheap, 0.001, 0.0005)
    dear = ragged([1, 8], [1, 4], [[0.01, 0.03], [0.02, 0.08]], width_s=0.003)
    assert not worth_drafting(8, 1.4, 1.3, 4.0, dear, 0.001, 0.0005)


def test_a_ragged_call_costs_its_width_and_its_real_rows():
    """A graph with ragged rows computes the real rows, but attention runs on the padded width: a call of R real rows
    at width W costs the width alone (one real row a sequence) plus its share of the rest, linearly. Calls measured
    dearer than that teach the points of their width, while one-row calls keep the one-row point."""
    table = BatchLatency([1, 4], [1, 2, 4], [[0.01, 0.012, 0.02], [0.02, 0.024, 0.04]],
                         [[0.01, 0.011, 0.012], [0.02, 0.022, 0.025]])
    assert table(4, 1, 4) == pytest.approx(0.02) and table(4, 2, 8) == pytest.approx(0.024)
    assert table(4, 2, 4) == pytest.approx(0.022)  # one real row a sequence: the width alone
    assert table(4, 2, 6) == pytest.approx(0.023)  # half the padding computed
    assert table(4, 4, 10) == pytest.approx(0.025 + 0.015 * 6 / 12)
    assert table(4, 3, 5) == pytest.approx(0.0235 + (0.032 - 0.0235) / 8)  # between the widths: both grids
    assert table(4, 2) == pytest.approx(0.024)  # rows not given: every row
    assert BatchLatency([1, 4], [1, 2], [[0.01, 0.012], [0.02, 0.024]])(4, 2, 5) == pytest.approx(0.024)  # padded
    np.testing.assert_allclose(table(4, np.array([2, 4]), np.array([4, 16])), [0.022, 0.04])
    for _ in range(200):
        table.observe(4, 1, 0.02, 4)  # one row a sequence: as measured
        table.observe(4, 2, 0.03, 5)  # the table says 0.0225
    assert table(4, 1, 4) == pytest.approx(0.02, rel=0.02)
    assert table(4, 2, 5) == pytest.approx(0.03, rel=0.03)
    assert table(1, 1, 1) == pytest.approx(0.01, rel=0.02)


def test_the_latency_table_learns_the_same_from_calls_read_at_once_or_one_by_one():
    """BatchLatency.observe learns from a few calls at a time, or when the table is read: every read sees every call
    before it, and the table ends as if each call had been learned from when it came."""
    rng = np.random.default_rng(5)
    calls = [(int(n), int(w), float(rng.uniform(0.005, 0.08)), int(n) * int(rng.integers(1, w + 1)))
             for n, w in zip(rng.choice([1, 2, 3, 4], 70), rng.choice([1, 2, 3, 4], 70))]
    def fresh() -> BatchLatency:
        return ragged([1, 4], [1, 2, 4], [[0.01, 0.012, 0.02], [0.02, 0.024, 0.04]], 0.001)

    later, at_once = fresh(), fresh()
    for k, call in enumerate(calls):
        later.observe(*call)
        at_once.observe(*call)
        read = at_once(*call[:2], call[3])  # a read learns from what was observed
        if k % 9 == 0:
            assert later(*call[:2], call[3]) == read
    assert later.as_ms() == at_once.as_ms() and later.as_ms(single=True) == at_once.as_ms(single=True)
    np.testing.assert_array_equal(later.priced[0], at_once.priced[0])
    assert later.as_ms() != fresh().as_ms()


def test_the_latency_table_interpolates_and_follows_the_calls_it_sees():
    table = BatchLatency([1, 4], [1, 8], [[0.01, 0.02], [0.02, 0.06]])
    assert table(1, 1) == pytest.approx(0.01) and table(4, 8) == pytest.approx(0.06)
    assert table(2, 1) == pytest.approx(0.01 + 0.01 / 3)  # bilinear between the grid's points
    assert table(4, 4) == pytest.approx(0.02 + 0.04 * 3 / 7)
    assert table(8, 8) == pytest.approx(0.06 + 4 * (0.06 - 0.02) / 3)  # more sequences than the grid: linear
    for _ in range(300):  # calls of one size take 1.5x what was measured: every size scales alike
        table.observe(4, 8, 0.09)
    assert table(4, 8) == pytest.approx(0.09, rel=1e-3) and table(1, 1) == pytest.approx(0.015, rel=1e-3)
    # one row a sequence costs as measured, a second one more than measured (1.75x one row, not 1.35x): a few calls
    # of each and the table has their ratio, which decides the budget's width; far from the calls, as measured
    table = BatchLatency([1, 16], [1, 2], [[0.010, 0.012], [0.036, 0.048]])
    for k in range(80):
        table.observe(16, 1, 0.033)
        if k % 4 == 0:
            table.observe(16, 2, 0.033 * 1.75)
    assert table(16, 1) == pytest.approx(0.033, rel=0.02)
    assert table(16, 2) / table(16, 1) == pytest.approx(1.75, rel=0.02)
    assert table(1, 2) / table(1, 1) == pytest.approx(1.2, rel=1e-6)
    for _ in range(3000):  # no wider call since: the learned ratio fades back towards the table's (to try it again)
        table.observe(16, 1, 0.033)
    assert table(16, 2) / table(16, 1) < 1.45
    ms = {"batch_sequences": [1, 4], "batch_widths": [1, 8], "batch_ms": [[10.0, 20.0], [20.0, 60.0]]}
    assert BatchLatency.from_measurements(ms)(4, 8) == pytest.approx(0.06)
    assert BatchLatency.from_measurements({**ms, "batch_ms": [[10.0, 20.0]]}) is None  # malformed: measure instead
    assert BatchLatency.from_measurements({}) is None


def test_the_scheduler_measures_the_batched_call_or_reads_the_profiles_table(engines):
    engine = engines["self1-tree"]
    full = engine.method.tokens_per_step(engine.settings)
    measured = Scheduler(engine, max_batch=4, background=False).governor.latency  # this bundle's profile has no table
    assert list(measured.sequences) == [1, 2, 4] and measured.widths[-1] == full
    assert measured.seconds.shape == (3, len(measured.widths)) and (measured.seconds > 0).all()
    assert engine.target.ragged and measured.single.shape == measured.seconds.shape and (measured.single > 0).all()
    manifest, saved = engine.bundle.manifest, engine.bundle.manifest.get("profile")
    table = {"batch_sequences": [1, 8], "batch_widths": [1, 4], "batch_ms": [[5.0, 6.0], [9.0, 30.0]],
             "batch_single_ms": [[5.0, 5.5], [9.0, 12.0]]}
    try:
        manifest["profile"] = {"measured": True, "engine": {"precision": engine.bundle.precision},
                               "measurements": table}
        latency = Scheduler(engine, max_batch=4, background=False).governor.latency
        assert latency(8, 4) == pytest.approx(0.030) and latency(8, 4, 8) == pytest.approx(0.012)
        del table["batch_single_ms"]  # measured without ragged rows' cost of a width alone: this graph's own
        assert list(Scheduler(engine, max_batch=4, background=False).governor.latency.sequences) == [1, 2, 4]
        manifest["profile"]["engine"] = {"precision": "int4" if engine.bundle.precision != "int4" else "int8"}
        assert list(Scheduler(engine, max_batch=4, background=False).governor.latency.sequences) == [1, 2, 4]  # not its own
    finally:
        manifest["profile"] = saved


def test_a_profiles_table_counts_only_for_the_int4_kernel_it_measured():
    """A batched table measured on int4 in one kernel (MatMulNBits, or ours: `int4_kernel = "rows4"`) is not read
    for a bundle in the other: their extra rows cost otherwise, so the scheduler measures its own."""
    table = {"batch_sequences": [1, 8], "batch_widths": [1, 4], "batch_ms": [[5.0, 6.0], [9.0, 30.0]],
             "batch_single_ms": [[5.0, 5.5], [9.0, 12.0]]}

    def engine(int4_kernel: str, graph_kernels: list):
        manifest = {"profile": {"measured": True, "engine": {"precision": "int4", "int4_kernel": int4_kernel},
                                "measurements": table},
                    "graphs": {"target": {"kernels": graph_kernels} if graph_kernels else {}}}
        return SimpleNamespace(bundle=SimpleNamespace(manifest=manifest, precision="int4"),
                               target=SimpleNamespace(ragged=True))

    assert profiled_latency(engine("rows4", ["rows4"]))(8, 4) == pytest.approx(0.030)
    assert profiled_latency(engine("", []))(8, 4) == pytest.approx(0.030)
    assert profiled_latency(engine("rows4", [])) is None and profiled_latency(engine("", ["rows4"])) is None


def test_the_budget_cuts_trees_under_load_and_a_fixed_tree_does_not(engines):
    engine = engines["self1-tree"]
    full = engine.method.tokens_per_step(engine.settings)
    fixed = Scheduler(engine, max_batch=4, budget=False, background=False)
    for p in PROMPTS[:4]:
        fixed.submit(p, max_new_tokens=12, stop_ids=())
    fixed.run_until_idle()
    assert max(w for _, w in fixed.widths) == full
    budget = Scheduler(engine, max_batch=4, background=False)
    budget.governor.latency = BatchLatency([1, 4], [1, full], [[0.001, 0.25], [0.004, 1.0]])  # rows are dear: trees shrink
    for p, n in zip(PROMPTS[:4], [12, 12, 12, 30]):  # the last one runs alone at the end
        budget.submit(p, max_new_tokens=n, stop_ids=())
    budget.run_until_idle()
    crowded = [w for n, w in budget.widths if n == 4]
    assert crowded and max(crowded) < full
    assert max(w for n, w in budget.widths if n == 1) < full  # alone, a sequence is governed by the same table


def test_a_budget_that_stopped_drafting_proposes_again(engines):
    """A proposing step's cost measured in a slow moment (here 10 s) stops drafting; one step in PROBE_STEPS (the
    governor counts every step, one sequence's alone too) proposes anyway and its cost replaces the stale average."""
    engine = engines["self1-tree"]
    full = engine.method.tokens_per_step(engine.settings)
    scheduler = Scheduler(engine, max_batch=2, background=False)
    scheduler.governor.latency = BatchLatency([1, 2], [1, full], [[0.01, 0.01], [0.02, 0.02]])  # rows are free
    scheduler.governor.cost[True] = 10.0
    for p in PROMPTS[:2]:
        scheduler.submit(p, max_new_tokens=PROBE_STEPS + 20, stop_ids=())
    scheduler.run_until_idle()
    steps = [w for _, w in scheduler.widths]
    assert steps[:PROBE_STEPS] == [1] * PROBE_STEPS  # no proposals while they seemed to cost 10 s
    assert steps[PROBE_STEPS] > 1 and scheduler.governor.cost[True] < 1.0  # the probe: measured afresh


def test_a_budget_that_drafts_verifies_the_roots_alone_now_and_then(engines, monkeypatch):
    """While drafting pays, one batched step in PLAIN_PROBE_STEPS verifies the roots alone: a plain step's cost (and
    the one-row call's) stays measured at the load of the moment. The requests keep their batch-1 tokens."""
    from specexport.runtime import governor as module

    monkeypatch.setattr(module, "worth_drafting", lambda *_, **__: True)
    monkeypatch.setattr(module, "share", lambda curves, *_, **__: np.array([len(c) for c in curves]))  # whole trees
    engine = engines["self1-tree"]
    want = batch_one(engine, PROMPTS[:2], [90, 90])
    scheduler = Scheduler(engine, max_batch=2, background=False, prefill_tokens=4096)  # both prompts in one step
    requests = [scheduler.submit(p, max_new_tokens=90, stop_ids=()) for p in PROMPTS[:2]]
    scheduler.run_until_idle()
    assert [r.result().tokens for r in requests] == [w.tokens for w in want]
    both = [w for n, w in scheduler.widths if n == 2]  # (they run together from the first step)
    period = PLAIN_PROBE_STEPS + 1  # the first step proposes (no cost known yet), then each kind in turn
    assert len(both) > period and [k for k, w in enumerate(both) if w == 1] == list(range(period - 1, len(both), period))
    assert scheduler.governor.cost[False] is not None and scheduler.governor.cost[True] is not None


@pytest.mark.parametrize("params", [{"temperature": 0.5, "top_p": 0.9}, {"temperature": 0.5},
                                    {"temperature": 0.8, "min_p": 0.1, "logit_bias": ((5, 1.5),)},
                                    {"temperature": 0.5, "repetition_penalty": 1.6, "presence_penalty": 0.8}])
def test_batched_sampling_follows_plain_sampling(engines, params, monkeypatch):
    """1500 unseeded sampled requests through the batched engine, their trees cut by a budget that finds rows dear:
    the same distribution as plain sampling (two-sample chi-square at a 1e-4 tail). The host's acceptance of sampled
    rows is left out of the budget, and so are the measured host and proposal times: against this table's 1-2 ms
    calls a slow moment on a shared machine would stop drafting (the budget's decisions follow the table alone, which
    does not learn from the calls here)."""
    from specexport.runtime import governor as module

    monkeypatch.setattr(module, "share", lambda curves, latency, host_s, kept, **_: share(curves, latency, 0.0, kept))
    monkeypatch.setattr(module, "worth_drafting", lambda n, tokens, rows, width, latency, host_s, draft_s, **_:
                        worth_drafting(n, tokens, rows, width, latency, 0.0, 0.0))
    engine = engines["self1-tree"]
    scheduler = Scheduler(engine, max_batch=8, background=False)
    full = engine.method.tokens_per_step(engine.settings)
    # three rows per sequence cost no more than one, more are dear: trees cut to about three nodes; the table stays
    # as given (the calls it would learn from take ~0.1 ms here, a wider one relatively dearer: drafting would stop)
    scheduler.governor.latency = BatchLatency([1, 8], [1, 3, full], [[0.001, 0.001, 0.002], [0.002, 0.002, 0.05]])
    monkeypatch.setattr(scheduler.governor.latency, "observe", lambda *_: None)
    spec, lengths = chisquare.sampled_counts(engine, "the cat", False, 2000, 0, 3, scheduler, **params)
    plain = chisquare.sampled_counts(engine, "the cat", True, 2000, 100_000, 3, **params)[0]
    stat, dof = chisquare.two_sample(spec, plain)
    assert dof >= 3 and stat < chisquare.threshold(dof), (stat, dof)
    assert max(lengths) > 1 and min(w for _, w in scheduler.widths) < full  # drafts were accepted; trees were cut


@pytest.mark.parametrize("name", ["ngram", "self1-tree"])
def test_requests_that_reach_the_context_limit(engines, name):
    """Three requests that run into the bundle's context limit (256) together: each stops there ("context") with its
    batch-1 tokens; the trees and the padding near the end stay inside the graphs' position tables."""
    engine = engines[name]
    prompts = ["abc " * 58, "the cat sat " * 19, "x y " * 40]
    want = batch_one(engine, prompts, [100] * 3)
    assert {w.stop_reason for w in want} == {"context"}
    scheduler = Scheduler(engine, max_batch=3, background=False)
    requests = [scheduler.submit(p, max_new_tokens=100, stop_ids=()) for p in prompts]
    scheduler.run_until_idle()
    assert [r.result(timeout=0).tokens for r in requests] == [w.tokens for w in want]



def slow(update, seconds: float):
    """AcceptanceRates.update, `seconds` slower for a batched step whose trees hold drafts."""
    def counting(drafts, paths):
        if len(drafts) > 1 and any(len(d) > 1 for d in drafts):
            time.sleep(seconds)
        update(drafts, paths)
    return counting


@pytest.mark.parametrize("name", ["self1-tree", "ngram"])
def test_steps_skip_proposals_that_do_not_pay(engines, name):
    """With proposals far dearer than the rows they would save (runtime/budget.worth_drafting), batched steps verify
    each root alone and no proposer runs; a sequence left alone drafts again (its proposer picks up the steps it
    skipped) and every request keeps its batch-1 tokens. Cheap proposals are made, unless the proposing steps' own
    host time is dear (here counting its verified trees takes 1 s: after the first step, no more proposals)."""
    engine = engines[name]
    lengths = [10, 12, 40]
    want = batch_one(engine, PROMPTS[:3], lengths)
    full = engine.method.tokens_per_step(engine.settings)
    for propose_s, counting_s, drafts in ((1.0, 0.0, False), (0.0, 0.0, True), (0.0, 1.0, None)):
        scheduler = Scheduler(engine, max_batch=3, background=False)
        scheduler.governor.latency = BatchLatency([1, 3], [1, full], [[0.001, 0.0011], [0.003, 0.0033]])  # rows are cheap
        scheduler.governor.cost[True] = propose_s
        scheduler.governor.rates.update = slow(scheduler.governor.rates.update, counting_s)
        requests = [scheduler.submit(p, max_new_tokens=n, stop_ids=()) for p, n in zip(PROMPTS[:3], lengths)]
        scheduler.run_until_idle()
        assert [r.result().tokens for r in requests] == [w.tokens for w in want]
        batched = [w for n, w in scheduler.widths if n > 1]
        drafted = [w for w in batched if w > 1]
        assert batched and (len(drafted) == 1 if counting_s else bool(drafted) == drafts)  # dear: the first, no more
        assert max(w for n, w in scheduler.widths if n == 1) > 1  # alone, it drafts
