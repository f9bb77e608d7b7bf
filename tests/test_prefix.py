"""Prompts' kept beginnings (runtime/prefix.py): where prompts are cut, chunks kept and put back on hand-built caches
by all the chunks before them, forgotten within the budget; on the real SmolLM2 (fp32): a prompt whose beginning was
copied (the template's system prompt; a service's own and a conversation's earlier turns) gets the rows, logits and
tokens that computing it gives, batch 1 and batched, in fewer target calls."""

import numpy as np
import pytest

from specexport.runtime.generate import Engine
from specexport.runtime.kvcache import KVCache
from specexport.runtime.prefix import PrefixStore
from specexport.runtime.scheduler import Scheduler


def test_prompts_are_cut_where_a_message_ends():
    store = PrefixStore((8, 9), min_part=3)
    assert store.split([1, 2, 8, 9, 3, 4, 5, 8, 9, 6]) == [4, 9]
    assert store.split([8, 9, 3, 4, 8, 9, 6]) == [6]  # [8, 9] is too short a part: merged into the next
    assert store.split([1, 2, 3, 8, 9]) == []  # never at the prompt's end: nothing would follow
    assert store.split([1, 2, 3, 8, 4, 9]) == [] and store.split([9, 8, 1, 2, 3]) == []
    assert PrefixStore(()).split([1, 8, 9, 2]) == []  # no template end: one part
    assert PrefixStore((8,), min_part=1).split([8, 8, 8]) == [1, 2]
    # not where the assistant's reply (4) follows: a question and its answer are one part
    assert PrefixStore((8, 9), (4,), min_part=3).split([1, 2, 8, 9, 3, 4, 5, 8, 9, 4, 6, 8, 9, 7]) == [4, 13]


def _filled(seed: int, batch: int = 1, length: int = 0) -> KVCache:
    cache = KVCache(layers=2, batch=batch, kv_heads=2, capacity=16, head_dim=4)
    rng = np.random.default_rng(seed)
    for buf in cache.buffers:
        buf[:] = rng.normal(size=buf.shape)
    cache.advance(length)
    return cache


def _empty() -> KVCache:
    return KVCache(layers=2, batch=1, kv_heads=2, capacity=16, head_dim=4)


def test_kept_chunks_are_put_back_after_the_same_chunks_only():
    store = PrefixStore()
    source = _filled(0, length=1)
    store.keep(source, [[5]], {})
    source.advance(2)
    store.keep(source, [[5], [6, 7]], {})
    target = _empty()
    assert store.restore(target, [[5]]) == [{}] and target.length == 1
    assert store.restore(target, [[5], [6, 7]]) == [{}] and target.length == 3  # after the chunk it holds
    for kept, put in zip(source.buffers, target.buffers):
        np.testing.assert_array_equal(put[:, :, :3], kept[:, :, :3])
        assert not put[:, :, 3:].any()  # nothing past what was kept
    assert store.restore(target, [[5], [6, 7], [8]]) == [] and target.length == 3  # never kept
    both = _empty()  # every kept chunk at once, up to the first not kept
    assert store.restore(both, [[5], [6, 7], [8], [9]]) == [{}, {}] and both.length == 3
    for kept, put in zip(source.buffers, both.buffers):
        np.testing.assert_array_equal(put[:, :, :3], kept[:, :, :3])
    assert store.restore(both, [[5], [6, 7]]) == [] and both.length == 3  # it holds them all
    other = _empty()
    assert store.restore(other, [[5, 6]]) == [] and other.length == 0  # another chunking keeps its own chunks
    assert store.restore(other, [[6]]) == []  # a kept chunk's tokens after other rows are another chunk
    assert store.restore(other, [[5]], ("features",)) == [] and other.length == 0  # no outputs kept for this reader
    assert store.restore(_filled(7, length=2), [[5], [6, 7]]) == []  # the cache ends inside a chunk
    assert store.restore(_filled(7, length=1), [[5], [6, 7]]) == [{}]  # it holds the first: the next copied
    # the same last chunk after another chunking of the rows before it is another chunk: its rows differ
    split = PrefixStore()
    cache = _filled(3, length=2)
    split.keep(cache, [[5, 6]], {})
    cache.advance(2)
    split.keep(cache, [[5, 6], [7, 8]], {})
    assert split.restore(_filled(4, length=2), [[5], [6], [7, 8]]) == []
    assert split.restore(_filled(4, length=2), [[5, 6], [7, 8]]) == [{}]
    assert split.restore(_filled(4, length=2), [[5, 9], [7, 8]]) == []  # other tokens before it
    orphan = PrefixStore()
    orphan.keep(_filled(5, length=3), [[5], [6, 7]], {})  # the chunks before it were never kept: neither is it
    assert orphan.restore(_filled(6, length=1), [[5], [6, 7]]) == [] and orphan.nbytes == 0
    keeper = PrefixStore()
    keeper.keep(_filled(1, batch=2, length=1), [[5]], {})  # a batch's cache is never kept from
    assert keeper.restore(_empty(), [[5]]) == []


def test_outputs_a_proposer_read_are_kept_with_the_rows_and_given_as_copies():
    store = PrefixStore()
    features = np.arange(6.0).reshape(1, 2, 3)
    store.keep(_filled(2, length=2), [[5, 6]], {"features": features})
    features[:] = -1  # the caller's array changes afterwards: what was kept does not
    cache = _empty()
    got, = store.restore(cache, [[5, 6]], ("features",))
    np.testing.assert_array_equal(got["features"], np.arange(6.0).reshape(1, 2, 3))
    got["features"][:] = 7  # nor does what a restore gave
    again = _empty()
    np.testing.assert_array_equal(store.restore(again, [[5, 6]], ("features",))[0]["features"],
                                  np.arange(6.0).reshape(1, 2, 3))
    assert store.restore(_empty(), [[5, 6]], ("other",)) == []


def test_the_store_forgets_the_chunks_used_longest_ago_within_its_budget():
    row = sum(r.nbytes for r in _empty().rows_at(0, 1))  # one row of every cache buffer
    store = PrefixStore(budget=5 * row)
    cache = _filled(0, length=2)
    store.keep(cache, [[1, 2]], {})
    cache.advance(2)
    store.keep(cache, [[1, 2], [3, 4]], {})
    store.keep(_filled(1, length=1), [[7]], {})
    assert store.nbytes == 5 * row  # within the budget: all kept
    reader = _empty()
    assert store.restore(reader, [[1, 2]]) == [{}] and store.restore(reader, [[1, 2], [3, 4]]) == [{}]
    store.keep(_filled(2, length=1), [[9]], {})  # 6 rows: [7] was used longest ago
    assert store.nbytes == 5 * row and store.restore(_empty(), [[7]]) == []
    store.keep(_filled(3, length=2), [[5, 5]], {})  # 7 rows: [1, 2]'s chunks were; the one after it goes first
    assert store.nbytes == 5 * row
    assert store.restore(_filled(4, length=2), [[1, 2], [3, 4]]) == [] and store.restore(_empty(), [[1, 2]]) == [{}]
    assert store.restore(_empty(), [[9]]) == [{}] and store.restore(_empty(), [[5, 5]]) == [{}]
    small = PrefixStore(budget=row)
    small.keep(_filled(5, length=2), [[1, 2]], {})  # larger than the whole budget: not kept
    assert small.nbytes == 0 and small.restore(_empty(), [[1, 2]]) == []


def test_one_shrink_forgets_a_whole_chain_child_first_when_it_was_used_longest_ago():
    row = sum(r.nbytes for r in _empty().rows_at(0, 1))
    store = PrefixStore(budget=5 * row)
    cache = _filled(0, length=1)
    for k in range(1, 4):  # [1] -> [2] -> [3], one row each
        store.keep(cache, [[1], [2], [3]][:k], {})
        cache.advance(1)
    store.keep(_filled(1, length=1), [[9]], {})
    store.keep(_filled(2, length=4), [[5, 5, 5, 5]], {})  # 8 rows: the chain goes, [3] then [2] then [1]; [9] stays
    assert store.nbytes == 5 * row
    assert store.restore(_empty(), [[1]]) == [] and store.restore(_empty(), [[9]]) == [{}]
    assert store.restore(_empty(), [[5, 5, 5, 5]]) == [{}]


def _prefill(engine, ids: list[int], store: PrefixStore):
    """The prompt prefilled on a fresh cache with `store`: the cache, the last logits and the target calls made."""
    engine.prefixes, calls = store, engine.target.calls
    cache = engine.target.new_cache(len(ids) + 1)
    logits = engine.prefill(cache, ids)
    return cache, logits, engine.target.calls - calls


def _assert_same_prefill(a, b, n: int) -> None:
    np.testing.assert_array_equal(a[1], b[1])
    for x, y in zip(a[0].buffers, b[0].buffers):
        np.testing.assert_array_equal(x[:, :, :n], y[:, :, :n])


@pytest.mark.real
@pytest.mark.slow
def test_real_smollm2_kept_beginnings_equal_computed(real_smol_ngram):
    """SmolLM2's template ends each message with `<|im_end|>` and a newline: prompts are cut there. The first prompt
    computes the default system prompt's chunk and keeps it, each later one copies it: its cache rows and logits
    equal a cold prefill's exactly, with one call instead of two; every request's tokens equal `specexport run`'s (a
    fresh process: computed), batch 1 and four at once. A conversation with its own system prompt copies, turn by
    turn, the chunks of the turns before it: the same rows, logits and tokens as computed, in two calls a turn."""
    bundle, prompts, runs = real_smol_ngram
    engine = Engine.load(bundle, threads=2)
    store, decode = engine.prefixes, engine.tokenizer.decode
    assert decode(store.message_end, skip_special_tokens=False) == "<|im_end|>\n"
    prompt_ids = [engine.encode(p) for p in prompts]
    for ids in prompt_ids:
        cuts = store.split(ids)
        assert len(cuts) == 1 and "SmolLM" in decode(ids[:cuts[0]]) and prompts[0][:20] not in decode(ids[:cuts[0]])
    assert store.split(engine.encode(prompts[0], chat=False)) == []  # raw text: no message ends
    for k, ids in enumerate(prompt_ids):
        cold, warm = _prefill(engine, ids, PrefixStore(*store.marks)), _prefill(engine, ids, store)
        assert (cold[2], warm[2]) == (2, 2 if k == 0 else 1)
        _assert_same_prefill(warm, cold, len(ids))
    engine.prefixes = store
    for prompt, run in zip(prompts, runs):
        assert engine.generate(prompt, max_new_tokens=48).text == run["text"]
    scheduler = Scheduler(engine, max_batch=4, background=False)
    requests = [scheduler.submit(p, max_new_tokens=48) for p in prompts]
    scheduler.run_until_idle()
    assert [r.result(timeout=0).text for r in requests] == [run["text"] for run in runs]

    chat = [{"role": "system", "content": "You are a terse assistant: you answer in one short sentence."}]
    for turn, prompt in enumerate(prompts[:3]):
        chat.append({"role": "user", "content": prompt})
        ids = engine.tokenizer.encode_chat(chat)
        assert len(store.split(ids)) == turn + 1  # the system prompt, then each earlier exchange
        cold, warm = _prefill(engine, ids, PrefixStore(*store.marks)), _prefill(engine, ids, store)
        assert (cold[2], warm[2]) == (turn + 2, 2)  # copied: all but the last exchange and the new prompt
        _assert_same_prefill(warm, cold, len(ids))
        engine.prefixes = PrefixStore(*store.marks)
        computed = engine.generate(ids, max_new_tokens=24)
        engine.prefixes = store
        reply = engine.generate(ids, max_new_tokens=24)
        assert reply.tokens == computed.tokens
        chat.append({"role": "assistant", "content": reply.text})


@pytest.mark.real
@pytest.mark.slow
def test_real_smollm2_conversation_on_the_device_path(real_smol_ngram):
    """The same conversation on ONNX Runtime's device path (cpu-iobinding, the code CUDA runs): each turn copies the
    turns before it on the device, the rows and logits a cold prefill computes, in two calls a turn; its replies are
    the host path's, batch 1 and batched (the kept chunks copied into the pool's slots)."""
    bundle, prompts, _ = real_smol_ngram
    host, device = Engine.load(bundle, threads=2), Engine.load(bundle, threads=2, device="cpu-iobinding")
    store = device.prefixes
    chat, asked, replies = [{"role": "system", "content": "You are a terse assistant: you answer in one sentence."}], [], []
    for turn, prompt in enumerate(prompts[:3]):
        chat.append({"role": "user", "content": prompt})
        ids = device.tokenizer.encode_chat(chat)
        cold, warm = _prefill(device, ids, PrefixStore(*store.marks)), _prefill(device, ids, store)
        assert (cold[2], warm[2]) == (turn + 2, 2)
        np.testing.assert_array_equal(warm[1], cold[1])
        np.testing.assert_array_equal(warm[0].value.numpy()[..., :len(ids), :], cold[0].value.numpy()[..., :len(ids), :])
        reply = host.generate(ids, max_new_tokens=24)
        device.prefixes = store
        assert device.generate(ids, max_new_tokens=24).tokens == reply.tokens
        asked.append(ids)
        replies.append(reply.tokens)
        chat.append({"role": "assistant", "content": reply.text})
    scheduler, hits = Scheduler(device, max_batch=3, background=False), store.hits
    requests = [scheduler.submit(ids, max_new_tokens=24) for ids in asked]
    scheduler.run_until_idle()
    assert [r.result(timeout=0).tokens for r in requests] == replies
    assert store.hits - hits == sum(sum(len(c) for c in device.prefill_chunks(ids)[:-1]) for ids in asked)
