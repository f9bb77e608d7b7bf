"""Sampling: hand-worked masks, validation, determinism, and one distribution test."""

import math

import numpy as np
import pytest

from specexport.errors import UserError
from specexport.runtime.sampling import (
    Context,
    Sampler,
    SamplingParams,
    TokenLogprob,
    conditioned,
    logprobs,
    probabilities,
    sample,
)

LOG_P = np.log([0.1, 0.4, 0.2, 0.3])  # softmax(LOG_P) == [0.1, 0.4, 0.2, 0.3]


def P(**kw):
    return SamplingParams(temperature=kw.pop("temperature", 1.0), **kw)


def test_plain_softmax():
    np.testing.assert_allclose(probabilities(LOG_P, P()), [0.1, 0.4, 0.2, 0.3])


def test_greedy_is_one_hot_at_first_max():
    np.testing.assert_array_equal(probabilities([1.0, 3.0, 3.0, 0.0], SamplingParams()), [0, 1, 0, 0])


def test_temperature_scales_logits():
    # T=2 halves the logits: softmax([0, 2]/2) = [1, e] / (1 + e)
    e = math.e
    np.testing.assert_allclose(probabilities([0.0, 2.0], P(temperature=2.0)), [1 / (1 + e), e / (1 + e)])
    # T=0.5 doubles them: p ∝ p0^2 = [0.01, 0.16, 0.04, 0.09] / 0.30
    np.testing.assert_allclose(probabilities(LOG_P, P(temperature=0.5)), np.array([1, 16, 4, 9]) / 30)


def test_top_k_mask():
    np.testing.assert_allclose(probabilities(LOG_P, P(top_k=2)), [0, 4 / 7, 0, 3 / 7])
    np.testing.assert_allclose(probabilities(LOG_P, P(top_k=1)), [0, 1, 0, 0])
    np.testing.assert_allclose(probabilities(LOG_P, P(top_k=9)), [0.1, 0.4, 0.2, 0.3])


def test_top_k_keeps_ties_with_kth():
    np.testing.assert_allclose(probabilities([0.0, 1.0, 1.0, -1.0], P(top_k=2)), [0, 0.5, 0.5, 0])


def test_top_p_mask():
    # sorted: 0.4, 0.3, 0.2, 0.1 -> cumulative 0.4, 0.7, 0.9, 1.0
    np.testing.assert_allclose(probabilities(LOG_P, P(top_p=0.4)), [0, 1, 0, 0])
    np.testing.assert_allclose(probabilities(LOG_P, P(top_p=0.5)), [0, 4 / 7, 0, 3 / 7])
    np.testing.assert_allclose(probabilities(LOG_P, P(top_p=0.75)), [0, 4 / 9, 2 / 9, 3 / 9])
    np.testing.assert_allclose(probabilities(LOG_P, P(top_p=0.95)), [0.1, 0.4, 0.2, 0.3])
    np.testing.assert_allclose(probabilities(LOG_P, P(top_p=1e-9)), [0, 1, 0, 0])


def test_top_k_then_top_p():
    # top_k=3 -> [0, 4, 2, 3] / 9; cumulative 4/9, 7/9 -> top_p=0.6 keeps 0.4 and 0.3
    np.testing.assert_allclose(probabilities(LOG_P, P(top_k=3, top_p=0.6)), [0, 4 / 7, 0, 3 / 7])


def test_min_p_keeps_tokens_near_the_most_likely():
    # 0.5 x 0.4 = 0.2: keeps 0.4, 0.3 and 0.2 (ties with the threshold kept); 0.8 x 0.4 = 0.32 keeps 0.4 alone
    np.testing.assert_allclose(probabilities(LOG_P, P(min_p=0.5)), [0, 4 / 9, 2 / 9, 3 / 9])
    np.testing.assert_allclose(probabilities(LOG_P, P(min_p=0.8)), [0, 1, 0, 0])
    # after top_p=0.75 ([0, 4, 2, 3] / 9): min_p 0.6 keeps those >= 0.6 x 4/9, i.e. 4/9 and 3/9
    np.testing.assert_allclose(probabilities(LOG_P, P(top_p=0.75, min_p=0.6)), [0, 4 / 7, 0, 3 / 7])
    np.testing.assert_array_equal(probabilities(LOG_P, SamplingParams(min_p=0.9)), [0, 1, 0, 0])  # greedy: nothing
    assert P(min_p=0.1).host_only and not SamplingParams(min_p=0.1).host_only


def test_logit_bias_comes_first_greedy_or_sampled():
    # +ln 4 on token 0: [0.4, 0.4, 0.2, 0.3] / 1.3; greedy takes the first maximum
    biased = SamplingParams(logit_bias=((0, math.log(4)),))
    np.testing.assert_array_equal(probabilities(LOG_P, biased), [1, 0, 0, 0])
    assert Sampler(biased)(LOG_P) == 0 and Sampler(SamplingParams())(LOG_P) == 1
    np.testing.assert_allclose(probabilities(LOG_P, P(logit_bias=((0, math.log(4)),))), np.array([4, 4, 2, 3]) / 13)
    np.testing.assert_allclose(probabilities(LOG_P, P(logit_bias=((1, -100.0),)))[1], 0, atol=1e-40)
    assert biased.host_only
    with pytest.raises(UserError, match="token id 4 is past the vocabulary"):
        probabilities(LOG_P, SamplingParams(logit_bias=((4, 1.0),)))


def test_penalties_follow_the_history_and_each_rows_path():
    logits = np.array([2.0, -1.0, 0.5, 1.0, 0.0])
    context = Context([0, 3, 3, 1], 1)  # prompt [0]; output so far [3, 3, 1]
    # repetition 2 on the tokens seen (0, 1, 3; the prompt's too): 2 -> 1, -1 -> -2, 1 -> 0.5
    np.testing.assert_allclose(conditioned(logits, P(repetition_penalty=2.0), context), [1, -2, 0.5, 0.5, 0])
    # frequency 0.5 x the output's counts (3 twice, 1 once; not the prompt's 0), presence 0.25 once each
    np.testing.assert_allclose(conditioned(logits, P(frequency_penalty=0.5, presence_penalty=0.25), context),
                               [2, -1.75, 0.5, -0.25, 0])
    # rows of a tree: row 1 follows the path [2], row 2 the path [2, 2]; row 0 the history alone
    rows = conditioned(np.tile(logits, (3, 1)), P(frequency_penalty=1.0), context, [[], [2], [2, 2]])
    np.testing.assert_allclose(rows[:, 2], [0.5, -0.5, -1.5])
    np.testing.assert_allclose(rows[:, 3], [-1.0, -1.0, -1.0])
    assert conditioned(logits, P(), context) is logits  # none: the same array
    # the sampler and greedy decoding see the penalised row: [0.9, -1, 0.5, 1, 0] -> [0.45, -2.6, 0.5, -0.1, 0]
    greedy, row = SamplingParams(repetition_penalty=2.0, presence_penalty=0.6), np.array([0.9, -1.0, 0.5, 1.0, 0.0])
    assert Sampler(greedy)(row, context) == 2 and Sampler(SamplingParams())(row, context) == 3
    assert greedy.conditional and greedy.host_only and not SamplingParams().conditional


def test_min_tokens_keeps_the_stop_ids_out_until_the_output_is_long_enough():
    # 3 output tokens so far, min_tokens 5: rows at depth 0 and 1 (outputs 4 and 5) cannot end; depth 2 can
    context = Context([0, 3, 3, 1], 1, stop_ids={0, 4})
    rows = conditioned(np.zeros((3, 5)), SamplingParams(min_tokens=5), context, [[], [2], [2, 2]])
    assert np.isneginf(rows[:2, [0, 4]]).all() and np.isfinite(rows[:2, 1:4]).all() and np.isfinite(rows[2]).all()
    ends_at_0 = Context([0, 3, 3, 1], 1, stop_ids={0})
    assert Sampler(SamplingParams(min_tokens=4))(np.array([5.0, 0, 0, 0, 1.0]), ends_at_0) == 4  # 0 kept out
    assert Sampler(SamplingParams(min_tokens=3))(np.array([5.0, 0, 0, 0, 1.0]), ends_at_0) == 0  # long enough


def test_top_p_matches_full_sort_on_a_large_vocabulary():
    # rounded logits give many ties; flat to peaked rows put the nucleus inside each probability floor's candidates
    # (sampling.NUCLEUS_FLOORS) and past them all
    rng = np.random.default_rng(3)
    logits = np.round(rng.standard_normal((5, 5000)) * np.array([[0.5], [2], [4], [6], [8]]), 1)
    for top_p in (0.05, 0.5, 0.9, 0.99):
        got = probabilities(logits, P(top_p=top_p))
        probs = probabilities(logits, P())
        order = np.argsort(-probs, axis=-1, kind="stable")
        ranked = np.take_along_axis(probs, order, axis=-1)
        keep = np.zeros_like(probs, dtype=bool)
        np.put_along_axis(keep, order, np.cumsum(ranked, axis=-1) - ranked < top_p, axis=-1)
        expected = np.where(keep, probs, 0) / np.where(keep, probs, 0).sum(axis=-1, keepdims=True)
        np.testing.assert_array_equal(got > 0, expected > 0)
        np.testing.assert_allclose(got, expected, rtol=1e-12)


def test_rows_are_independent():
    logits = np.stack([LOG_P, LOG_P[::-1]]).astype(np.float32)
    expected = np.array([[0, 4 / 7, 0, 3 / 7], [3 / 7, 0, 4 / 7, 0]])
    np.testing.assert_allclose(probabilities(logits, P(top_p=0.5)), expected, rtol=1e-6)
    np.testing.assert_array_equal(probabilities(logits, SamplingParams()), [[0, 1, 0, 0], [0, 0, 1, 0]])


def test_large_logits_are_stable():
    probs = probabilities(np.array([1000.0, 1000.0, -1000.0], dtype=np.float32), P())
    assert probs.dtype == np.float64
    np.testing.assert_allclose(probs, [0.5, 0.5, 0.0])


@pytest.mark.parametrize(
    "kw, word",
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"logit_bias": ((3, 100.5),)}, "logit_bias"),
        ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
        ({"logit_bias": ((2, 1.0), (2, -1.0))}, "logit_bias"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"frequency_penalty": 2.5}, "frequency_penalty"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ],
)
def test_validation(kw, word):
    with pytest.raises(UserError, match=word) as err:
        SamplingParams(**kw)
    assert "\n" not in str(err.value)


def test_greedy_property():
    assert SamplingParams().greedy
    assert not SamplingParams(temperature=0.7).greedy


def test_sample_inverse_cdf():
    probs = np.array([0.1, 0.4, 0.2, 0.3])
    assert [sample(probs, u) for u in (0.0, 0.099, 0.1, 0.49, 0.5, 0.69, 0.7, 0.999)] == [0, 0, 1, 1, 2, 2, 3, 3]


def test_sample_never_picks_zero_probability():
    below_one = np.nextafter(1.0, 0.0)
    assert sample(np.array([0.5, 0.5, 0.0]), below_one) == 1
    assert sample(np.array([0.0, 1.0, 0.0]), 0.0) == 1
    # ten 0.1s sum to 0.9999999999999999: u close to 1 still lands on the last token
    assert sample(np.full(10, 0.1), below_one) == 9
    # unnormalised float32 input is fine too
    assert sample(np.array([0.0, 2.0, 0.0], dtype=np.float32), below_one) == 1


def test_sample_rejects_bad_u():
    with pytest.raises(ValueError):
        sample(np.array([1.0]), 1.0)


def test_sampler_greedy_is_argmax():
    row = np.array([0.5, 2.0, 2.0, -1.0], dtype=np.float32)
    assert Sampler(SamplingParams())(row) == 1


def test_sampler_seeded_determinism():
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((50, 100)).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=1234)
    sampler = Sampler(params)
    first = [sampler(r) for r in rows]
    again = Sampler(params)
    assert [again(r) for r in rows] == first
    other_seed = Sampler(SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=99))
    assert [other_seed(r) for r in rows] != first
    assert len(set(first)) > 1


# --- distribution test --------------------------------------------------------------------

TARGET = np.array([0.05, 0.3, 0.0, 0.25, 0.15, 0.2, 0.05])
CHI2_CRITICAL_DF5_P001 = 20.515  # chi-square quantile, 5 degrees of freedom, p = 0.001


def chi_square(draw, probs, n=100_000, seed=0):
    """Pearson's statistic of `n` draws of `draw(probs, u)` against `probs` (support only)."""
    us = np.random.default_rng(seed).random(n)
    counts = np.bincount([draw(probs, u) for u in us], minlength=len(probs))
    assert counts[probs == 0].sum() == 0, "drew a zero-probability token"
    expected = n * probs[probs > 0]
    return float((((counts[probs > 0] - expected) ** 2) / expected).sum())


def drops_last_token(probs, u):
    """A broken sampler: forgets the last token's mass."""
    return sample(probs[:-1], u)


def test_sample_follows_distribution():
    assert chi_square(sample, TARGET) < CHI2_CRITICAL_DF5_P001


def test_distribution_check_catches_broken_sampler():
    assert chi_square(drops_last_token, TARGET) > CHI2_CRITICAL_DF5_P001


def test_sampler_follows_top_p_distribution():
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    logits = np.log(TARGET + 1e-30).astype(np.float32)
    target = probabilities(logits, params)  # drops the two 0.05 tokens: 0.3, 0.25, 0.2, 0.15
    sampler = Sampler(params)
    n = 40_000
    counts = np.bincount([sampler(logits) for _ in range(n)], minlength=len(TARGET))
    support = target > 0
    assert support.sum() == 4 and counts[~support].sum() == 0
    stat = (((counts[support] - n * target[support]) ** 2) / (n * target[support])).sum()
    assert stat < 16.266  # chi-square quantile, 3 degrees of freedom, p = 0.001


def test_logprobs_are_the_models_log_softmax_with_ties_to_the_lower_id():
    # probabilities 0.5, 0.25, 0.25 (shifted logits: the log-softmax does not see the shift); 2 alternatives: token 1
    # wins the tie with token 2
    row = np.log([0.5, 0.25, 0.25]) + 7.0
    got = logprobs(np.stack([row, row[::-1]]), [2, 0], top=2)
    assert got[0].token == 2 and got[0].logprob == pytest.approx(math.log(0.25))
    assert [i for i, _ in got[0].top] == [0, 1] and got[0].top[1][1] == pytest.approx(math.log(0.25))
    assert [i for i, _ in got[1].top] == [2, 0]  # reversed: 0.25, 0.25, 0.5
    assert logprobs(row[None], [1], top=0) == [TokenLogprob(1, pytest.approx(math.log(0.25)), ())]
    assert len(logprobs(row[None], [1], top=20)[0].top) == 3  # never more than the vocabulary
    assert SamplingParams(logprobs=0).host_only and not SamplingParams(prompt_logprobs=3).host_only
