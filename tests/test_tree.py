"""Trees of draft tokens: hand-drawn trees against literal 0/1 masks, depths and biases."""

import numpy as np
import pytest

from specexport.runtime.tree import (
    HIDDEN,
    AcceptMode,
    DraftTree,
    ancestor_mask,
    attention_bias,
    causal_mask,
    chain,
    check_parents,
    children,
    depths,
    subtree,
)

H = HIDDEN

#        0            node: parent
#      /   \          0: root (child of the last committed token)
#     1     2         1: 0   2: 0
#    / \    |         3: 1   4: 1
#   3   4   5         5: 2
BRANCHY = [-1, 0, 0, 1, 1, 2]
BRANCHY_MASK = [
    [1, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0],
    [1, 1, 0, 1, 0, 0],
    [1, 1, 0, 0, 1, 0],
    [1, 0, 1, 0, 0, 1],
]

# Two roots (two candidates for the next token), each with a chain below: 0-2-4 and 1-3.
TWO_ROOTS = [-1, -1, 0, 1, 2]
TWO_ROOTS_MASK = [
    [1, 0, 0, 0, 0],
    [0, 1, 0, 0, 0],
    [1, 0, 1, 0, 0],
    [0, 1, 0, 1, 0],
    [1, 0, 1, 0, 1],
]

# validate.TREE: two branches at the root, a deeper left branch.
DEEP = [-1, 0, 0, 1, 1, 2, 3, 5]
DEEP_MASK = [
    [1, 0, 0, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 0, 0, 0, 0],
    [1, 0, 1, 0, 0, 0, 0, 0],
    [1, 1, 0, 1, 0, 0, 0, 0],
    [1, 1, 0, 0, 1, 0, 0, 0],
    [1, 0, 1, 0, 0, 1, 0, 0],
    [1, 1, 0, 1, 0, 0, 1, 0],
    [1, 0, 1, 0, 0, 1, 0, 1],
]


@pytest.mark.parametrize(
    "parents, mask, depth",
    [
        (BRANCHY, BRANCHY_MASK, [0, 1, 1, 2, 2, 2]),
        (TWO_ROOTS, TWO_ROOTS_MASK, [0, 0, 1, 1, 2]),
        (DEEP, DEEP_MASK, [0, 1, 1, 2, 2, 2, 3, 3]),
        ([-1, 0, 1, 2], [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]], [0, 1, 2, 3]),
        ([-1, -1, -1], [[1, 0, 0], [0, 1, 0], [0, 0, 1]], [0, 0, 0]),
        ([-1], [[1]], [0]),
    ],
    ids=["branchy", "two_roots", "deep", "chain", "siblings", "single"],
)
def test_mask_and_depths(parents, mask, depth):
    got = ancestor_mask(parents)
    assert got.dtype == bool
    np.testing.assert_array_equal(got.astype(int), np.array(mask))
    np.testing.assert_array_equal(depths(parents), depth)


def test_children():
    assert children(BRANCHY) == [[1, 2], [3, 4], [5], [], [], []]
    assert children(TWO_ROOTS) == [[2], [3], [4], [], []]
    assert children(DEEP) == [[1, 2], [3, 4], [5], [6], [], [7], [], []]
    assert children(chain(3)) == [[1], [2], []]
    assert children([-1]) == [[]] and children([]) == []
    with pytest.raises(ValueError, match="not a tree in topological order"):
        children([-1, 2, 0])


def test_chain():
    np.testing.assert_array_equal(chain(4), [-1, 0, 1, 2])
    np.testing.assert_array_equal(chain(1), [-1])
    assert chain(0).size == 0
    np.testing.assert_array_equal(ancestor_mask(chain(5)), np.tri(5, dtype=bool))


def test_hidden_is_finite_and_large():
    assert np.isfinite(H) and H <= -1e4
    assert np.float32(H) == H


def test_bias_no_past():
    bias = attention_bias(BRANCHY, past_len=0)
    assert bias.shape == (1, 1, 6, 6) and bias.dtype == np.float32
    expected = np.where(np.array(BRANCHY_MASK) == 1, 0.0, H)
    np.testing.assert_array_equal(bias[0, 0], expected)


def test_bias_with_past():
    """Past columns are all visible; tree columns follow the mask."""
    bias = attention_bias([-1, 0, 0], past_len=2)
    expected = [
        [0, 0, 0, H, H],
        [0, 0, 0, 0, H],
        [0, 0, 0, H, 0],
    ]
    np.testing.assert_array_equal(bias, np.array(expected, np.float32)[None, None])


def test_bias_wider_than_past_plus_tree():
    """A graph whose bias spans the cache capacity: columns after past+T are hidden."""
    bias = attention_bias([-1, 0, 0], past_len=2, width=7)
    expected = [
        [0, 0, 0, H, H, H, H],
        [0, 0, 0, 0, H, H, H],
        [0, 0, 0, H, 0, H, H],
    ]
    np.testing.assert_array_equal(bias[0, 0], np.array(expected, np.float32))


def test_bias_batch_rows_are_identical():
    bias = attention_bias(TWO_ROOTS, past_len=3, width=10, batch=3)
    assert bias.shape == (3, 1, 5, 10)
    for b in range(3):
        np.testing.assert_array_equal(bias[b], bias[0])
    np.testing.assert_array_equal(bias[0, 0, :, :3], 0.0)
    np.testing.assert_array_equal(bias[0, 0, :, 3:8], np.where(np.array(TWO_ROOTS_MASK) == 1, 0.0, H))
    np.testing.assert_array_equal(bias[0, 0, :, 8:], H)


def test_causal_mask():
    assert causal_mask(3).astype(int).tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert causal_mask(1).tolist() == [[True]]


@pytest.mark.parametrize("t", [1, 2, 5, 9])
def test_causal_mask_is_the_chain_tree(t):
    np.testing.assert_array_equal(causal_mask(t), ancestor_mask(chain(t)))


def test_width_too_small():
    with pytest.raises(ValueError, match="bias width 4 < past 2 \\+ tree 3"):
        attention_bias([-1, 0, 0], past_len=2, width=4)


@pytest.mark.parametrize(
    "parents",
    [[0], [-1, 1], [-1, 2, 0], [-1, 0, 3, 1], [-2], [-1, 0, -3]],
    ids=["self_root", "self", "forward", "forward_deep", "below_minus_one", "negative"],
)
def test_invalid_parents(parents):
    for fn in (check_parents, depths, ancestor_mask, lambda p: attention_bias(p, 0)):
        with pytest.raises(ValueError, match="not a tree in topological order"):
            fn(parents)


def test_parents_are_flattened_int64():
    parents = check_parents(np.array([[-1, 0, 0]], dtype=np.int32))
    assert parents.dtype == np.int64 and parents.tolist() == [-1, 0, 0]


# ---- the step's tree ------------------------------------------------------------------------------


def test_draft_tree_is_root_first():
    """A hand-drawn step tree: root 7 with children 8 and 9, and 10 below 8. The same indices are the verify rows,
    the acceptance path and the cache rows to commit."""
    t = DraftTree([7, 8, 9, 10], [-1, 0, 0, 1])
    assert (len(t), t.drafts, t.mode) == (4, 3, AcceptMode.TOPK)
    assert DraftTree.root_only(7) == DraftTree([7], [-1]) and DraftTree.root_only(7).drafts == 0
    cut = t.truncated(2)
    assert (cut.tokens, cut.parents) == ([7, 8], [-1, 0])
    assert t.truncated(9) is t
    q = np.arange(8.0).reshape(4, 2)
    sampled = DraftTree([7, 8, 9, 10], [-1, 0, 1, 2], AcceptMode.WITH_REPLACEMENT, q)
    np.testing.assert_array_equal(sampled.truncated(3).q, q[:3])  # row r: what node r's children were drawn from
    assert attention_bias(t.parents, 2)[0, 0].tolist() == [[0, 0, 0, HIDDEN, HIDDEN, HIDDEN],
                                                           [0, 0, 0, 0, HIDDEN, HIDDEN],
                                                           [0, 0, 0, HIDDEN, 0, HIDDEN],
                                                           [0, 0, 0, 0, HIDDEN, 0]]


def test_subtree_reindexes_parents():
    tokens, parents = [7, 8, 9, 10, 11], [-1, 0, 0, 1, 3]
    assert subtree(tokens, parents, [0, 1, 3]) == ([7, 8, 10], [-1, 0, 1])
    assert subtree(tokens, parents, [0, 2]) == ([7, 9], [-1, 0])
    with pytest.raises(KeyError):
        subtree(tokens, parents, [0, 3])  # not ancestor-closed: node 3 without its parent 1
