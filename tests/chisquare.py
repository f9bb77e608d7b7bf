"""Chi-square checks used to show that sampling is exact (the tests: test_verify, test_speculate, the methods' and
the batched engine's, and test_real_bundle on a real bundle)."""

from __future__ import annotations

import numpy as np

from specexport.runtime.sampling import SamplingParams

Z_1E4 = 3.719  # standard normal quantile for an upper tail of 1e-4


def statistic(observed, expected) -> float:
    """Pearson's statistic over cells with a positive expectation."""
    observed, expected = np.asarray(observed, dtype=float), np.asarray(expected, dtype=float)
    keep = expected > 0
    return float(((observed[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def threshold(dof: int, z: float = Z_1E4) -> float:
    """Chi-square quantile for `dof` degrees of freedom at the tail given by z (Wilson-Hilferty)."""
    return dof * (1 - 2 / (9 * dof) + z * (2 / (9 * dof)) ** 0.5) ** 3


def two_sample(a: dict, b: dict, min_count: int = 10) -> tuple[float, int]:
    """(statistic, dof) that two samples of outcome counts come from one distribution.

    Outcomes seen fewer than `min_count` times in both samples together are pooled into one cell.
    """
    rows, rest = [], [0, 0]
    for key in set(a) | set(b):
        x, y = a.get(key, 0), b.get(key, 0)
        if x + y >= min_count:
            rows.append((x, y))
        else:
            rest[0] += x
            rest[1] += y
    if sum(rest):
        rows.append(tuple(rest))
    observed = np.array(rows, dtype=float)
    expected = observed.sum(1, keepdims=True) * observed.sum(0, keepdims=True) / observed.sum()
    return statistic(observed, expected), len(rows) - 1


def sampled_counts(engine, prompt: str, plain: bool, n: int, seed0: int, tokens: int = 3, scheduler=None,
                   **sampling) -> tuple[dict, list[int]]:
    """Counts of the tokens after the first (they come from speculative steps, or plain decoding's when `plain`)
    over `n` generations seeded seed0, seed0 + 1, ..., and every step's accept length. `sampling` holds
    SamplingParams fields. `scheduler` (runtime/scheduler.py, on `engine`): the n generations are submitted at
    once and batched, unseeded, so that the batch's tree budget may cut their trees too."""
    if scheduler is not None:
        requests = [scheduler.submit(prompt, max_new_tokens=tokens, stop_ids=(), sampling=SamplingParams(**sampling))
                    for _ in range(n)]
        if scheduler._thread is None:
            scheduler.run_until_idle()
        results = [r.result() for r in requests]
    else:
        results = (engine.generate(prompt, max_new_tokens=tokens, stop_ids=(), plain=plain,
                                   sampling=SamplingParams(seed=seed0 + i, **sampling)) for i in range(n))
    counts, lengths = {}, []
    for result in results:
        key = tuple(result.tokens[1:])
        counts[key] = counts.get(key, 0) + 1
        lengths += result.stats.accept_lengths
    return counts, lengths
