"""Steps laid out in lanes (runtime/backends/layout.py): where each node goes, what the call sees, where its
outputs and its cache rows come back. The bits themselves are tests/test_exactness.py's."""

import numpy as np
import pytest

from specexport.runtime import tree
from specexport.runtime.backends.layout import LANES, MARGIN, exact_nodes, lane_slots, lay_out
from specexport.runtime.kvcache import KVCache, KVPool


def test_each_node_sits_in_its_depths_lane_after_its_parent():
    for parents in ([-1, 0, 0, 1], [-1, 0, 0, 0, 1, 2, 3, 4, 4], [-1, 0, 1, 2, 0, 4, 5, 1]):
        slots, depth = lane_slots(parents), tree.depths(parents)
        assert len(set(slots.tolist())) == len(parents) and slots[0] == 0
        assert np.all(slots % LANES == depth % LANES)
        assert all(slots[i] > slots[p] for i, p in enumerate(parents) if p >= 0)
        for i, p in enumerate(parents):  # siblings keep their order
            later = [j for j in range(i + 1, len(parents)) if parents[j] == p and p >= 0]
            assert all(slots[j] > slots[i] for j in later)
    assert lane_slots([-1, 0, 0, 1]).tolist() == [0, 1, 17, 2]
    assert lane_slots(tree.chain(5)).tolist() == [0, 1, 2, 3, 4]


def test_a_tree_is_verified_without_the_nodes_that_would_fall_in_another_run_of_keys():
    """Runs of 256 keys (64-wide heads): after 250 rows the second child's slot 17 is key 267, its depth's key 251."""
    assert exact_nodes([-1, 0, 0], 250, 64) == [0, 1]
    assert exact_nodes([-1, 0, 0], 200, 64) == [0, 1, 2]
    assert exact_nodes([-1, 0, 0], 250, 128) == [0, 1]  # runs of 128 for 128-wide heads: 250 + 17 > 256 too
    assert exact_nodes([-1, 0, 0, 1], 250, 64) == [0, 1, 3]  # a grandchild of the first child stays
    assert exact_nodes([-1, 0, 0, 1], 250, 64, prefix=True) == 2  # an unscored tree: a prefix, numbering kept
    star = [-1] + [0] * 8  # beyond the cache's margin for a tree of 9 nodes: slot 81 > 9 + MARGIN - 2
    assert exact_nodes(star, 0, 64) == list(range(6)) and 81 >= len(star) + MARGIN - 2


def test_a_step_laid_out_in_lanes():
    """Two sequences: a fork of 3 nodes after 5 rows, and a chain of 2 after 9 (its rows in place). The call is
    18 rows wide: the fork at slots 0, 1, 17, padding between, each padding row seeing only itself; the caller's
    rows come back by `place`, and each selected row is found at its slot."""
    ids = np.array([[7, 8, 9], [4, 5, 0]])
    positions = np.array([[5, 6, 6], [9, 10, 10]])
    mask = np.zeros((2, 3, 3), bool)
    mask[0] = tree.ancestor_mask([-1, 0, 0])
    mask[1, :2, :2] = tree.causal_mask(2)
    mask[1, 2, 2] = True
    live = np.array([3, 2])
    layout = lay_out(ids, positions, mask, np.array([0, 1, 2, 3, 4]), live, lanes=True, room=100)
    assert layout.input_ids.shape == (2, 18)
    assert layout.place.tolist() == [[0, 1, 17], [0, 1, 17]]  # the chain's padding row: a free row of the call
    assert layout.moved[0].tolist() == [0, 1, 17] and layout.moved[1] is None
    assert layout.input_ids[0, [0, 1, 17]].tolist() == [7, 8, 9] and layout.position_ids[0, 17] == 6
    assert layout.real.sum(1).tolist() == [3, 2]
    m = layout.tree_mask[0]
    assert m[17, [0, 17]].all() and m[17].sum() == 2 and m[1, [0, 1]].all() and m[1].sum() == 2
    for row in set(range(18)) - {0, 1, 17}:
        assert m[row].sum() == 1 and m[row, row]
    assert layout.logits_indices.tolist() == [0, 1, 17, 18, 19]
    out = {"hidden_states": np.arange(2 * 18).reshape(2, 18, 1), "logits": np.zeros((5, 3))}
    back = layout.outputs(out, {"hidden_states"})
    assert back["hidden_states"][..., 0].tolist() == [[0, 1, 17], [18, 19, 35]] and back["logits"].shape == (5, 3)


def test_a_chain_runs_as_given_and_a_call_of_16k_plus_1_rows_gets_a_padding_row():
    chain = tree.causal_mask(4)[None]
    assert lay_out(np.zeros((1, 4), np.int64), np.arange(4)[None], chain, np.array([3]), None, True, 10) is None
    one = lay_out(np.array([[5]]), np.array([[3]]), np.ones((1, 1, 1), bool), np.array([0]), None, True, 10)
    assert one.input_ids.tolist() == [[5, 5]] and one.tree_mask[0].tolist() == [[True, False], [False, True]]
    assert lay_out(np.array([[5]]), np.array([[3]]), np.ones((1, 1, 1), bool), np.array([0]), None, True, 0) is None
    fork = tree.ancestor_mask([-1, 0, 0])[None]  # no room for its lanes: as given
    assert lay_out(np.zeros((1, 3), np.int64), np.zeros((1, 3), np.int64), fork, np.arange(3), None, True, 5) is None


def test_a_draft_models_level_that_sees_part_of_the_cached_rows_stays_in_order():
    """Rows that see only some of the columns before them (a tree grown level by level) are no forest after a
    whole past: not laid out."""
    mask = np.ones((1, 3, 5), bool)
    mask[0, :, 2:] = tree.ancestor_mask([-1, 0, 0])
    mask[0, 1, 0] = False
    assert lay_out(np.zeros((1, 3), np.int64), np.zeros((1, 3), np.int64), mask, np.arange(3), None, True, 50) is None


def test_the_cache_commits_and_advances_the_rows_where_they_were_placed():
    cache = KVCache(1, 1, 1, 64, 2)
    cache.length = 4
    for buf in cache.buffers:
        buf[0, 0, :, 0] = np.arange(64)
    cache.place(0, np.array([0, 1, 17]))
    cache.commit([0, 2])  # the root and the second child: rows 4 and 21 -> 4, 5
    assert cache.length == 6 and cache.buffers[0][0, 0, 4:6, 0].tolist() == [4, 21]
    cache.place(0, np.array([0, 1, 17]))
    cache.advance(3)
    assert cache.length == 9 and cache.buffers[0][0, 0, 6:9, 0].tolist() == [6, 7, 23]
    cache.place(0, np.array([0, 17]))
    cache.rewind(9)  # forgets the placement
    cache.commit([0, 1])
    assert cache.buffers[0][0, 0, 9:11, 0].tolist() == [9, 10]


def test_a_pools_slots_keep_their_own_placements():
    pool = KVPool(1, 3, 1, 64, 2)
    for buf in pool.buffers:
        buf[:, 0, :, 0] = np.arange(64)
    pool.lengths[:] = [2, 5, 0]
    view = pool.rows(2)
    view.place(0, np.array([0, 17, 1]))
    view.place(1, None)
    pool.slot(0).commit([0, 1])
    pool.slot(1).commit([0, 1])
    assert pool.buffers[0][0, 0, 2:4, 0].tolist() == [2, 19] and pool.buffers[0][1, 0, 5:7, 0].tolist() == [5, 6]
    view.place(1, np.array([0, 17]))
    pool.empty(1)
    assert pool.lengths[1] == 0 and 1 not in pool.placed
    pool.slot(2).place(0, np.array([0, 17]))
    pool.move_slot(0, 2)
    assert 2 not in pool.placed


@pytest.mark.parametrize("live", [None, np.array([3, 2])])
def test_the_caller_sees_its_own_rows_in_its_order(live):
    """A round trip: a value per (batch row, row) written at the call's rows comes back where the caller had it."""
    ids = np.array([[1, 2, 3], [4, 5, 6]])
    mask = np.stack([tree.ancestor_mask([-1, 0, 0]), tree.ancestor_mask([-1, 0, 1])])
    layout = lay_out(ids, np.zeros((2, 3), np.int64), mask, np.arange(6), live, True, 100)
    back = layout.outputs({"x": layout.input_ids[..., None]}, {"x"})["x"][..., 0]
    n = [3, 3] if live is None else live
    for b in range(2):
        assert back[b, :n[b]].tolist() == ids[b, :n[b]].tolist()
