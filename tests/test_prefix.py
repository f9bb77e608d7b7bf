"""The chat template's head (runtime/prefix.py): which chunks spell it, its rows kept and put back on hand-built
caches, and on the real SmolLM2 (fp32): a prompt whose head was copied gets the rows, logits and tokens that
computing it gives, batch 1 and batched, with one target call fewer."""

import numpy as np
import pytest

from specexport.runtime.generate import Engine
from specexport.runtime.kvcache import KVCache
from specexport.runtime.prefix import TemplateHead
from specexport.runtime.scheduler import Scheduler


def test_split_and_chunk_keys_on_hand_built_ids():
    head = TemplateHead([5, 6, 7, 8])
    assert head.split([5, 6, 7, 8, 9]) == 4
    assert head.split([5, 6, 7, 8]) == 0  # the whole prompt: nothing would follow it
    assert head.split([5, 6, 7, 9, 9]) == 0 and head.split([6, 7, 8, 9]) == 0
    assert head.key([[5], [6, 7, 8]]) == (1, 3) and head.key([[5, 6]]) == (2,)
    assert head.key([[5, 6], [7, 9]]) is None and head.key([[5, 6, 7, 8], [9]]) is None  # past the head
    assert head.key([[4], [6, 7, 8]]) is None  # the head's tokens after another first token
    assert head.key([]) is None and TemplateHead([]).split([1, 2]) == 0 and TemplateHead([]).key([[1]]) is None


def _filled(seed: int, batch: int = 1, length: int = 0) -> KVCache:
    cache = KVCache(layers=2, batch=batch, kv_heads=2, capacity=16, head_dim=4)
    rng = np.random.default_rng(seed)
    for buf in cache.buffers:
        buf[:] = rng.normal(size=buf.shape)
    cache.advance(length)
    return cache


def _empty() -> KVCache:
    return KVCache(layers=2, batch=1, kv_heads=2, capacity=16, head_dim=4)


def test_kept_chunks_are_put_back_by_their_chunking():
    head = TemplateHead([5, 6, 7])
    source = _filled(0, length=1)
    head.keep(source, [[5]], {})
    source.advance(2)
    head.keep(source, [[5], [6, 7]], {})
    target = _empty()
    assert head.restore(target, [[5]]) == {} and target.length == 1
    assert head.restore(target, [[5], [6, 7]]) == {} and target.length == 3
    for kept, put in zip(source.buffers, target.buffers):
        np.testing.assert_array_equal(put[:, :, :3], kept[:, :, :3])
        assert not put[:, :, 3:].any()  # nothing past the head
    assert head.restore(target, [[5], [6, 7], [8]]) is None  # not the head's tokens
    other = _empty()
    assert head.restore(other, [[5, 6]]) is None and other.length == 0  # another chunking keeps its own chunks
    assert head.restore(other, [[5]], ("features",)) is None and other.length == 0  # no outputs kept for this reader
    assert head.restore(other, [[5], [6, 7]]) is None and other.length == 0  # the rows before it are not there
    # the same last chunk after another chunking of the rows before it is another chunk: its rows differ
    split = TemplateHead([5, 6, 7, 8])
    split.keep(_filled(3, length=4), [[5, 6], [7, 8]], {})
    assert split.restore(_filled(4, length=2), [[5], [6], [7, 8]]) is None
    assert split.restore(_filled(4, length=2), [[5, 6], [7, 8]]) == {}
    keeper = TemplateHead([5])
    keeper.keep(_filled(1, batch=2, length=1), [[5]], {})  # a batch's cache is never kept from
    assert keeper.restore(_empty(), [[5]]) is None


def test_outputs_a_proposer_read_are_kept_with_the_rows_and_given_as_copies():
    head = TemplateHead([5, 6])
    features = np.arange(6.0).reshape(1, 2, 3)
    head.keep(_filled(2, length=2), [[5, 6]], {"features": features})
    features[:] = -1  # the caller's array changes afterwards: what was kept does not
    cache = _empty()
    got = head.restore(cache, [[5, 6]], ("features",))
    np.testing.assert_array_equal(got["features"], np.arange(6.0).reshape(1, 2, 3))
    got["features"][:] = 7  # nor does what a restore gave
    again = _empty()
    np.testing.assert_array_equal(head.restore(again, [[5, 6]], ("features",))["features"], np.arange(6.0).reshape(1, 2, 3))
    assert head.restore(_empty(), [[5, 6]], ("other",)) is None


@pytest.mark.real
@pytest.mark.slow
def test_real_smollm2_head_copied_equals_head_computed(real_smol_ngram):
    """The first prompt computes the template's head (SmolLM2's system prompt) and keeps it; each later one copies
    it: its cache rows and logits equal a cold prefill's exactly, with one call instead of two; every request's
    tokens equal `specexport run`'s (a fresh process: the head computed), batch 1 and four at once."""
    bundle, prompts, runs = real_smol_ngram
    engine = Engine.load(bundle, threads=2)
    head = engine.head
    assert len(head.tokens) > 10 and "SmolLM" in engine.tokenizer.decode(head.tokens)
    prompt_ids = [engine.encode(p) for p in prompts]
    assert all(head.split(ids) == len(head.tokens) for ids in prompt_ids)
    assert head.split(engine.encode(prompts[0], chat=False)) == 0  # a raw prompt has no head
    for k, ids in enumerate(prompt_ids):
        engine.head = TemplateHead(head.tokens)  # nothing kept: computed
        cold = engine.target.new_cache(len(ids) + 1)
        cold_logits = engine.prefill(cold, ids)
        engine.head = head
        calls = engine.target.calls
        warm = engine.target.new_cache(len(ids) + 1)
        warm_logits = engine.prefill(warm, ids)
        assert engine.target.calls - calls == (2 if k == 0 else 1)
        np.testing.assert_array_equal(warm_logits, cold_logits)
        for a, b in zip(warm.buffers, cold.buffers):
            np.testing.assert_array_equal(a[:, :, :len(ids)], b[:, :, :len(ids)])
    for prompt, run in zip(prompts, runs):
        assert engine.generate(prompt, max_new_tokens=48).text == run["text"]
    scheduler = Scheduler(engine, max_batch=4, background=False)
    requests = [scheduler.submit(p, max_new_tokens=48) for p in prompts]
    scheduler.run_until_idle()
    assert [r.result(timeout=0).text for r in requests] == [run["text"] for run in runs]
