"""Prompt lookup: hand-made histories against literal trees (root first: node 0 is the last token), and the
incremental index against brute force."""

import random

import numpy as np
import pytest

from specexport.runtime.ngram import SCAN_PER_N, NgramIndex
from specexport.runtime.tree import check_parents


def propose(history, **options):
    return NgramIndex(**options).propose(history)


def test_single_match_is_a_chain():
    # (11, 12) occurs once before the end; the 1-gram 12 finds the same position, so one branch.
    history = [10, 11, 12, 13, 14, 20, 21, 11, 12]
    assert propose(history, draft_len=4) == ([12, 13, 14, 20, 21], [-1, 0, 1, 2, 3])


def test_no_match():
    assert propose([1, 2, 3, 4]) == ([4], [-1])
    assert propose([7]) == ([7], [-1])
    assert propose([]) == ([], [])


def test_longest_ngram_first():
    # The 2-gram (2, 3) ends at 2; the 1-gram 3 also ends at 6, which is more recent but shorter.
    history = [1, 2, 3, 50, 51, 9, 3, 60, 61, 2, 3]
    assert propose(history, draft_len=2, max_matches=1) == ([3, 50, 51], [-1, 0, 1])
    #      3
    #     / \
    #   50   60
    #   |    |
    #   51   61
    assert propose(history, draft_len=2, max_matches=2) == ([3, 50, 51, 60, 61], [-1, 0, 1, 0, 3])


def test_most_recent_first():
    history = [7, 1, 2, 7, 3, 4, 7]
    assert propose(history, draft_len=2, max_matches=1) == ([7, 3, 4], [-1, 0, 1])
    assert propose(history, draft_len=2, max_matches=2) == ([7, 3, 4, 1, 2], [-1, 0, 1, 0, 3])


# (1, 2) ends at 1 and at 7; the recent match continues 10 11 13 98, the older one 10 11 12 99.
DIVERGING = [1, 2, 10, 11, 12, 99, 1, 2, 10, 11, 13, 98, 1, 2]


def test_two_matches_share_a_prefix():
    #        2            node: parent
    #        |            0: -1 (2, the root)
    #        10           1: 0 (10)    2: 1 (11)
    #        |            3: 2 (13)    4: 3 (98)
    #        11           5: 2 (12)    6: 5 (99)
    #       /  \
    #     13    12
    #     |     |
    #     98    99
    assert propose(DIVERGING, draft_len=4) == ([2, 10, 11, 13, 98, 12, 99], [-1, 0, 1, 2, 3, 2, 5])


def test_node_cap_keeps_the_best_branch_complete():
    assert propose(DIVERGING, draft_len=4, max_nodes=5) == ([2, 10, 11, 13, 98, 12], [-1, 0, 1, 2, 3, 2])
    assert propose(DIVERGING, draft_len=4, max_nodes=4) == ([2, 10, 11, 13, 98], [-1, 0, 1, 2, 3])
    assert propose(DIVERGING, draft_len=4, max_nodes=2) == ([2, 10, 11], [-1, 0, 1])
    # The default cap is draft_len * max_matches.
    assert NgramIndex(draft_len=5, max_matches=3).max_nodes == 15


def test_duplicate_continuations_are_not_distinct_matches():
    # 3 ends at 6, 3 and 0: the continuation after 3 repeats that after 6, so the second match is the one at 0.
    history = [3, 8, 9, 3, 4, 5, 3, 4, 5, 3]
    assert propose(history, draft_len=3, max_matches=2) == ([3, 4, 5, 3, 8, 9, 3], [-1, 0, 1, 2, 0, 4, 5])


def test_scan_bound():
    # Only the SCAN_PER_N * max_matches most recent occurrences are examined: 5 -> 9 lies beyond them.
    assert SCAN_PER_N * 2 < 40
    assert propose([5, 9] + [5, 7] * 10 + [5], max_ngram=1, draft_len=1, max_matches=2) == ([5, 7, 9], [-1, 0, 0])
    assert propose([5, 9] + [5, 7] * 40 + [5], max_ngram=1, draft_len=1, max_matches=2) == ([5, 7], [-1, 0])


def test_continuation_may_run_into_the_query():
    # (1, 1, 1) ends at 2 -> [1]; (1, 1) ends at 1 -> [1, 1]; 1 ends at 0 -> [1, 1, 1]: one chain.
    assert propose([1, 1, 1, 1]) == ([1, 1, 1, 1], [-1, 0, 1, 2])


def test_min_ngram_excludes_short_matches():
    history = [1, 2, 3, 50, 51, 9, 3, 60, 61, 2, 3]
    assert propose([5, 6, 7, 8, 5], min_ngram=2) == ([5], [-1])
    assert propose(history, draft_len=2, min_ngram=2) == ([3, 50, 51], [-1, 0, 1])


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(max_ngram=1, min_ngram=2), "max_ngram >= min_ngram >= 1"),
        (dict(min_ngram=0), "max_ngram >= min_ngram >= 1"),
        (dict(draft_len=0), "draft_len must be in 1..64"),
        (dict(draft_len=65), "draft_len must be in 1..64"),
        (dict(max_matches=0), "max_matches must be >= 1"),
        (dict(max_nodes=0), "max_nodes must be >= 1"),
    ],
)
def test_invalid_options(options, message):
    with pytest.raises(ValueError, match=message):
        NgramIndex(**options)


def test_reset_and_a_new_history():
    proposer = NgramIndex(draft_len=4)
    proposer.propose(DIVERGING)
    proposer.reset()
    assert proposer.propose([10, 11, 12, 13, 14, 20, 21, 11, 12]) == ([12, 13, 14, 20, 21], [-1, 0, 1, 2, 3])
    # Without reset: a shorter or different history is detected and the index rebuilt.
    assert proposer.propose([7, 1, 2, 7]) == ([7, 1, 2, 7], [-1, 0, 1, 2])
    assert proposer.propose([8, 1, 2, 7, 3]) == ([3], [-1])


def test_numpy_history():
    assert propose(np.array(DIVERGING, dtype=np.int64), draft_len=4) == propose(DIVERGING, draft_len=4)


def brute_force(history, max_ngram, min_ngram, draft_len, max_matches, max_nodes):
    """The same ranking, searched from scratch by scanning the history; an independent trie merge."""
    length = len(history)
    if not length:
        return [], []
    tokens, parents, children = [history[-1]], [-1], {}  # children: (parent, token) -> node; node 0 is the root
    used, matches = set(), 0
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        query = history[length - n :]
        ends = [e for e in range(length - 2, n - 2, -1) if history[e - n + 1 : e + 1] == query]
        for end in ends[: SCAN_PER_N * max_matches]:
            if end in used:
                continue
            used.add(end)
            node, before = 0, len(tokens)
            for token in history[end + 1 : end + 1 + draft_len]:
                if (node, token) not in children:
                    if len(tokens) == max_nodes + 1:
                        return tokens, parents
                    children[node, token] = len(tokens)
                    tokens.append(token)
                    parents.append(node)
                node = children[node, token]
            matches += len(tokens) > before
            if len(tokens) == max_nodes + 1 or matches == max_matches:
                return tokens, parents
    return tokens, parents


@pytest.mark.parametrize(
    "options",
    [
        dict(),  # the defaults: 3..1-grams, 8 tokens, 4 matches
        dict(max_ngram=4, min_ngram=2, draft_len=5, max_matches=3, max_nodes=7),
        dict(max_ngram=2, min_ngram=2, draft_len=3, max_matches=1),
        dict(max_ngram=1, min_ngram=1, draft_len=1, max_matches=2),  # one token each: many duplicate matches
    ],
)
def test_incremental_index_matches_brute_force(options):
    rng = random.Random(1234)
    proposer = NgramIndex(**options)
    full = dict(max_ngram=3, min_ngram=1, draft_len=8, max_matches=4) | options
    full.setdefault("max_nodes", full["draft_len"] * full["max_matches"])
    branching = 0
    for vocab in [2, 3, 5, 20]:
        proposer.reset()
        history = [rng.randrange(vocab) for _ in range(rng.randint(0, 10))]
        while len(history) < 300:
            got = proposer.propose(history)
            assert got == brute_force(history, **full), (vocab, len(history))
            assert got == NgramIndex(**options).propose(history)  # a fresh index agrees too
            tokens, parents = got
            check_parents(parents)
            assert len(tokens) == len(parents) <= full["max_nodes"] + 1
            branching += len(set(parents)) < len(parents)
            history += [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
    if full["max_matches"] > 1:
        assert branching, "the property test should see branching trees"
