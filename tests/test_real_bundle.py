"""Checks on a bundle you built, named by SPECEXPORT_TEST_BUNDLE (skipped without it): batching changes no request's
tokens, and speculative sampling follows plain sampling's distribution. A real bundle takes minutes; fp32 is where
batched tokens must equal the tokens alone (quantized calls couple their rows: docs/precision.md).

    specexport build --model smollm2-135m --method suffix --precision fp32 --output smol-suffix-fp32
    SPECEXPORT_TEST_BUNDLE=smol-suffix-fp32 .venv/bin/python -m pytest tests/test_real_bundle.py -q

Settings, from the environment (defaults in brackets): SPECEXPORT_TEST_PROMPTS, prompts taken from each of
benchmarks/prompts/sharegpt40.jsonl and humaneval40.jsonl [40]; SPECEXPORT_TEST_NEW_TOKENS [128];
SPECEXPORT_TEST_MAX_BATCH [8]; SPECEXPORT_TEST_SEEDED, the first K prompts also sampled with a seed inside the batch of
greedy ones [4]; SPECEXPORT_TEST_DEVICE, the batched engine's device: cpu, cuda, or cpu-iobinding (the device path run
on the CPU) [cpu]; SPECEXPORT_TEST_SAMPLES, generations per side of each chi-square test [600].
"""

import dataclasses
import os
from pathlib import Path

import chisquare
import pytest

from specexport.runtime.bench import read_prompts
from specexport.runtime.generate import Engine
from specexport.runtime.sampling import SamplingParams
from specexport.runtime.scheduler import Scheduler

BUNDLE = os.environ.get("SPECEXPORT_TEST_BUNDLE")
pytestmark = pytest.mark.skipif(not BUNDLE, reason="SPECEXPORT_TEST_BUNDLE names no bundle")
PROMPTS = Path(__file__).parent.parent / "benchmarks" / "prompts"
# text to copy, so that prompt lookup and drafts are often right and the speculative path is exercised
COPY_PROMPT = ("Repeat this sentence three times: The quick brown fox jumps over the lazy dog while the cat "
               "sleeps in the warm afternoon sun.")


def setting(name: str, default):
    return type(default)(os.environ.get(f"SPECEXPORT_TEST_{name}", default))


@pytest.fixture(scope="module")
def engine():
    return Engine.load(BUNDLE, threads=len(os.sched_getaffinity(0)), device="cpu")


def first_difference(a: list[int], b: list[int]) -> int | None:
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


@pytest.mark.parametrize("file", ["sharegpt40.jsonl", "humaneval40.jsonl"])
def test_batched_tokens_equal_the_tokens_alone(engine, file):
    """Each prompt alone (`Engine.generate`, what `specexport run` does), then all at once on one batched engine
    (`SPECEXPORT_TEST_MAX_BATCH` running, the rest queued), greedy with EOS suppressed, and the first K prompts also
    sampled with a seed among them: every request's tokens equal its run alone."""
    prompts = [p["prompt"] for p in read_prompts(PROMPTS / file)][:setting("PROMPTS", 40)]
    new_tokens, device = setting("NEW_TOKENS", 128), setting("DEVICE", "cpu")
    jobs = [(p, None) for p in prompts]
    jobs += [(p, SamplingParams(temperature=0.8, top_p=0.95, seed=k))
             for k, p in enumerate(prompts[:setting("SEEDED", 4)])]
    alone = [engine.generate(p, max_new_tokens=new_tokens, sampling=s, stop_ids=()).tokens for p, s in jobs]
    batching = engine if device == "cpu" else Engine.load(BUNDLE, device=device)
    scheduler = Scheduler(batching, max_batch=setting("MAX_BATCH", 8))
    try:
        requests = [scheduler.submit(p, max_new_tokens=new_tokens, sampling=s, stop_ids=()) for p, s in jobs]
        batched = [r.result(timeout=3600).tokens for r in requests]
    finally:
        scheduler.close()
    differing = {k: f for k, (a, b) in enumerate(zip(alone, batched)) if (f := first_difference(a, b)) is not None}
    assert not differing, (f"{len(differing)} of {len(jobs)} requests differ batched (request: first differing "
                           f"token; requests from {len(prompts)} on are the seeded ones): {differing}")


@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("mode", ["in-graph", "outside-graph", "batched", "batched-fixed"])
def test_sampling_follows_plain_sampling(engine, mode, temperature):
    """N generations of a few tokens sampled with the bundle's method and N with plain decoding (other seeds): the
    tokens after the first (made by speculative steps) have the same distribution, by a two-sample chi-square test at
    a 1e-4 tail. `outside-graph`: accepted by the runtime's rule on the step's logits, not in the graph; `batched`:
    through the batched engine, 8 at once, unseeded, with the batch's tree budget (which may cut the trees or skip
    drafting); `batched-fixed`: every tree whole."""
    n = setting("SAMPLES", 600)
    scheduler = None
    if mode.startswith("batched"):
        scheduler = Scheduler(engine, max_batch=8, budget=mode == "batched", background=False)
    saved = engine.accepting
    if mode == "outside-graph":
        engine.accepting = dataclasses.replace(engine.accepting, graph=False)
    try:
        spec, lengths = chisquare.sampled_counts(engine, COPY_PROMPT, False, n, 0, 3, scheduler,
                                                 temperature=temperature)
        plain, _ = chisquare.sampled_counts(engine, COPY_PROMPT, True, n, 10**6, 3, temperature=temperature)
    finally:
        engine.accepting = saved
        if scheduler is not None:
            scheduler.close()
    stat, dof = chisquare.two_sample(spec, plain)
    limit = chisquare.threshold(dof) if dof > 0 else float("inf")
    tau = sum(lengths) / max(len(lengths), 1)
    assert stat < limit, f"chi2 {stat:.1f} over its limit {limit:.1f} (dof {dof}), tau {tau:.2f}"
