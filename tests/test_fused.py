"""The acceptance fused into the graph (exporter/fused.py) against the pure rules (runtime/verify.py), on
random trees in every mode: greedy, deterministic candidates, sampled drafts with and without replacement,
with temperature, top-k and top-p."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from specexport.exporter import fused
from specexport.exporter.fused import INPUTS, _argmax_rows, _process, add_accept, add_batch_accept
from specexport.exporter.graph import _Graph, make_model
from specexport.runtime import tree
from specexport.runtime.backends.layout import lay_out
from specexport.runtime.sampling import SamplingParams, probabilities
from specexport.runtime.verify import accept_greedy, accept_tree, uniforms_shape

V = 23


@pytest.fixture(scope="module", params=[None, V], ids=["argmax", "blocked-argmax"])
def session(request):
    """The acceptance alone, fed the logits directly (in the target graph they come from the LM head); with the
    vocabulary given at export (the ort flavour) its greedy argmax runs in blocks."""
    g = _Graph(TensorProto.FLOAT)
    add_accept(g, "logits", vocab_size=request.param)
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("tree_mask", TensorProto.BOOL, ["batch", "seq", "seq"]),
              helper.make_tensor_value_info("past_len", TensorProto.INT32, ["batch"]),
              helper.make_tensor_value_info("logits_indices", TensorProto.INT64, ["rows"]),
              helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", V])]
    inputs += [helper.make_tensor_value_info(name, t, shape) for name, t, shape in INPUTS]
    outputs = [helper.make_tensor_value_info("accept_rows", TensorProto.INT64, ["accepted"]),
               helper.make_tensor_value_info("bonus_token", TensorProto.INT64, [1])]
    model = make_model(helper.make_graph(g.nodes, "accept", inputs, outputs, initializer=g.initializers))
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def run(session, tokens, parents, logits, past, u, q, params, without=False, lanes=False):
    """The graph's (accepted rows, bonus token); `lanes`: the step laid out in lanes (runtime/backends/layout.py),
    the tree's rows among padding rows, the logits those of the rows `logits_indices` selects."""
    ids, mask, selected = np.array([tokens], np.int64), tree.ancestor_mask(parents)[None], np.arange(len(tokens))
    layout = lay_out(ids, np.zeros_like(ids), mask, selected, None, True, 100) if lanes else None
    if layout is not None:
        ids, mask, selected = layout.input_ids, layout.tree_mask, layout.logits_indices
    feeds = {"input_ids": ids, "tree_mask": mask,
             "past_len": np.array([past], np.int32), "logits": logits.astype(np.float32),
             "logits_indices": selected,
             "sample_u": u.astype(np.float32),
             "sample_q": np.zeros((0, 0), np.float32) if q is None else q.astype(np.float32),
             "sample_params": np.array([params.temperature, params.top_k, params.top_p, without], np.float32)}
    rows, bonus = session.run(None, feeds)
    return rows.tolist(), int(bonus[0])


MODES = ["greedy", "topk", "with_replacement", "without_replacement"]


def guesses(rng, parents: list[int], scores: np.ndarray, right: float) -> np.ndarray:
    """A tree's tokens: each node the argmax of `scores` at its parent with probability `right`, else a repeat of
    an earlier sibling where it has one (the rule must skip it), else random."""
    tokens = rng.integers(0, V, len(parents))
    for i in range(1, len(parents)):
        if rng.random() < right:
            tokens[i] = int(np.argmax(scores[parents[i]]))
        elif siblings := [j for j in range(1, i) if parents[j] == parents[i]]:
            tokens[i] = tokens[siblings[0]]
    return tokens


@pytest.mark.parametrize("lanes", [False, True], ids=["in-order", "in-lanes"])
@pytest.mark.parametrize("mode", MODES)
def test_the_graph_accepts_as_the_pure_rule(session, mode, lanes):
    rng = np.random.default_rng(MODES.index(mode))
    lengths = set()
    for trial in range(80):
        t, past = int(rng.integers(1, 11)), int(rng.integers(0, 5))
        sampled = mode in ("with_replacement", "without_replacement")
        chain = sampled and trial % 2 == 0  # the draft model's sampled chains, and sampled trees
        parents = [-1] + [i - 1 if chain else int(rng.integers(0, i)) for i in range(1, t)]
        logits = rng.normal(size=(t, V)) * 2
        params = SamplingParams(temperature=0.0 if mode == "greedy" else float(rng.choice([0.5, 1.0, 1.5])),
                                top_k=int(rng.choice([0, 0, 5])), top_p=float(rng.choice([1.0, 1.0, 0.8])))
        p = probabilities(logits.astype(np.float32), params)
        q = rng.dirichlet(np.ones(V) * 0.5, size=t) if sampled else None
        tokens = guesses(rng, parents, p, 0.5)
        u = rng.random(uniforms_shape(parents)).astype(np.float32)
        if mode == "greedy":
            ref = accept_greedy(tokens.tolist(), parents, logits.astype(np.float32).argmax(-1))
            u = np.zeros((t, 1))  # what the runtime passes when greedy
        else:
            ref = accept_tree(tokens.tolist(), parents, p, q, u, mode)
        got = run(session, tokens.tolist(), parents, logits, past, u, q, params, mode == "without_replacement", lanes)
        assert got == (ref.path, ref.tokens[-1]), (trial, parents, tokens.tolist())
        lengths.add(len(ref.path))
    assert max(lengths) >= 3  # accepted paths two drafts deep were exercised, not only rejections


def test_a_batched_greedy_call_skips_the_one_sequence_tree(session):
    """A call of several sequences (the batched engine's: greedy inputs, these outputs unread; add_batch_accept
    accepts its trees) takes the If's short branch, as a single row does: the root alone and the last row's argmax.
    The same tree alone is accepted as the pure rule accepts it (drafts accepted, so the branches differ)."""
    rng = np.random.default_rng(3)
    parents, logits = [-1, 0, 1, 0], (rng.normal(size=(8, V)) * 2).astype(np.float32)
    top = logits.argmax(-1)  # the tree alone is the last 4 rows
    tokens = [5, int(top[4]), int(top[5]), int(top[4])]  # a chain the target agrees with, and a repeated sibling
    params = SamplingParams(temperature=0.0)
    ref = accept_greedy(tokens, parents, top[4:])
    alone = run(session, tokens, parents, logits[4:], 3, np.zeros((4, 1)), None, params)
    assert alone == (ref.path, ref.tokens[-1]) and len(ref.path) == 3
    feeds = {"input_ids": np.array([tokens] * 2, np.int64), "tree_mask": np.stack([tree.ancestor_mask(parents)] * 2),
             "past_len": np.array([3, 7], np.int32), "logits": logits, "logits_indices": np.arange(8),
             "sample_u": np.zeros((8, 1), np.float32),
             "sample_q": np.zeros((0, 0), np.float32), "sample_params": np.array([0, 0, 1, 0], np.float32)}
    rows, bonus = session.run(None, feeds)
    assert rows.tolist() == [0] and bonus.tolist() == [int(top[-1])]


def test_the_final_draw_is_the_inverse_cdf(session):
    """A leaf root: the bonus token is sampling.sample's draw from p, for u across [0, 1)."""
    from specexport.runtime.sampling import sample

    logits = np.full((1, V), -np.inf)
    logits[0, [0, 2, 3]] = np.log([0.1, 0.3, 0.6])  # token 1 and the tail have no mass
    params = SamplingParams(temperature=1.0)
    p = probabilities(logits.astype(np.float32), params)
    for u in (0.0, 0.05, 0.15, 0.35, 0.45, 0.99, 0.9999999):
        got = run(session, [5], [-1], logits, 3, np.array([[u]]), None, params)
        assert got == ([0], sample(p[0], u)), u


@pytest.mark.parametrize("vocab", [23, 256, 1000, 2048, 4096])
def test_blocked_argmax_is_the_first_maximum(vocab):
    """Every vocabulary size (whole blocks, a padded last block, one block), ties within and across blocks."""
    g = _Graph(TensorProto.FLOAT)
    g.op("Identity", [_argmax_rows(g, "x", vocab)], outputs=["top"])
    graph = helper.make_graph(g.nodes, "argmax", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", vocab])],
                              [helper.make_tensor_value_info("top", TensorProto.INT64, ["n"])], initializer=g.initializers)
    session = ort.InferenceSession(make_model(graph).SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(vocab)
    x = rng.standard_normal((6, vocab)).astype(np.float32)
    x[1, [vocab // 3, vocab - 1]] = 9.0  # a tie across blocks: the first wins
    x[2, [vocab - 2, vocab - 1]] = 9.0  # a tie in the last block
    x[3] = 1.5  # all equal
    x[4, -1] = 7.0  # the very last token
    x[5] = np.round(x[5])  # many ties
    assert session.run(None, {"x": x})[0].tolist() == np.argmax(x, axis=1).tolist()


@pytest.mark.parametrize("vocab", [None, V], ids=["argmax", "blocked-argmax"])
def test_the_batched_greedy_acceptance_is_the_pure_rule_for_every_sequence(vocab):
    """add_batch_accept: B sequences' trees padded to the widest (a padded row sees only itself and is not
    selected by logits_indices), each accepted as accept_greedy accepts it alone, in both flavours' argmax."""
    g = _Graph(TensorProto.FLOAT)
    add_batch_accept(g, add_accept(g, "logits", sampling=False, vocab_size=vocab)[3])
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("tree_mask", TensorProto.BOOL, ["batch", "seq", "seq"]),
              helper.make_tensor_value_info("logits_indices", TensorProto.INT64, ["rows"]),
              helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", V])]
    outputs = [helper.make_tensor_value_info("batch_accept_mask", TensorProto.BOOL, ["batch", "seq"]),
               helper.make_tensor_value_info("batch_accept_len", TensorProto.INT64, ["batch"]),
               helper.make_tensor_value_info("batch_bonus", TensorProto.INT64, ["batch"])]
    model = make_model(helper.make_graph(g.nodes, "accept", inputs, outputs, initializer=g.initializers))
    onnx.checker.check_model(model, full_check=True)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(7)
    lengths = set()
    for trial in range(60):
        b = int(rng.integers(1, 6))
        sizes = [int(rng.integers(1, 9)) for _ in range(b)]
        width = max(sizes)
        ids, mask = np.zeros((b, width), np.int64), np.broadcast_to(np.eye(width, dtype=bool), (b, width, width)).copy()
        rows, refs, logits = [], [], []
        for k, t in enumerate(sizes):
            parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
            z = rng.normal(size=(t, V)).astype(np.float32) * 2
            tokens = guesses(rng, parents, z, 0.6)
            ids[k, :t], mask[k, :t, :t] = tokens, tree.ancestor_mask(parents)
            rows += range(k * width, k * width + t)
            logits.append(z)
            refs.append(accept_greedy(tokens.tolist(), parents, z.argmax(-1)))
        got_mask, got_len, got_bonus = session.run(None, {
            "input_ids": ids, "tree_mask": mask, "logits_indices": np.array(rows, np.int64),
            "logits": np.concatenate(logits)})
        for k, ref in enumerate(refs):
            assert np.flatnonzero(got_mask[k]).tolist() == ref.path, (trial, k)
            assert got_len[k] == len(ref.path) and got_bonus[k] == ref.tokens[-1], (trial, k)
            lengths.add(len(ref.path))
    assert max(lengths) >= 3


def process_session(vocab: int):
    g = _Graph(TensorProto.FLOAT)
    vsize = g.op("Shape", ["x"], start=1, end=2)
    temperature = g.op("Gather", ["sample_params", g.const("t_at", np.array([0]))], axis=0)
    g.op("Identity", [_process(g, "x", temperature, vsize)], outputs=["p"])
    graph = helper.make_graph(g.nodes, "process", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", vocab]),
                                                   helper.make_tensor_value_info("sample_params", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("p", TensorProto.FLOAT, ["n", vocab])],
                              initializer=g.initializers)
    return ort.InferenceSession(make_model(graph).SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("shape", ["peaked", "flat", "spread", "ties"])
def test_top_p_sorts_only_the_candidates_it_needs(shape, monkeypatch):
    """_process's top-p (TopK over the candidates above the first probability floor holding top_p's mass, not
    the vocabulary) keeps the nucleus of the full sort exactly, whichever floor the rows need, ties included, and
    sampling.probabilities' (float64) where no tie straddles the cut."""
    vocab, rng = 6000, np.random.default_rng(len(shape))
    logits = {"peaked": rng.normal(size=(5, vocab)) * 6, "flat": rng.normal(size=(5, vocab)) * 0.1,
              "spread": rng.normal(size=(5, vocab)) * 2.5, "ties": np.round(rng.normal(size=(5, vocab)) * 2)}[shape]
    logits[0] = rng.normal(size=vocab) * 6  # a peaked row among the others: rows needing different floors
    x = logits.astype(np.float32)
    fast = process_session(vocab)
    monkeypatch.setattr(fused, "NUCLEUS_LEVELS", (0.0,))
    full = process_session(vocab)
    for top_p in (0.5, 0.9, 0.99):
        params = np.array([1.0, 0, top_p, 0], np.float32)
        got = fast.run(None, {"x": x, "sample_params": params})[0]
        assert (got == full.run(None, {"x": x, "sample_params": params})[0]).all(), top_p
        if shape != "ties":
            want = probabilities(x, SamplingParams(temperature=1.0, top_p=top_p))
            assert ((got > 0) == (want > 0)).all(), top_p
            np.testing.assert_allclose(got, want, atol=1e-5)
