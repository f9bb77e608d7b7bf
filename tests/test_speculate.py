"""The speculative loop end to end on tiny bundles: lossless greedy, exact sampling, fused acceptance."""

import chisquare
import conftest
import numpy as np
import pytest
from conftest import method_export

from specexport.exporter.export import ExportOptions, export_bundle
from specexport.exporter.graph import GraphOptions
from specexport.exporter.save import write_graph
from specexport.runtime import tree
from specexport.runtime.backends.host import GraphSession
from specexport.runtime.generate import Engine, chunk_logprobs
from specexport.runtime.sampling import SamplingParams, probabilities
from specexport.runtime.verify import accept_greedy, accept_tree, uniforms_shape

PROMPTS = ["hello there hello there hello", "the cat sat on the mat, the cat sat", "x", "abcabcabcabc"]
NEW = 24


def build(folder, out, fused=True, name="none", **given):
    options = ExportOptions(graph=GraphOptions(fused_accept=fused), max_context=128, validate=False,
                            **method_export(name, **given))
    export_bundle(str(folder), out, options, quiet=True)
    return Engine.load(out, threads=1)


@pytest.fixture(scope="module")
def engines(tiny_folder, tmp_path_factory):
    root = tmp_path_factory.mktemp("spec")
    return {
        "ngram": build(tiny_folder, root / "ngram", name="ngram", draft_length=4, max_matches=2),
        "ngram-logits": build(tiny_folder, root / "ngram-logits", fused=False, name="ngram", draft_length=4),
        "self1-tree": build(tiny_folder, root / "self1", name="draft", draft_model="self:1", draft_length=3,
                            draft_branching=(2, 2)),
        "self1-tree-logits": build(tiny_folder, root / "self1-logits", fused=False, name="draft", draft_model="self:1",
                                   draft_length=3, draft_branching=(2, 2)),
        # the target as its own draft: every draft is right, which exercises the bookkeeping fully
        "same-chain": build(tiny_folder, root / "same", name="draft", draft_model=str(tiny_folder), draft_length=4),
        "same-tree": build(tiny_folder, root / "same-tree", name="draft", draft_model=str(tiny_folder),
                           draft_length=3, draft_branching=(2, 1, 2)),
    }


@pytest.mark.parametrize("name", ["ngram", "ngram-logits", "self1-tree", "self1-tree-logits", "same-chain", "same-tree"])
def test_greedy_is_lossless(engines, name, lossless):
    for spec in lossless(engines[name], PROMPTS, NEW):
        assert sum(spec.stats.accept_lengths) >= NEW - 1  # every emitted token after the first came from a step
        assert spec.stats.steps == len(spec.stats.accept_lengths)


def test_a_perfect_draft_is_always_accepted(engines):
    result = engines["same-chain"].generate("hello", max_new_tokens=NEW, stop_ids=(), budget=False)
    assert result.stats.accept_lengths[:-1] == [5] * (len(result.stats.accept_lengths) - 1)  # K = 4 drafts + bonus
    result = engines["same-tree"].generate("hello", max_new_tokens=NEW, stop_ids=(), budget=False)
    assert max(result.stats.accept_lengths) == 4  # depth 3 + bonus, through the branches


def test_ngram_accepts_on_repetitive_output(engines):
    result = engines["ngram"].generate("abcabcabcabc", max_new_tokens=40, stop_ids=())
    assert result.stats.tau > 1.0


def test_stop_inside_an_accepted_run(engines):
    engine = engines["same-chain"]
    plain = engine.generate("hello", max_new_tokens=NEW, stop_ids=(), plain=True)
    stop_at = plain.tokens[6]  # the 7th token arrives in the middle of a 5-token step
    spec = engine.generate("hello", max_new_tokens=NEW, stop_ids=(stop_at,))
    assert spec.tokens == plain.tokens[:plain.tokens.index(stop_at) + 1] and spec.stop_reason == "eos"
    assert engine.generate("hello", max_new_tokens=7, stop_ids=()).tokens == plain.tokens[:7]


@pytest.mark.parametrize("name, params", [("same-chain", {"temperature": 0.5}),  # sampled chain, q = p
                                          ("self1-tree", {"temperature": 0.5, "top_p": 0.9}),  # top-k tree
                                          ("ngram", {"temperature": 0.5})])
def test_sampling_follows_plain_sampling(engines, name, params):
    engine = engines[name]
    spec = chisquare.sampled_counts(engine, "the cat", False, 1500, 0, **params)[0]
    plain = chisquare.sampled_counts(engine, "the cat", True, 1500, 100_000, **params)[0]
    stat, dof = chisquare.two_sample(spec, plain)
    assert dof >= 3
    assert stat < chisquare.threshold(dof), (stat, dof)


@pytest.mark.parametrize("name", ["ngram", "self1-tree", "same-tree"])
def test_a_logit_bias_keeps_greedy_lossless(engines, name):
    """A logit bias (greedy) is applied on the host to every row, the graphs' own acceptance set aside: speculative
    tokens equal plain decoding's with the same bias, whole trees and governed, and the bias changes them."""
    engine = engines[name]
    for prompt in PROMPTS:
        free = engine.generate(prompt, max_new_tokens=NEW, stop_ids=(), plain=True)
        other = next(t for t in free.tokens if t != free.tokens[1])
        bias = SamplingParams(logit_bias=((free.tokens[1], -100.0), (other, 3.0)))
        plain = engine.generate(prompt, max_new_tokens=NEW, stop_ids=(), plain=True, sampling=bias)
        spec = engine.generate(prompt, max_new_tokens=NEW, stop_ids=(), sampling=bias, budget=False)
        governed = engine.generate(prompt, max_new_tokens=NEW, stop_ids=(), sampling=bias)
        assert spec.tokens == plain.tokens == governed.tokens != free.tokens, prompt
        assert free.tokens[1] not in plain.tokens


@pytest.mark.parametrize("name", ["ngram", "self1-tree", "same-tree"])
def test_penalties_keep_greedy_lossless(engines, name):
    """The penalties at each tree row follow that row's own path: greedy speculative tokens equal plain decoding's
    under the same penalties (which change them), whole trees and governed."""
    engine = engines[name]
    penalties = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.4, presence_penalty=0.3)
    changed = 0
    for prompt in PROMPTS:
        free = engine.generate(prompt, max_new_tokens=NEW, stop_ids=(), plain=True)
        plain = engine.generate(prompt, max_new_tokens=NEW, stop_ids=(), plain=True, sampling=penalties)
        spec = engine.generate(prompt, max_new_tokens=NEW, stop_ids=(), sampling=penalties, budget=False)
        governed = engine.generate(prompt, max_new_tokens=NEW, stop_ids=(), sampling=penalties)
        assert spec.tokens == plain.tokens == governed.tokens, prompt
        changed += plain.tokens != free.tokens
    assert changed >= 2


@pytest.mark.parametrize("name", ["same-chain", "ngram", "self1-tree"])
def test_min_tokens_keeps_greedy_lossless(engines, name):
    """A stop id plain decoding meets early is kept out of every row whose output would still be short of
    min_tokens (by its depth in the tree): speculative tokens equal plain decoding's, whole trees and governed."""
    engine = engines[name]
    free = engine.generate("hello", max_new_tokens=NEW, stop_ids=(), plain=True)
    stop = free.tokens[3]
    early = engine.generate("hello", max_new_tokens=NEW, stop_ids=(stop,), plain=True)
    assert early.stop_reason == "eos" and len(early.tokens) <= 4
    held = SamplingParams(min_tokens=12)
    plain = engine.generate("hello", max_new_tokens=NEW, stop_ids=(stop,), plain=True, sampling=held)
    spec = engine.generate("hello", max_new_tokens=NEW, stop_ids=(stop,), sampling=held, budget=False)
    governed = engine.generate("hello", max_new_tokens=NEW, stop_ids=(stop,), sampling=held)
    assert spec.tokens == plain.tokens == governed.tokens and len(plain.tokens) >= 12
    assert stop not in plain.tokens[:11]


def close(a, b, tol=1e-4):
    """Two TokenLogprob lists agree: the same tokens, logprobs within `tol` (fp32 rows of calls of other widths), the
    same alternatives' logprobs where both list them."""
    assert [x.token for x in a] == [y.token for y in b]
    for x, y in zip(a, b):
        assert abs(x.logprob - y.logprob) < tol
        if x.top and y.top:
            assert np.allclose([lp for _, lp in x.top], [lp for _, lp in y.top], atol=tol)


@pytest.mark.parametrize("name", ["ngram", "ngram-logits", "self1-tree", "same-tree"])
@pytest.mark.parametrize("params", [{}, {"temperature": 0.8, "seed": 3}])
def test_logprobs_are_the_targets_own_for_each_token(engines, name, params):
    """Each emitted token's logprob is read from the verification row that drew it: speculative decoding (whole
    trees and governed) gives plain decoding's logprobs, and both equal the target's own log-softmax at each position,
    scored again as a prompt (prompt_logprobs of prompt + output, one chunk)."""
    engine = engines[name]
    asked = SamplingParams(logprobs=3, **params)
    for prompt in PROMPTS:
        ids = engine.encode(prompt)
        plain = engine.generate(ids, max_new_tokens=NEW, stop_ids=(), plain=True, sampling=asked)
        runs = [engine.generate(ids, max_new_tokens=NEW, stop_ids=(), sampling=asked, budget=budget)
                for budget in (False, True)]
        assert len(plain.logprobs) == len(plain.tokens) == NEW
        assert all(len(x.top) == 3 and x.top[0][1] >= x.top[-1][1] for x in plain.logprobs)
        if not params:
            assert all(x.token == x.top[0][0] for x in plain.logprobs)  # greedy: the most likely token
            for spec in runs:
                close(spec.logprobs, plain.logprobs)
        scored = engine.generate(ids + plain.tokens, max_new_tokens=1, stop_ids=(),
                                 sampling=SamplingParams(prompt_logprobs=3))
        assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == len(ids) + NEW
        close(scored.prompt_logprobs[len(ids):], plain.logprobs)
        for spec in runs:  # sampled: other tokens, each scored as the target scores it
            again = engine.generate(ids + spec.tokens, max_new_tokens=1, stop_ids=(),
                                    sampling=SamplingParams(prompt_logprobs=0))
            close(again.prompt_logprobs[len(ids):], spec.logprobs)


def test_prompt_logprobs_span_chunks(engines):
    """A prompt fed in several chunks scores every token after the first, each chunk's last row scoring the next
    chunk's first token; the scores equal those of one call over the whole prompt."""
    engine = engines["ngram"]
    ids = engine.encode("the cat sat on the mat, the cat sat on the mat " * 2)
    whole = engine.generate(ids, max_new_tokens=2, stop_ids=(), sampling=SamplingParams(prompt_logprobs=2))
    assert len(whole.prompt_logprobs) == len(ids) and [x.token for x in whole.prompt_logprobs[1:]] == ids[1:]
    chunks = [ids[:7], ids[7:20], ids[20:]]
    scores = [None]
    cache = engine.target.new_cache(len(ids) + 4)
    for fed in range(len(chunks)):
        _, logits = engine.prefill_next(cache, chunks, fed, every_row=True)
        scores.extend(chunk_logprobs(chunks, fed, logits, 2))
    close(scores[1:], whole.prompt_logprobs[1:], tol=1e-5)


@pytest.mark.parametrize("name, prompt, params", [
    ("self1-tree", "the cat", {"temperature": 0.7, "min_p": 0.15}),
    ("same-chain", "the cat", {"temperature": 1.0, "min_p": 0.05, "top_k": 30,
                               "logit_bias": ((5, 2.0), (6, -100.0))}),  # the draft samples the biased q = p
    ("self1-tree", "the cat", {"temperature": 0.5, "repetition_penalty": 1.8, "frequency_penalty": 0.7}),
    ("same-chain", "the cat", {"temperature": 0.5, "presence_penalty": 1.5}),  # rejections: q lacks the penalty
])
def test_host_only_knobs_sampling_follows_plain_sampling(engines, name, prompt, params):
    """min-p, a logit bias and the penalties transform every row's distribution as plain sampling's: the same
    distribution (the fused graph's acceptance is set aside for the host's, which applies them)."""
    engine = engines[name]
    spec, lengths = chisquare.sampled_counts(engine, prompt, False, 1500, 0, **params)
    plain = chisquare.sampled_counts(engine, prompt, True, 1500, 100_000, **params)[0]
    stat, dof = chisquare.two_sample(spec, plain)
    assert dof >= 3 and stat < chisquare.threshold(dof), (stat, dof)
    assert max(lengths) > 1  # drafts were accepted


def test_the_sampling_test_catches_a_broken_rule(engines, monkeypatch):
    """Keep a rejected candidate in the target's residual: the same test must now fail (the runtime's rule,
    on a bundle that accepts outside the graph)."""
    from specexport.runtime import verify

    engine = engines["self1-tree-logits"]
    plain = chisquare.sampled_counts(engine, "the cat", True, 1500, 100_000, temperature=0.5)[0]
    monkeypatch.setattr(verify, "_reject", lambda p, q, x, mode: (p, q))
    spec = chisquare.sampled_counts(engine, "the cat", False, 1500, 0, temperature=0.5)[0]
    stat, dof = chisquare.two_sample(spec, plain)
    assert stat > chisquare.threshold(dof), (stat, dof)


@pytest.mark.parametrize("params", [{"temperature": 0.8}, {"temperature": 1.0, "top_k": 20, "top_p": 0.9}])
def test_sampling_in_the_graph_equals_sampling_in_the_runtime(engines, params):
    """Same seed, same random numbers: the fused graph and the runtime's rule emit the same tokens."""
    fused, outside = engines["self1-tree"], engines["self1-tree-logits"]
    assert fused.accepting.graph and not outside.accepting.graph
    for seed, prompt in enumerate(PROMPTS):
        sampling = SamplingParams(seed=seed, **params)
        a = fused.generate(prompt, max_new_tokens=NEW, sampling=sampling, stop_ids=())
        b = outside.generate(prompt, max_new_tokens=NEW, sampling=sampling, stop_ids=())
        assert a.tokens == b.tokens and a.stats.accept_lengths == b.stats.accept_lengths, (prompt, params)


def test_fused_acceptance_equals_the_pure_rule(tmp_path):
    """The in-graph acceptance returns accept_greedy's path and bonus on random trees, and accept_tree's when
    sampling (both flavours: ONNX Runtime's ops, and standard ONNX for TensorRT)."""
    from conftest import tiny_model

    model = tiny_model("llama")
    rng = np.random.default_rng(0)
    for flavour in ("ort", "onnx"):
        info = write_graph(model, "target", GraphOptions(flavour=flavour, fused_accept=True), 128, tmp_path, quiet=True)
        session = GraphSession(tmp_path / info["file"], info, threads=1)
        for _ in range(60):
            cache = session.new_cache(128)
            past = int(rng.integers(0, 12))
            if past:
                ids = rng.integers(0, 259, (1, past))
                session.forward(cache, ids, np.arange(past)[None],
                                tree.causal_mask(past), np.array([past - 1]))
                cache.advance(past)
            t = int(rng.integers(1, 10))
            parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
            mask = tree.ancestor_mask(parents)
            positions = (past + tree.depths(parents))[None]
            tokens = rng.integers(0, 259, (1, t))
            best = session.forward(cache, tokens, positions, mask, np.arange(t))["logits"].argmax(-1)
            for i in range(1, t):  # make most drafts right, and some a duplicate of an earlier sibling
                if rng.random() < 0.6:
                    tokens[0, i] = best[parents[i]]
                elif siblings := [j for j in range(1, i) if parents[j] == parents[i]]:
                    tokens[0, i] = tokens[0, siblings[0]]
            out = session.forward(cache, tokens, positions, mask, np.arange(t),
                                  want=("logits", "accept_rows", "bonus_token"))
            ref = accept_greedy(tokens[0].tolist(), parents, out["logits"].argmax(-1))
            assert (out["accept_rows"].tolist(), int(out["bonus_token"][0])) == (ref.path, ref.tokens[-1])
            # the same call sampling (deterministic candidates, temperature 1, top-p 0.95): verify.accept_tree's answer
            u = rng.random(uniforms_shape(parents)).astype(np.float32)
            feeds = {"sample_u": u, "sample_q": np.zeros((0, 0), np.float32),
                     "sample_params": np.array([1.0, 0, 0.95, 0], np.float32)}
            out = session.forward(cache, tokens, positions, mask, np.arange(t),
                                  want=("logits", "accept_rows", "bonus_token"), accept=feeds)
            p = probabilities(out["logits"], SamplingParams(temperature=1.0, top_p=0.95))
            ref = accept_tree(tokens[0].tolist(), parents, p, None, u, "topk")
            assert (out["accept_rows"].tolist(), int(out["bonus_token"][0])) == (ref.path, ref.tokens[-1])


@pytest.mark.parametrize("name", ["ngram", "ngram-logits", "self1-tree", "same-chain", "same-tree"])
def test_constrained_greedy_is_lossless(engines, name, constrained):
    """Structured output: every tree row masked by the grammar after its own path, forbidden drafts cut before the
    verification; speculative tokens equal constrained plain decoding's, and the outputs that end follow their
    constraint. Prompts that hold the constrained answers let lookup drafts be accepted; a draft model drafts what
    the grammar allows after each node's path, so the target as its own draft has every draft accepted."""
    prompts = PROMPTS + ['{"a": "x", "b": true} and {"a": "x", "b": true}', "ab2355 or ab2355, no or no"]
    ended, accepted = constrained(engines[name], prompts, 40)
    assert ended >= 9
    if not name.startswith("self1"):  # (a one-layer draft of a random model: its drafts are rarely right)
        assert accepted > 0
    if name == "same-chain":
        params = SamplingParams(constraint=conftest.constraint("json"))
        result = engines[name].generate("x", max_new_tokens=40, sampling=params, budget=False)
        assert result.stats.drafted == result.stats.accepted >= 12  # every draft verified was accepted


@pytest.mark.parametrize("name, params", [("ngram", {"temperature": 0.8}), ("same-chain", {"temperature": 1.0}),
                                          ("self1-tree", {"temperature": 0.7, "top_p": 0.95})])
def test_constrained_sampling_follows_constrained_plain_sampling(engines, name, params):
    """Constrained sampling: the speculative steps' tokens follow constrained plain sampling's distribution (drafts
    chosen deterministically are cut where forbidden; drafts sampled from the draft model are kept and rejected)."""
    from conftest import constraint

    engine = engines[name]
    params = {**params, "constraint": constraint("regex")}
    spec = chisquare.sampled_counts(engine, "the cat", False, 1500, 0, tokens=4, **params)[0]
    plain = chisquare.sampled_counts(engine, "the cat", True, 1500, 100_000, tokens=4, **params)[0]
    stat, dof = chisquare.two_sample(spec, plain)
    assert dof >= 3
    assert stat < chisquare.threshold(dof), (stat, dof)
