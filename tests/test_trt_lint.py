"""The trt flavour and `specexport check-trt`.

The flavour's bundles (every method and precision it claims) lint clean and follow the contract (static S_max,
aliased caches, Attention without past or nonpad inputs, signed int4 blocks, greedy-only fused acceptance, no ORT
optimizer pass); their numerics match transformers where ONNX Runtime's CPU provider runs them (fp32, fp16, int4;
bf16 does not run there), and the runtime decodes them losslessly. Small hand-made graphs break each rule and
fail on the node that breaks it; the ort and onnx flavours fail on what TensorRT rejects.
"""

import json
from functools import lru_cache

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from click.testing import CliRunner
from conftest import method_export, tiny_model
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from test_graph import ARCHS, QUANTIZED, check_report
from test_graph import model as arch_model

from specexport.cli import main
from specexport.errors import UserError
from specexport.exporter import quant, validate
from specexport.exporter.arch import dims_from_config
from specexport.exporter.fused import add_accept, add_batch_accept
from specexport.exporter.graph import GraphOptions, _Graph, make_model
from specexport.exporter.save import write_graph
from specexport.exporter.tensorrt.lint import lint_model, lint_path
from specexport.runtime import tree
from specexport.runtime.backends.host import GraphSession
from specexport.runtime.generate import Engine
from specexport.runtime.sampling import SamplingParams
from specexport.runtime.verify import accept_greedy

MAX_CONTEXT = 128
DRAFT_HEADROOM = 64  # the EAGLE draft's rotary table (and so its cache) runs this far past the context
CLAIMED = [(m, p) for m in ("none", "medusa", "eagle3") for p in ("fp16", "bf16", "int4")]


@pytest.fixture(scope="module")
def bundle(tiny_folder, tmp_path_factory):
    """bundle(method, precision, flavour="trt", optimize=True): a tiny bundle, built once (validated where ORT's CPU
    provider runs the precision; `optimize` as `build` sets it, which the trt flavour ignores)."""
    from test_eagle import random_draft
    from test_medusa import random_heads, write_heads

    from specexport.exporter.eagle import save_draft
    from specexport.exporter.export import ExportOptions, export_bundle

    root = tmp_path_factory.mktemp("trt")
    save_draft(random_draft(3), root / "eagle3-draft")
    given = {"none": {}, "medusa": {"heads": str(write_heads(root / "heads", random_heads())), "tree": "chain_3"},
             "eagle3": {"draft": str(root / "eagle3-draft")}}

    @lru_cache(maxsize=None)
    def build(method, precision, flavour="trt", optimize=True):
        out = root / f"{method}-{precision}-{flavour}"
        graph = GraphOptions(precision=precision, flavour=flavour)
        export_bundle(str(tiny_folder), out, ExportOptions(graph=graph, max_context=MAX_CONTEXT, optimize=optimize,
                                                           validate=precision != "bf16",
                                                           **method_export(method, **given[method])), quiet=True)
        return out

    return build


def manifest(folder):
    return json.loads((folder / "manifest.json").read_text())


def found(violations, rule, node=None, text="", warning=False):
    """The violations of `rule` (on `node`, mentioning `text`) at that level."""
    return [v for v in violations if v.rule == rule and (node is None or v.node == node) and text in v.message
            and v.warning == warning]


# ---- the trt flavour -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("method, precision", CLAIMED)
def test_the_trt_flavour_lints_clean(bundle, method, precision):
    """No error and no warning on any graph of the bundle; the graphs are the standard ones (no ORT optimizer
    pass), with the cache length fixed; the numerics hold where ORT ran them."""
    folder = bundle(method, precision)
    report = lint_path(folder)
    assert report.violations == [] and "0 error(s), 0 warning(s): clean" in report.summary(), report.summary()
    m = manifest(folder)
    assert m["flavour"] == "trt" and len(report.files) == len(m["graphs"])
    for name, info in m["graphs"].items():
        assert info["file"] == f"{name}.onnx" and "optimized" not in info, info
    assert m["graphs"]["target"]["kv_capacity"] == MAX_CONTEXT
    if "draft" in m["graphs"]:
        assert m["graphs"]["draft"]["kv_capacity"] == MAX_CONTEXT + DRAFT_HEADROOM
    if precision == "bf16":
        assert m["numerics"] == {}  # not run: ORT's CPU provider has no bf16 kernels
        return
    bound, _ = QUANTIZED[precision]
    assert m["numerics"]["max_abs_diff"] < bound, m["numerics"]
    if method == "medusa" and precision == "fp16":
        assert m["numerics"]["medusa"]["path_match"] and m["numerics"]["medusa"]["bonus_match"]
    if method == "eagle3" and precision == "fp16":
        assert m["numerics"]["eagle"]["draft_topk_match"] > 0.9, m["numerics"]["eagle"]


def test_the_trt_graphs_follow_the_contract(bundle):
    """Read from the files: opset 24 only; Attention on 4 inputs with one output; TensorScatter linear on axis -2
    into the present.* output of the same shape; the caches [batch, kv_heads, 64, head_dim]; greedy-only fused
    acceptance (no sampling inputs, If or Loop); int4 as signed blocks of 64 with fp16 scales, no zero point."""
    for precision in ("fp16", "int4"):
        folder = bundle("medusa", precision)
        proto = onnx.load(str(folder / "target.onnx"), load_external_data=False)
        assert [(o.domain, o.version) for o in proto.opset_import] == [("", 24)]
        g = proto.graph
        ops = [n.op_type for n in g.node]
        assert ops.count("Attention") == 2 and ops.count("TensorScatter") == 4
        assert not {"If", "Loop", "EyeLike", "CumSum"} & set(ops)
        assert not {"sample_u", "sample_q", "sample_params"} & {i.name for i in g.input}
        assert {"accept_rows", "bonus_token", "medusa_tokens"} <= {o.name for o in g.output}
        for node in g.node:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            if node.op_type == "Attention":
                assert len(node.input) == 4 and len(node.output) == 1, node
            if node.op_type == "TensorScatter":
                assert attrs == {"axis": -2, "mode": b"linear"}, attrs
                assert node.output[0] == node.input[0].replace("past_key_values.", "present.")
        caches = [v for v in list(g.input) + list(g.output) if v.name.startswith(("past_key_values.", "present."))]
        assert len(caches) == 8
        for v in caches:
            dims = [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            assert dims == ["batch", 2, MAX_CONTEXT, 16] and v.type.tensor_type.elem_type == T.FLOAT16, (v.name, dims)
        dq = [n for n in g.node if n.op_type == "DequantizeLinear"]
        assert bool(dq) == (precision == "int4")
        init = {t.name: t for t in g.initializer}
        for node in dq:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            assert len(node.input) == 2 and attrs == {"axis": 0, "block_size": 64}, node
            assert init[node.input[0]].data_type == T.INT4 and init[node.input[1]].data_type == T.FLOAT16


def test_signed_int4_blocks_round_trip():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(8, 128)).astype(np.float32)
    q, scale = quant.int4_symmetric_blocks(w)
    assert q.dtype == np.int8 and q.min() >= -7 and q.max() <= 7 and scale.shape == (8, 2)
    back = (q.reshape(8, 2, 64) * scale[..., None]).reshape(8, 128)
    assert np.abs(back - w).max() <= scale.max() / 2 + 1e-6


def trt_session(m, folder, precision):
    folder.mkdir()
    info = write_graph(m, "target", GraphOptions(precision=precision, flavour="trt"), MAX_CONTEXT, folder, quiet=True)
    return GraphSession(folder / info["file"], info, threads=1, device="cpu")


@pytest.mark.parametrize("kind", list(ARCHS))
def test_the_trt_flavour_at_fp32_matches_transformers(kind, tmp_path):
    """The trt graph's structure at fp32, where ORT's CPU provider runs every op: exact on every architecture.
    The lint warns (an fp32 engine is valid, not what the flavour is for) and finds no error."""
    check_report(validate.compare(arch_model(kind), trt_session(arch_model(kind), tmp_path / "g", "fp32")), 1e-4, 1.0)
    report = lint_path(tmp_path / "g")
    assert report.errors == [] and found(report.violations, "precision", warning=True)


@pytest.mark.parametrize("precision", ["fp16", "int4"])
def test_the_trt_flavour_quantized_matches_transformers(precision, tmp_path):
    """fp16, and int4 weights with fp16 activations, within test_graph's bounds for those precisions."""
    m = arch_model("llama")
    check_report(validate.compare(m, trt_session(m, tmp_path / "g", precision)), *QUANTIZED[precision])
    assert lint_path(tmp_path / "g").violations == []


def test_the_trt_flavour_refuses_int8():
    dims = dims_from_config(tiny_model("llama").config)
    with pytest.raises(UserError, match="trt flavour takes precision fp16, bf16 or int4"):
        GraphOptions(precision="int8", flavour="trt").check(dims)


def test_greedy_acceptance_in_the_graph_is_the_pure_rule():
    """The trt flavour's fused acceptance (greedy only, no sampling inputs) against accept_greedy on random trees
    with right guesses and duplicated siblings, after a past; with the batched greedy acceptance beside it, the
    whole passes the TensorRT lint."""
    V = 23
    g = _Graph(T.FLOAT)
    batch_outputs = add_batch_accept(g, add_accept(g, "logits", sampling=False)[3])
    inputs = [helper.make_tensor_value_info("input_ids", T.INT64, ["batch", "seq"]),
              helper.make_tensor_value_info("tree_mask", T.BOOL, ["batch", "seq", "seq"]),
              helper.make_tensor_value_info("past_len", T.INT32, ["batch"]),
              helper.make_tensor_value_info("logits_indices", T.INT64, ["rows"]),
              helper.make_tensor_value_info("logits", T.FLOAT, ["rows", V])]
    outputs = [helper.make_tensor_value_info("accept_rows", T.INT64, ["accepted"]),
               helper.make_tensor_value_info("bonus_token", T.INT64, [1])] + batch_outputs
    model = make_model(helper.make_graph(g.nodes, "accept", inputs, outputs, initializer=g.initializers))
    onnx.checker.check_model(model, full_check=True)
    assert lint_model(model) == []
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    for trial in range(80):
        t, past = int(rng.integers(1, 11)), int(rng.integers(0, 5))
        parents = [-1] + [int(rng.integers(0, i)) for i in range(1, t)]
        logits = (rng.normal(size=(t, V)) * 2).astype(np.float32)
        tokens = rng.integers(0, V, t)
        for i in range(1, t):
            if rng.random() < 0.5:
                tokens[i] = int(np.argmax(logits[parents[i]]))
            elif siblings := [j for j in range(1, i) if parents[j] == parents[i]]:
                tokens[i] = tokens[siblings[0]]
        ref = accept_greedy(tokens.tolist(), parents, logits.argmax(-1))
        rows, bonus = session.run(["accept_rows", "bonus_token"], {
            "input_ids": tokens[None].astype(np.int64), "past_len": np.array([past], np.int32),
            "tree_mask": tree.ancestor_mask(parents)[None], "logits": logits, "logits_indices": np.arange(t)})
        assert (rows.tolist(), int(bonus[0])) == (ref.path, ref.tokens[-1]), (trial, parents, tokens.tolist())


@pytest.mark.parametrize("method", ["medusa", "eagle3"])
def test_trt_bundles_decode_losslessly(bundle, lossless, method):
    """The runtime on a trt bundle: the cache is the graph's fixed length, greedy steps accept in the graph and
    emit plain decoding's tokens; sampled steps accept outside it (the graph takes no random numbers)."""
    engine = Engine.load(bundle(method, "fp16"), threads=1)
    assert engine.accepting.graph and not engine.accepting.sampling
    assert engine.target.new_cache(10).capacity == MAX_CONTEXT
    results = lossless(engine, ["the cat sat on the mat", "one two three one two three"], 12)
    assert sum(r.stats.steps for r in results) < 24  # speculation took more than one token in some step
    sampled = engine.generate("the cat", max_new_tokens=8, sampling=SamplingParams(temperature=1.0, seed=3), stop_ids=())
    assert len(sampled.tokens) == 8


# ---- the lint on graphs that break a rule ---------------------------------------------------------------------


def model_of(nodes, inputs, outputs, initializers=(), opset=24, domains=()):
    graph = helper.make_graph(nodes, "bad", inputs, outputs, initializer=list(initializers))
    opsets = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, 1) for d in domains]
    m = helper.make_model(graph, opset_imports=opsets)
    m.ir_version = 11
    return m


def vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def const(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def int4_tensor(name, elem, values, shape):
    nibbles = quant.pack_nibbles((np.asarray(values, np.int8) & 0x0F).astype(np.uint8).reshape(-1))
    return helper.make_tensor(name, elem, shape, nibbles.tobytes(), raw=True)


H, KV = 16, 2
Q4 = vi("q", T.FLOAT16, [1, 4, "T", H])
K4, V4 = vi("k", T.FLOAT16, [1, KV, 64, H]), vi("v", T.FLOAT16, [1, KV, 64, H])
MASK = vi("mask", T.FLOAT16, [1, 1, "T", 64])
Y = vi("y", T.FLOAT16, None)


def attention(inputs, outputs=("y",), **attrs):
    return helper.make_node("Attention", list(inputs), list(outputs), name="attn", **attrs)


def scatter(cache="past_key_values.0.key", out="present.0.key", seq=64, **attrs):
    """One TensorScatter writing a [1, 2, seq, 16] cache."""
    shape = [1, KV, seq, H]
    node = helper.make_node("TensorScatter", [cache, "new", "at"], [out], name="write", **attrs)
    return model_of([node], [vi(cache, T.FLOAT16, shape), vi("new", T.FLOAT16, [1, KV, "T", H]),
                             vi("at", T.INT64, [1])], [vi(out, T.FLOAT16, shape)])


def dequantize(elem, values, zero=None, **attrs):
    """A [128, 8] weight dequantized into a MatMul (fp16 scales)."""
    blocks = 128 // attrs.get("block_size", 128) if attrs.get("block_size") else 1
    inits = [int4_tensor("w", elem, values, [128, 8]) if elem in (T.INT4, T.UINT4) else const("w", values),
             const("s", np.full((blocks, 8) if attrs.get("block_size") else (8,), 0.01, np.float16))]
    inputs = ["w", "s"]
    if zero is not None:
        inits.append(zero)
        inputs.append(zero.name)
    nodes = [helper.make_node("DequantizeLinear", inputs, ["wd"], name="dq", **attrs),
             helper.make_node("MatMul", ["x", "wd"], ["y"], name="mm")]
    return model_of(nodes, [vi("x", T.FLOAT16, [1, 128])], [Y], inits)


def loop_with_scan():
    body = helper.make_graph([helper.make_node("Identity", ["cond"], ["cond_out"], name="keep"),
                              helper.make_node("Identity", ["x"], ["scan"], name="emit")], "body",
                             [vi("i", T.INT64, []), vi("cond", T.BOOL, [])],
                             [vi("cond_out", T.BOOL, []), vi("scan", T.FLOAT16, [1])])
    node = helper.make_node("Loop", ["trips", ""], ["stacked"], name="loop", body=body)
    return model_of([node], [vi("trips", T.INT64, []), vi("x", T.FLOAT16, [1])], [vi("stacked", T.FLOAT16, None)])


def if_with_contrib_op():
    def branch(name, contrib):
        node = helper.make_node("FusedMatMul", ["x", "x"], [f"{name}_y"], name="inner", domain="com.microsoft") \
            if contrib else helper.make_node("Identity", ["x"], [f"{name}_y"], name=f"{name}_id")
        return helper.make_graph([node], name, [], [vi(f"{name}_y", T.FLOAT16, None)])
    node = helper.make_node("If", ["c"], ["y"], name="branch", then_branch=branch("then", True),
                            else_branch=branch("else", False))
    return model_of([node], [vi("c", T.BOOL, []), vi("x", T.FLOAT16, [4, 4])], [Y], domains=["com.microsoft"])


INT4_OK = np.random.default_rng(0).integers(-7, 8, (128, 8))
BAD = {  # case -> (model, rule, node, text in the message)
    "opset 25": (model_of([helper.make_node("Identity", ["x"], ["y"], name="id")], [vi("x", T.FLOAT16, [1])], [Y],
                          opset=25), "opset", "(model)", "opset 25"),
    "a com.microsoft op": (model_of([helper.make_node("FusedMatMul", ["x", "x"], ["y"], name="fmm",
                                                      domain="com.microsoft")], [vi("x", T.FLOAT16, [4, 4])], [Y],
                                    domains=["com.microsoft"]), "opset", "fmm", "com.microsoft"),
    "an op TensorRT lacks": (model_of([helper.make_node("Unique", ["x"], ["y"], name="uniq")],
                                      [vi("x", T.FLOAT16, [4])], [Y]), "op", "uniq", "not supported"),
    "an op newer than 10.15": (model_of([helper.make_node("Swish", ["x"], ["y"], name="swish")],
                                        [vi("x", T.FLOAT16, [4])], [Y]), "op", "swish", "TensorRT >= 11.0"),
    "Attention with nonpad_kv_seqlen": (model_of([attention(["q", "k", "v", "mask", "", "", "lens"])],
                                                 [Q4, K4, V4, MASK, vi("lens", T.INT64, [1])], [Y]),
                                        "attention", "attn", "nonpad_kv_seqlen"),
    "Attention with a past": (model_of([attention(["q", "k", "v", "mask", "pk"])],
                                       [Q4, K4, V4, MASK, vi("pk", T.FLOAT16, [1, KV, 64, H])], [Y]),
                              "attention", "attn", "past_key"),
    "Attention with present outputs": (model_of([attention(["q", "k", "v", "mask"], ["y", "pk_out"])],
                                                [Q4, K4, V4, MASK], [Y, vi("pk_out", T.FLOAT16, None)]),
                                       "attention", "attn", "present_key"),
    "Attention on 3-D Q": (model_of([attention(["q3", "k", "v", "mask"])],
                                    [vi("q3", T.FLOAT16, [1, "T", 64]), K4, V4, MASK], [Y]), "attention", "attn",
                           "3-D"),
    "Attention with an fp32 mask": (model_of([attention(["q", "k", "v", "mask32"])],
                                             [Q4, K4, V4, vi("mask32", T.FLOAT, [1, 1, "T", 64])], [Y]),
                                    "attention", "attn", "Q's type"),
    "TensorScatter on axis 2": (scatter(axis=2), "tensorscatter", "write", "axis 2"),
    "TensorScatter circular": (scatter(mode="circular"), "tensorscatter", "write", "mode circular"),
    "a symbolic cache length": (scatter(seq="capacity"), "kv-cache", "write", "static S_max"),
    "a cache output not named as its alias": (scatter(out="kv_out"), "kv-cache", "write", "alias name"),
    "a cache fed to another op": (model_of([helper.make_node("MatMul", ["past_key_values.0.key", "w"], ["y"],
                                                             name="gqa")],
                                           [vi("past_key_values.0.key", T.FLOAT16, [1, KV, 64, H]),
                                            vi("w", T.FLOAT16, [H, H])], [Y]), "kv-cache", "gqa", "feeds MatMul"),
    "a cache that is not a graph input": (model_of([helper.make_node("Identity", ["c"], ["c2"], name="copy"),
                                                    helper.make_node("TensorScatter", ["c2", "new", "at"], ["c3"],
                                                                     name="write")],
                                                   [vi("c", T.FLOAT16, [1, KV, 64, H]), vi("new", T.FLOAT16, None),
                                                    vi("at", T.INT64, [1])], [vi("c3", T.FLOAT16, None)]),
                                          "kv-cache", "write", "not a graph input"),
    "unsigned int4": (dequantize(T.UINT4, INT4_OK + 8, int4_tensor("z", T.UINT4, np.full((1, 8), 8), [1, 8]),
                                 axis=0, block_size=128), "dequantize", "dq", "UINT4"),
    "a nonzero zero point": (dequantize(T.INT8, INT4_OK.astype(np.int8), const("z", np.full(8, 3, np.int8)), axis=1),
                             "dequantize", "dq", "not zero"),
    "int4 per axis": (dequantize(T.INT4, INT4_OK, axis=1), "dequantize", "dq", "per-block"),
    "int4 in blocks of 32": (dequantize(T.INT4, INT4_OK, axis=0, block_size=32), "dequantize", "dq", "block_size 32"),
    "a TopK K computed at run time": (model_of([helper.make_node("TopK", ["x", "k"], ["y", "i"], name="topk")],
                                               [vi("x", T.FLOAT16, [1, 100]), vi("k", T.INT64, [1])],
                                               [Y, vi("i", T.INT64, None)]), "topk", "topk", "run time"),
    "a TopK over the vocabulary": (model_of([helper.make_node("TopK", ["x", "k"], ["y", "i"], name="topk")],
                                            [vi("x", T.FLOAT16, [1, 49152])], [Y, vi("i", T.INT64, None)],
                                            [const("k", np.array([49152], np.int64))]), "topk", "topk", "K = 49152"),
    "ReduceSum over computed axes": (model_of([helper.make_node("ReduceSum", ["x", "ax"], ["y"], name="sum")],
                                              [vi("x", T.FLOAT16, [4, 4]), vi("ax", T.INT64, [1])], [Y]),
                                     "constant-axes", "sum", "initializer"),
    "EyeLike on dynamic dims": (model_of([helper.make_node("EyeLike", ["x"], ["y"], name="eye")],
                                         [vi("x", T.FLOAT16, ["n", "n"])], [Y]), "types", "eye", "static"),
    "a Loop with scan outputs of a dynamic count": (loop_with_scan(), "loop", "loop", "static length"),
    "a contrib op inside an If branch": (if_with_contrib_op(), "opset", "inner", "com.microsoft"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_the_lint_fails_on_the_node_that_breaks_a_rule(case):
    model, rule, node, text = BAD[case]
    violations = lint_model(model, "bad.onnx")
    assert found(violations, rule, node, text), [v.line() for v in violations]
    line = found(violations, rule, node, text)[0].line()
    assert line.startswith(f"bad.onnx: {node} (") and f"error [{rule}]" in line, line


def test_the_lint_passes_what_tensorrt_takes():
    """The good twins of the bad graphs: signed int4 blocks of 64 and 128, a cache written in place, the 4-input
    Attention, a static TopK below 3840."""
    for block in (64, 128):
        assert lint_model(dequantize(T.INT4, INT4_OK, axis=0, block_size=block)) == []
    assert lint_model(dequantize(T.INT8, INT4_OK.astype(np.int8), const("z", np.zeros(8, np.int8)), axis=1)) == []
    assert lint_model(scatter()) == [] and lint_model(scatter(axis=-2, mode="linear")) == []
    assert lint_model(model_of([attention(["q", "k", "v", "mask"])], [Q4, K4, V4, MASK], [Y])) == []
    topk = model_of([helper.make_node("TopK", ["x", "k"], ["y", "i"], name="topk")], [vi("x", T.FLOAT16, [1, 5000])],
                    [Y, vi("i", T.INT64, None)], [const("k", np.array([3839], np.int64))])
    assert lint_model(topk) == []


def test_fp32_compute_is_a_warning():
    m = model_of([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], [vi("x", T.FLOAT, [1, 4])],
                 [vi("y", T.FLOAT, None)], [const("w", np.ones((4, 4), np.float32))])
    [v] = lint_model(m, "f.onnx")
    assert (v.rule, v.node, v.warning) == ("precision", "mm", True) and "strongly typed" in v.message


def test_the_ort_flavour_fails(tmp_path):
    """ONNX Runtime's contrib ops (GroupQueryAttention, MatMulNBits, ...) and its cache that no TensorScatter
    writes."""
    write_graph(tiny_model("llama"), "target", GraphOptions(precision="int4", flavour="ort"), MAX_CONTEXT, tmp_path,
                quiet=True)
    report = lint_path(tmp_path / "target.onnx")
    errors = report.errors
    for op in ("GroupQueryAttention", "MatMulNBits", "SkipSimplifiedLayerNormalization"):
        assert any(v.op == op and v.rule == "opset" and "com.microsoft" in v.message for v in errors), op
    assert found(errors, "kv-cache", text="feeds GroupQueryAttention")
    assert "TensorRT's ONNX parser would reject it" in report.summary()


def test_the_onnx_flavour_fails_on_nonpad_and_the_ort_optimizer(bundle):
    """The old standard flavour as `build` writes it (fp16, optimized by ORT): every Attention feeds
    nonpad_kv_seqlen, the cache length is symbolic, and the optimizer put com.microsoft FusedMatMul in."""
    folder = bundle("medusa", "fp16", "onnx", True)
    assert manifest(folder)["graphs"]["target"]["file"] == "target.opt.onnx"
    errors = lint_path(folder).errors
    assert len(found(errors, "attention", text="nonpad_kv_seqlen")) == 2
    assert found(errors, "kv-cache", text="static S_max")
    assert any(v.op == "FusedMatMul" and v.rule == "opset" for v in errors), [v.line() for v in errors]


# ---- the command ------------------------------------------------------------------------------------------------


def check_trt(*args):
    return CliRunner().invoke(main, ["check-trt", *map(str, args)])


def test_check_trt_command(bundle, tmp_path):
    clean = check_trt(bundle("eagle3", "fp16"))
    assert clean.exit_code == 0, clean.output
    assert clean.output.strip().splitlines()[-1].startswith("check-trt: 2 graph(s),") and "clean" in clean.output
    one = check_trt(bundle("none", "int4") / "target.onnx")  # a bare .onnx file
    assert one.exit_code == 0 and "check-trt: 1 graph(s)" in one.output, one.output
    old = check_trt(bundle("none", "fp16"), "--trt-version", "10.14")  # before RMSNormalization & co
    assert old.exit_code == 1 and "(RMSNormalization): error [op] needs TensorRT >= 10.15" in old.output, old.output
    bad = check_trt(bundle("medusa", "fp16", "onnx", True))
    lines = bad.output.strip().splitlines()
    assert bad.exit_code == 1 and "error(s)" in lines[-1] and "would reject" in lines[-1]
    assert any(line.startswith("target.opt.onnx: Attention_") and "nonpad_kv_seqlen" in line for line in lines)
    empty = tmp_path / "empty"
    empty.mkdir()
    nothing = check_trt(empty)
    assert nothing.exit_code == 1 and "holds no .onnx file" in nothing.output
    (empty / "notes.onnx").write_text("not a protobuf at all")  # not ONNX: one line, no protobuf traceback
    junk = check_trt(empty / "notes.onnx")
    assert junk.exit_code == 1 and "Traceback" not in junk.output, junk.output
    assert junk.output.strip() == junk.output.strip().splitlines()[0] and "notes.onnx is not an ONNX model" in junk.output


def test_build_writes_the_trt_flavour_without_the_ort_optimizer(tiny_folder, tmp_path):
    out = tmp_path / "b"
    result = CliRunner().invoke(main, ["build", "--model", str(tiny_folder), "--method", "none", "--flavour", "trt",
                                       "--precision", "bf16", "--no-validate", "--max-context", "32",
                                       "--output", str(out)])
    assert result.exit_code == 0, result.output
    m = manifest(out)
    assert m["graphs"]["target"]["file"] == "target.onnx" and m["graphs"]["target"]["kv_dtype"] == "bf16"
    assert not list(out.glob("*.opt.onnx")) and check_trt(out).exit_code == 0
