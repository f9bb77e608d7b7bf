"""KV cache bookkeeping: advance, commit (prefix: no copy; other paths: rows moved down), rewind, overflow."""

import numpy as np
import pytest

from specexport.runtime.kvcache import KVCache


def numbered(layers=2, batch=1, capacity=8):
    """A cache whose row r of buffer k holds the value 100 * k + r everywhere (2 kv heads, head_dim 3)."""
    cache = KVCache(layers=layers, batch=batch, kv_heads=2, capacity=capacity, head_dim=3)
    for k, buf in enumerate(cache.buffers):
        buf[...] = (100 * k + np.arange(capacity))[None, None, :, None]
    return cache


def rows(cache, k=0):
    """Row values of buffer k (checked to be constant over batch, heads and head_dim)."""
    buf = cache.buffers[k]
    assert (buf == buf[:1, :1, :, :1]).all()
    return buf[0, 0, :, 0].astype(int).tolist()


def test_buffers():
    cache = KVCache(layers=3, batch=2, kv_heads=2, capacity=5, head_dim=4, dtype=np.float16)
    assert len(cache.buffers) == 6
    assert all(b.shape == (2, 2, 5, 4) and b.dtype == np.float16 and not b.any() for b in cache.buffers)
    assert len({id(b) for b in cache.buffers}) == 6
    assert (cache.length, cache.capacity, cache.room(), cache.handle) == (0, 5, 5, None)


def test_advance():
    cache = numbered()
    cache.advance(3)
    cache.advance(1)
    assert (cache.length, cache.room()) == (4, 4)
    assert rows(cache) == [0, 1, 2, 3, 4, 5, 6, 7]  # advance never touches the data
    cache.advance(4)
    assert cache.room() == 0


def test_advance_overflow():
    cache = numbered()
    cache.advance(6)
    with pytest.raises(ValueError, match="KV cache overflow: 6 \\+ 3 > capacity 8"):
        cache.advance(3)
    assert cache.length == 6


def test_commit_prefix_path_copies_nothing():
    cache = numbered()
    cache.advance(2)
    for buf in cache.buffers:
        buf.flags.writeable = False  # any write would raise
    cache.commit([0, 1, 2])
    assert cache.length == 5
    assert rows(cache) == [0, 1, 2, 3, 4, 5, 6, 7]


def test_commit_non_prefix_path_moves_rows_down():
    """Tree rows at 2..6 (offsets 0..4); the accepted path is offsets 0, 2, 4 -> rows 2, 4, 6."""
    cache = numbered()
    cache.advance(2)
    cache.commit([0, 2, 4])
    assert cache.length == 5
    assert rows(cache, 0) == [0, 1, 2, 4, 6, 5, 6, 7]
    assert rows(cache, 1) == [100, 101, 102, 104, 106, 105, 106, 107]
    assert rows(cache, 3) == [300, 301, 302, 304, 306, 305, 306, 307]


def test_commit_overlapping_rows():
    """Offsets 1, 2 -> destination offsets 0, 1: the source is read before it is overwritten."""
    cache = numbered()
    cache.advance(3)
    cache.commit([1, 2])
    assert cache.length == 5
    assert rows(cache) == [0, 1, 2, 4, 5, 5, 6, 7]


def test_commit_single_non_root_row():
    cache = numbered()
    cache.commit([5])
    assert cache.length == 1
    assert rows(cache, 2) == [205, 201, 202, 203, 204, 205, 206, 207]


def test_commit_every_batch_row_and_head():
    cache = KVCache(layers=1, batch=2, kv_heads=2, capacity=6, head_dim=2)
    rng = np.random.default_rng(0)
    for buf in cache.buffers:
        buf[...] = rng.standard_normal(buf.shape)
    before = [b.copy() for b in cache.buffers]
    cache.advance(1)
    cache.commit([1, 3])  # rows 2 and 4 -> rows 1 and 2
    assert cache.length == 3
    for old, new in zip(before, cache.buffers):
        np.testing.assert_array_equal(new[:, :, 0], old[:, :, 0])
        np.testing.assert_array_equal(new[:, :, 1], old[:, :, 2])
        np.testing.assert_array_equal(new[:, :, 2], old[:, :, 4])
        np.testing.assert_array_equal(new[:, :, 3:], old[:, :, 3:])


def test_commit_nothing():
    cache = numbered()
    cache.advance(2)
    cache.commit([])
    assert cache.length == 2
    assert rows(cache) == list(range(8))


@pytest.mark.parametrize("bad", [[-1], [0, 6], [7], list(range(7)), np.arange(7)])  # a prefix too long, list or array
def test_commit_outside_the_cache(bad):
    cache = numbered()
    cache.advance(2)  # offsets must stay below capacity - length = 6
    with pytest.raises(ValueError, match="outside the cache"):
        cache.commit(bad)
    assert cache.length == 2
    assert rows(cache) == list(range(8))


def test_rewind():
    cache = numbered()
    cache.advance(5)
    cache.rewind(2)
    assert (cache.length, cache.room()) == (2, 6)
    assert rows(cache) == list(range(8))  # not cleared
    cache.rewind(2)
    cache.rewind(0)
    assert cache.length == 0


@pytest.mark.parametrize("bad", [-1, 4])
def test_rewind_out_of_range(bad):
    cache = numbered()
    cache.advance(3)
    with pytest.raises(ValueError, match=f"cannot rewind to {bad} \\(cache holds 3\\)"):
        cache.rewind(bad)
    assert cache.length == 3
