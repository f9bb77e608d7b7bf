"""Accept: hand-worked greedy and sampling cases, validation, seeded determinism, and one
statistical test per sampling rule that the first two emitted tokens follow the target exactly,
with a deliberately broken rule to show that the same test would fail."""

import chisquare
import numpy as np
import pytest

from specexport.runtime import verify
from specexport.runtime.tree import AcceptMode, chain, children
from specexport.runtime.verify import Acceptance, accept_chain, accept_greedy, accept_tree, uniforms_shape

# ---------------------------------------------------------------------------------------------
# Greedy

#          0 (root, token 9)       node: token
#        /   \                     1: 4    2: 5
#       1     2                    3: 6    4: 7    5: 8
#      / \    |
#     3   4   5
BRANCHY = [-1, 0, 0, 1, 1, 2]
BRANCHY_TOKENS = [9, 4, 5, 6, 7, 8]


@pytest.mark.parametrize(
    "argmax, path, emitted",
    [
        ([5, 0, 8, 0, 0, 3], [0, 2, 5], [5, 8, 3]),  # right branch to the leaf; bonus = argmax at 5
        ([4, 7, 0, 0, 2, 0], [0, 1, 4], [4, 7, 2]),  # left branch, second child of 1
        ([4, 1, 0, 0, 0, 0], [0, 1], [4, 1]),  # accept 1, no child of 1 matches: bonus argmax[1]
        ([3, 4, 5, 6, 7, 8], [0], [3]),  # nothing matches at the root: accept length 1
    ],
    ids=["right_to_leaf", "left_second_child", "stop_at_depth_1", "no_match"],
)
def test_greedy_branchy(argmax, path, emitted):
    got = accept_greedy(BRANCHY_TOKENS, BRANCHY, argmax)
    assert got == Acceptance(path, emitted)
    assert got.accept_length == len(emitted)


def test_greedy_duplicate_siblings_take_the_first():
    #      0            nodes 1 and 2 both hold token 4; only 2's subtree would match deeper,
    #    /   \          but siblings are tested in index order, so 1 wins.
    #   1(4)  2(4)
    #   |     |
    #   3(7)  4(8)
    got = accept_greedy([9, 4, 4, 7, 8], [-1, 0, 0, 1, 2], [4, 6, 8, 0, 0])
    assert got == Acceptance([0, 1], [4, 6])


def test_greedy_full_chain_and_root_only():
    assert accept_greedy([1, 2, 3, 4], chain(4), [2, 3, 4, 5]) == Acceptance([0, 1, 2, 3], [2, 3, 4, 5])
    assert accept_greedy([1], [-1], [7]) == Acceptance([0], [7])
    assert accept_greedy(np.array([1, 2]), np.array([-1, 0]), np.array([2, 0])).tokens == [2, 0]


def test_greedy_is_topk_with_one_hot_target():
    """A greedy target is the one-hot limit of the topk rule, whatever the uniforms."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        parents = [-1] + [int(rng.integers(i)) for i in range(1, 8)]
        tokens = rng.integers(3, size=8)
        argmax = rng.integers(3, size=8)
        one_hot = np.eye(3)[argmax]
        got = accept_tree(tokens, parents, one_hot, None, rng.random(uniforms_shape(parents)), "topk")
        assert got == accept_greedy(tokens, parents, argmax)


# ---------------------------------------------------------------------------------------------
# Sampling rules, worked by hand. p, q rows not used by a case are filled with a uniform row.

FLAT = [0.25, 0.25, 0.25, 0.25]


def test_chain_accept_and_reject():
    # p = [.5, .5, 0], q = [1, 0, 0], draft token 0: accept with probability p/q = 0.5.
    p = [[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]]
    q = [[1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]]
    # u = 0.4 < 0.5: accept; the bonus is drawn from p[1] with u[1, -1] = 0.9 -> token 2.
    assert accept_chain([2, 0], p, q, [[0.4, 0.0], [0.0, 0.9]]) == Acceptance([0, 1], [0, 2])
    # u = 0.6: reject; the residual max(0, p - q) = [0, .5, 0] normalises to [0, 1, 0] -> token 1 for any u.
    for u_final in (0.0, 0.5, 0.999):
        assert accept_chain([1, 0], p, q, [[0.6, u_final], [0.0, 0.9]]) == Acceptance([0], [1])


def test_chain_full_acceptance_gives_bonus_from_last_row():
    # p >= q at every draft token: accepted whatever u; bonus ~ p[2] = [.1, .2, .7]: u = .25 -> token 1.
    p = [[0.1, 0.9, 0.0], [0.0, 0.0, 1.0], [0.1, 0.2, 0.7]]
    q = [[0.5, 0.5, 0.0], [0.5, 0.0, 0.5], FLAT[:3]]
    assert accept_chain([0, 1, 2], p, q, [[0.99, 0], [0.99, 0], [0, 0.25]]) == Acceptance([0, 1, 2], [1, 2, 1])


P4 = [0.1, 0.4, 0.3, 0.2]
Q4 = [0.4, 0.1, 0.2, 0.3]


def test_with_replacement_repeated_sibling_still_updates_the_residual():
    """Two i.i.d. drafts of token 0 under the root; both rejected.

    1st: u q(0) = .36 > p(0) = .1: reject; p1 = max(0, p - q) / .4 = [0, .75, .25, 0].
    2nd: p1(0) = 0: reject; p2 = max(0, p1 - q) / .7 = [0, 13/14, 1/14, 0].
    Final u = .9 < 13/14 -> token 1 (skipping the repeat would have given p1 and token 2).
    """
    p = [P4, FLAT, FLAT]
    q = [Q4, FLAT, FLAT]
    got = accept_tree([3, 0, 0], [-1, 0, 0], p, q, [[0.9, 0.0, 0.9], [0] * 3, [0] * 3], "with_replacement")
    assert got == Acceptance([0], [1])


def test_without_replacement_zeroes_the_rejected_draft():
    """Drafts 0 then 2 under the root, drawn without replacement from q = [.4, .1, .2, .3].

    1st: u q(0) = .2 > .1: reject; p1 = [0, .75, .25, 0], q1 = [0, .1, .2, .3] / .6 = [0, 1/6, 1/3, 1/2].
    2nd: accept with p1(2) / q1(2) = .75: u = .7 accepts (bonus from p[2] = [0, 0, 0, 1] -> 3),
    u = .8 rejects (with replacement it would accept: p1(2) = .25 > q(2) = .2), and the
    residual max(0, p1 - q1) = [0, 7/12, 0, 0] -> token 1.
    """
    p = [P4, FLAT, [0, 0, 0, 1]]
    q = [Q4, FLAT, FLAT]
    tokens, parents = [3, 0, 2], [-1, 0, 0]
    assert accept_tree(tokens, parents, p, q, [[0.5, 0.7, 0], [0] * 3, [0, 0, 0.5]], "without_replacement") == Acceptance([0, 2], [2, 3])
    assert accept_tree(tokens, parents, p, q, [[0.5, 0.8, 0.5], [0] * 3, [0] * 3], "without_replacement") == Acceptance([0], [1])
    assert accept_tree(tokens, parents, p, q, [[0.5, 0.8, 0.5], [0] * 3, [0] * 3], "with_replacement") == Acceptance([0, 2], [2, 3])


def test_without_replacement_skips_a_draft_it_could_not_have_drawn():
    """After rejecting 0, q1(0) = 0: a second 0 cannot come from the assumed draw, so it is skipped."""
    p = [P4, FLAT, FLAT]
    q = [Q4, FLAT, FLAT]
    u = [[0.5, 0.0, 0.7], [0] * 3, [0] * 3]
    # residual after one rejection: [0, .75, .25, 0]; final u = .7 -> token 1 (with a second update it would be 13/14 vs 1/14).
    assert accept_tree([3, 0, 0], [-1, 0, 0], p, q, u, "without_replacement") == Acceptance([0], [1])
    assert accept_tree([3, 0], [-1, 0], p[:2], q[:2], [[0.5, 0.7], [0, 0]], "without_replacement") == Acceptance([0], [1])


def test_topk_point_mass_candidates():
    """Candidates 1 then 2 under the root, p = [.1, .4, .3, .2].

    1st: u = .5 >= p(1) = .4: reject; p1 = [.1, 0, .3, .2] / .6 = [1/6, 0, 1/2, 1/3].
    2nd: u = .45 < .5 accepts; u = .55 rejects: p2 = [1/3, 0, 0, 2/3]: final u = .3 -> 0, u = .4 -> 3.
    """
    p = [P4, FLAT, [0, 1, 0, 0]]
    tokens, parents = [0, 1, 2], [-1, 0, 0]
    assert accept_tree(tokens, parents, p, None, [[0.5, 0.45, 0], [0] * 3, [0, 0, 0]], "topk") == Acceptance([0, 2], [2, 1])
    assert accept_tree(tokens, parents, p, None, [[0.5, 0.55, 0.3], [0] * 3, [0] * 3], "topk") == Acceptance([0], [0])
    assert accept_tree(tokens, parents, p, None, [[0.5, 0.55, 0.4], [0] * 3, [0] * 3], "topk") == Acceptance([0], [3])


def test_topk_duplicate_candidate_is_never_accepted():
    # 1 rejected (u = .5 >= .4), then 1 again: p1(1) = 0, so even u = 0 rejects; p1 is unchanged -> u = .3: token 2.
    p = [P4, FLAT, FLAT]
    assert accept_tree([0, 1, 1], [-1, 0, 0], p, None, [[0.5, 0.0, 0.3]] + [[0] * 3] * 2, "topk") == Acceptance([0], [2])


def test_root_only_draws_from_p():
    assert accept_tree([3], [-1], [P4], [Q4], [[0.45]], "with_replacement") == Acceptance([0], [1])
    assert accept_chain([3], [P4], [Q4], [[0.95]]) == Acceptance([0], [3])


def test_empty_residual_falls_back_to_p():
    """p == q leaves no residual; a rejection is then impossible except by rounding, and p is used."""
    p = np.array([0.25, 0.75])
    for mode in (AcceptMode.WITH_REPLACEMENT, AcceptMode.WITHOUT_REPLACEMENT):
        residual, _ = verify._reject(p, p, 0, mode)
        np.testing.assert_array_equal(residual, p)
    residual, _ = verify._reject(np.array([0.0, 1.0]), None, 1, AcceptMode.TOPK)
    np.testing.assert_array_equal(residual, [0.0, 1.0])
    _, q1 = verify._reject(p, np.array([1.0, 0.0]), 0, AcceptMode.WITHOUT_REPLACEMENT)
    np.testing.assert_array_equal(q1, [0.0, 0.0])  # nothing left to draw: later siblings are skipped


def test_chain_is_the_tree_rule_on_a_chain():
    rng = np.random.default_rng(3)
    for _ in range(50):
        p, q = rng.dirichlet(np.ones(4), size=(2, 5))
        tokens, u = rng.integers(4, size=5), rng.random((5, 2))
        got = accept_chain(tokens, p, q, u)
        assert got == accept_tree(tokens, chain(5), p, q, u, "with_replacement")
        assert got == accept_tree(tokens, chain(5), p, q, u, "without_replacement")


def test_seeded_determinism_and_inputs_untouched():
    parents = [-1, 0, 0, 0, 1, 1, 2]
    rng = np.random.default_rng(0)
    p, q = rng.dirichlet(np.ones(6), size=(2, 7))
    tokens = rng.integers(6, size=7)
    p0, q0 = p.copy(), q.copy()
    for mode in verify.MODES:
        runs = [accept_tree(tokens, parents, p, q, np.random.default_rng(42).random((7, 4)), mode) for _ in range(3)]
        assert runs[0] == runs[1] == runs[2]
    np.testing.assert_array_equal(p, p0)
    np.testing.assert_array_equal(q, q0)


def test_uniforms_shape():
    assert uniforms_shape([-1, 0, 0, 0, 1, 1, 2]) == (7, 4)
    assert uniforms_shape(chain(4)) == (4, 2)
    assert uniforms_shape([-1]) == (1, 1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(uniforms=np.zeros((3, 2))), r"uniforms must have shape \(3, 3\)"),
        (dict(uniforms=np.zeros((2, 3))), r"uniforms must have shape \(3, 3\)"),
        (dict(uniforms=np.ones((3, 3))), r"uniforms must lie in \[0, 1\)"),
        (dict(mode="greedy"), "mode must be one of"),
        (dict(parents=[-1, -1, 0]), "row 0 must be the only root"),
        (dict(parents=[-1, 0, 2]), "not a tree in topological order"),
        (dict(tokens=[0, 1]), r"tokens must have shape \[3\]"),
        (dict(tokens=[0, 1, 4]), r"tokens must lie in \[0, 4\)"),
        (dict(tokens=[0.0, 1.0, 2.0]), "tokens must be integers"),
        (dict(p=np.full((2, 4), 0.25)), r"p must have shape \[3, V\]"),
        (dict(q=None), r"q must have shape \[3, V\]"),
        (dict(q=np.full((3, 5), 0.2)), r"q has shape \(3, 5\), p has \(3, 4\)"),
    ],
)
def test_invalid_arguments(kwargs, match):
    args = dict(tokens=[0, 1, 2], parents=[-1, 0, 0], p=np.full((3, 4), 0.25), q=np.full((3, 4), 0.25),
                uniforms=np.zeros((3, 3)), mode="with_replacement")
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        accept_tree(**args)


def test_invalid_greedy_arguments():
    with pytest.raises(ValueError, match=r"target_argmax must have shape \[3\]"):
        accept_greedy([0, 1, 2], [-1, 0, 0], [0, 1])
    with pytest.raises(ValueError, match="row 0 must be the only root"):
        accept_greedy([0, 1], [-1, -1], [0, 1])
    with pytest.raises(ValueError, match=r"uniforms must have shape \(2, 2\)"):
        accept_chain([0, 1], [P4, P4], [Q4, Q4], [[0.5], [0.5]])


# ---------------------------------------------------------------------------------------------
# Statistics: simulate decoding until two tokens are emitted (a second step when the first emits
# one), with a target and a draft whose distributions depend on the whole context, and compare
# the joint of the first two emitted tokens with the target's joint by a chi-square statistic.

V = 5
TRIALS = 20_000
TREE = [-1, 0, 0, 0, 1, 1, 2]  # root with 3 candidates; 2 under the first, 1 under the second


def _tables(seed, floor, alpha=1.0):
    """A distribution for every context of up to 4 tokens: table[L][ctx] is a row [V]."""
    rng = np.random.default_rng(seed)
    return [floor / V + (1 - floor) * rng.dirichlet(np.full(V, alpha), size=(V,) * n) for n in range(5)]


TARGET = _tables(1, floor=0.2)  # every joint cell keeps an expected count >= TRIALS * 0.04^2 = 32
DRAFT = _tables(2, floor=0.05, alpha=0.3)  # peaked, as drafts are: repeats and removals matter


def _rows(table, ctx):
    """Rows [n, V] for contexts ctx [n, L]."""
    return table[ctx.shape[1]][tuple(ctx.T)]


def _draw(q, k, mode, rng):
    """k children per row of q [n, V], drawn the way `mode` assumes: [n, k]."""
    if mode == "with_replacement":
        cdf = np.cumsum(q, axis=1)
        return np.minimum((rng.random((len(q), k, 1)) * cdf[:, None, -1:] >= cdf[:, None, :]).sum(-1), V - 1)
    if mode == "without_replacement":  # Gumbel top-k = successive draws without replacement
        return np.argsort(-(np.log(q) - np.log(-np.log(rng.random(q.shape)))), axis=1)[:, :k]
    return np.argsort(-q, axis=1, kind="stable")[:, :k]  # topk: deterministic


def _drafts(parents, ctx, mode, rng):
    """Trees of drafts after contexts ctx [n, L]: tokens [n, T], p and q [n, T, V]."""
    n, t = len(ctx), len(parents)
    tokens, p, q = np.zeros((n, t), np.int64), np.empty((n, t, V)), np.empty((n, t, V))
    contexts = [ctx] + [None] * (t - 1)
    for r, kids in enumerate(children(parents)):
        p[:, r], q[:, r] = _rows(TARGET, contexts[r]), _rows(DRAFT, contexts[r])
        if kids:
            drawn = _draw(q[:, r], len(kids), mode, rng)
            for j, c in enumerate(kids):
                tokens[:, c] = drawn[:, j]
                contexts[c] = np.column_stack([contexts[r], drawn[:, j]])
    return tokens, p, q


def _step(rule, ctx, rng):
    """One propose/accept step per context: the emitted tokens of each."""
    parents, mode = (chain(4), "with_replacement") if rule == "chain" else (TREE, rule)
    tokens, p, q = _drafts(parents, ctx, mode, rng)
    u = rng.random((len(ctx),) + uniforms_shape(parents))
    if rule == "chain":
        return [accept_chain(tokens[i], p[i], q[i], u[i]).tokens for i in range(len(ctx))]
    return [accept_tree(tokens[i], parents, p[i], q[i], u[i], mode).tokens for i in range(len(ctx))]


def _first_two(rule, n, seed):
    rng = np.random.default_rng(seed)
    first = _step(rule, np.zeros((n, 0), np.int64), rng)
    pairs = np.array([e[:2] if len(e) > 1 else [e[0], -1] for e in first])
    again = np.flatnonzero(pairs[:, 1] < 0)  # one token emitted: its next comes from a new step
    pairs[again, 1] = [e[0] for e in _step(rule, pairs[again, :1], rng)]
    return pairs


def _chi2(pairs):
    """Chi-square statistics of the first token against p(root) and of the pair against the joint."""
    n = len(pairs)
    joint = TARGET[0][:, None] * TARGET[1]  # [x1, x2]
    seen = np.zeros((V, V))
    np.add.at(seen, (pairs[:, 0], pairs[:, 1]), 1)

    return chisquare.statistic(seen.sum(1), n * TARGET[0]), chisquare.statistic(seen, n * joint)


_real_reject = verify._reject


def _unnormalised_residual(p, q):
    """max(0, p - q) without renormalising (p when empty, as the real rule does)."""
    residual = np.maximum(p - q, 0)
    return residual if residual.any() else p
BROKEN = {  # one plausible bug per rule, patched into verify._reject
    "chain": lambda p, q, x, mode: (p, q),  # the correction is drawn from p, not the residual
    "with_replacement": lambda p, q, x, mode: (_unnormalised_residual(p, q), q),
    "without_replacement": lambda p, q, x, mode: _real_reject(p, q, x, AcceptMode.WITH_REPLACEMENT),  # q[x] kept
    "topk": lambda p, q, x, mode: (p, q),  # the rejected candidate stays in p
}


@pytest.mark.parametrize("rule", list(BROKEN))
def test_first_two_tokens_follow_the_target(rule):
    first, joint = _chi2(_first_two(rule, TRIALS, seed=10))
    assert first < chisquare.threshold(V - 1), first
    assert joint < chisquare.threshold(V * V - 1), joint


@pytest.mark.parametrize("rule", list(BROKEN))
def test_statistic_catches_a_broken_rule(rule, monkeypatch):
    """Each bug moves the statistic to several times the threshold, with a quarter of the trials."""
    monkeypatch.setattr(verify, "_reject", BROKEN[rule])
    _, joint = _chi2(_first_two(rule, TRIALS // 4, seed=10))
    assert joint > chisquare.threshold(V * V - 1), joint


def test_typical_acceptance_hand_worked():
    """Medusa's typical rule: accept x when p(x) > min(threshold, alpha * exp(-H)); lossy by design."""
    from specexport.runtime.verify import accept_typical

    p = np.array([[0.05, 0.90, 0.05], [0.30, 0.30, 0.40], [1 / 3, 1 / 3, 1 / 3]])
    # row 0 is peaked (H = 0.39): bar = min(0.09, 0.3 * e^-0.39 = 0.20) = 0.09, so token 1 (0.90) passes, 0 (0.05) not
    # row 1 is flat (H = 1.09): bar = min(0.09, 0.3 * e^-1.09 = 0.10) = 0.09, so token 2 (0.40) passes
    tokens, parents = [7, 1, 2], [-1, 0, 1]
    u = np.zeros((3, 2))
    assert accept_typical(tokens, parents, p, u) == Acceptance([0, 1, 2], [1, 2, 0])  # then a draw at row 2 (u=0)
    assert accept_typical([7, 0, 2], parents, p, u) == Acceptance([0], [0])  # 0.05 < 0.09: stop, draw at row 0
    # a high threshold with a flat row rejects everything
    assert accept_typical(tokens, parents, p, u, threshold=0.95, alpha=10.0) == Acceptance([0], [0])
