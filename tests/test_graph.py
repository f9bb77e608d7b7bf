"""The target graph built from the weights, against the transformers model it came from.

Every architecture x flavour at fp32 on every shape class `validate.compare` checks (prefill + decode,
trees with and without past, batch 2); the quantized precisions with looser bounds; the auxiliary
hidden-state outputs; the KV cache written in place; the one-line errors for what is unsupported.
"""

from functools import lru_cache

import numpy as np
import pytest
import torch
from conftest import LLAMA3_ROPE, tiny_config, tiny_model

from specexport.errors import UserError
from specexport.exporter import arch, validate
from specexport.exporter.graph import DecoderGraphBuilder, GraphOptions
from specexport.exporter.save import write_graph
from specexport.exporter.weights import extract_weights
from specexport.runtime import tree
from specexport.runtime.backends.host import GraphSession

MAX_CONTEXT = 128

ARCHS = {
    "llama": dict(rope_parameters=LLAMA3_ROPE),  # llama3 RoPE scaling: the inv_freq table is not the default one
    "mistral": {},
    "qwen2": {},  # q/k/v biases (randomized, so they matter)
    "qwen3": dict(tie_word_embeddings=True),  # q/k head norms; tied embeddings take the shared-table Gemm
}


@lru_cache(maxsize=None)
def model(kind: str):
    return tiny_model(kind, **ARCHS[kind])


def session(m, tmp_path, **graph) -> GraphSession:
    """Build the graph exactly as the exporter does (same graph_info) and load it in ORT."""
    info = write_graph(m, "target", GraphOptions(**graph), MAX_CONTEXT, tmp_path, quiet=True)
    return GraphSession(tmp_path / info["file"], info, threads=1, device="cpu")


def check_report(report, max_diff, min_top1):
    """Worst logit difference over every case; top-1 agreement averaged over the cases (8-64 rows each)."""
    assert set(report) == {"prefill_32+decode", "tree_no_past", "tree_after_past", "batch_2"}
    worst = max(case["max_abs_diff"] for case in report.values())
    top1 = np.mean([case["top1_agreement"] for case in report.values()])
    assert worst < max_diff, report
    assert top1 >= min_top1, report


# ---- numerics against transformers -------------------------------------------------------------


def test_the_tiny_models_are_not_trivial():
    """Randomized weights: logits spread like a real model's, and the arch-specific weights are live."""
    for kind in ARCHS:
        logits = model(kind)(torch.arange(3, 20)[None]).logits
        assert logits.std() > 0.5, kind
    assert model("qwen2").model.layers[0].self_attn.q_proj.bias.abs().max() > 0.1
    assert (model("qwen3").model.layers[0].self_attn.k_norm.weight - 1).abs().max() > 0.1
    rotary = model("llama").model.rotary_emb
    default = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    assert not torch.allclose(rotary.inv_freq, default)  # llama3 scaling changed some frequencies


@pytest.mark.parametrize("flavour", ["ort", "onnx"])
@pytest.mark.parametrize("kind", list(ARCHS))
def test_fp32_matches_transformers(kind, flavour, tmp_path):
    report = validate.compare(model(kind), session(model(kind), tmp_path, flavour=flavour))
    check_report(report, max_diff=1e-4, min_top1=1.0)


@pytest.mark.parametrize("kind", list(ARCHS))
def test_a_chain_only_graph_matches_transformers_on_chains(kind, tmp_path):
    """Plain decoding's graph (GQA's causal path, no tree bias): exact on prefill, decode, chains with and without
    past, and a batch of two with per-row pasts; its prelude has no tree-mask nodes (Where, GatherElements, Pad)."""
    s = session(model(kind), tmp_path, chain_only=True)
    report = validate.compare(model(kind), s, chain_only=True)
    assert set(report) == {"prefill_32+decode", "chain_no_past", "chain_after_past", "batch_2"}
    assert max(case["max_abs_diff"] for case in report.values()) < 1e-4, report
    import onnx

    ops = {n.op_type for n in onnx.load(str(tmp_path / "target.onnx"), load_external_data=False).graph.node}
    assert not ops & {"GatherElements", "Pad", "Where"}, ops
    with pytest.raises(UserError, match="chain-only"):
        GraphOptions(flavour="onnx", chain_only=True).check(arch.dims_from_config(model(kind).config))


# Measured on these tiny models (logit std ~1; max |diff| / mean top-1): int8 ort 0.16 / 98%, onnx 0.11 / 97%
# (ort's DynamicQuantizeMatMul also quantizes activations; onnx's DequantizeLinear is weight-only);
# int4 0.98 / 59% (both flavours); fp16 6e-3 / 100%. Bounds: (max |diff|, mean top-1 floor).
QUANTIZED = {"int8": (0.3, 0.8), "int4": (1.5, 0.4), "fp16": (2e-2, 0.95)}


@pytest.mark.parametrize("flavour", ["ort", "onnx"])
@pytest.mark.parametrize("precision", list(QUANTIZED))
def test_quantized_close_to_transformers(precision, flavour, tmp_path):
    m = model("llama")
    s = session(m, tmp_path, precision=precision, flavour=flavour)
    if precision == "fp16":
        assert s.dtype == np.float16 and s.new_cache(4).buffers[0].dtype == np.float16
    max_diff, min_top1 = QUANTIZED[precision]
    check_report(validate.compare(m, s), max_diff, min_top1)


def test_int4_onnx_and_ort_agree(tmp_path):
    """Blockwise QDQ (onnx) and MatMulNBits (ort) are the same quantized weights.

    The vocab (259) is odd: the lm_head's UINT4 initializer [64, 259] must be packed over the flattened data.
    """
    m = model("llama")
    assert m.config.vocab_size % 2 == 1
    ids = np.array([[5, 9, 77, 3, 120, 42]])
    outs = []
    for flavour in ("ort", "onnx"):
        (tmp_path / flavour).mkdir()
        s = session(m, tmp_path / flavour, precision="int4", flavour=flavour)
        steps = [validate.Step(ids, tree.chain(6).tolist())]
        outs.append(validate.graph_steps(s, steps)[0])
    np.testing.assert_allclose(outs[0], outs[1], atol=0.05)  # measured 1e-6; a layout error is O(1)


# ---- auxiliary outputs --------------------------------------------------------------------------


@pytest.mark.parametrize("flavour", ["ort", "onnx"])
def test_aux_layers_are_layer_inputs(flavour, tmp_path):
    """layer_input.i equals transformers' hidden_states[i] (index 0 = embeddings); hidden_states is final-normed."""
    m = model("qwen2")
    s = session(m, tmp_path, flavour=flavour, aux_layers=(0, 1))
    names = [o["name"] for o in s.info["outputs"]]
    assert names[:4] == ["logits", "hidden_states", "layer_input.0", "layer_input.1"]
    assert s.info["aux_layers"] == [0, 1]

    ids = np.array([[7, 100, 31, 4, 250, 18, 66]])
    cache = s.new_cache(16)
    t = ids.shape[1]
    want = ("logits", "hidden_states", "layer_input.0", "layer_input.1")
    got = s.forward(cache, ids, np.arange(t)[None], tree.causal_mask(t), np.arange(t), want)
    with torch.no_grad():
        ref = m.model(input_ids=torch.from_numpy(ids), output_hidden_states=True)
    for i in (0, 1):
        np.testing.assert_allclose(got[f"layer_input.{i}"], ref.hidden_states[i].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got["hidden_states"], ref.last_hidden_state.numpy(), rtol=1e-5, atol=1e-5)
    assert got["logits"].shape == (t, m.config.vocab_size)


def test_aux_layers_select_only_those_asked(tmp_path):
    s = session(model("llama"), tmp_path, aux_layers=(1,))
    names = [o["name"] for o in s.info["outputs"]]
    assert "layer_input.1" in names and "layer_input.0" not in names


# ---- the KV cache is written in place -----------------------------------------------------------


def reference_cache_steps(m, steps):
    """transformers' DynamicCache after each (ids, parents) step, fed the same tree bias and positions."""
    from transformers import DynamicCache

    cache, past, keys = DynamicCache(config=m.config), 0, []
    for ids, parents in steps:
        with torch.no_grad():
            m(input_ids=torch.from_numpy(ids), position_ids=torch.from_numpy(past + tree.depths(parents)[None]),
              attention_mask=torch.from_numpy(tree.attention_bias(parents, past)), cache=cache, use_cache=True)
        keys.append([(layer.keys.numpy().copy(), layer.values.numpy().copy()) for layer in cache.layers])
        past += ids.shape[1]
    return keys


@pytest.mark.parametrize("flavour", ["ort", "onnx"])
def test_kv_written_in_place(flavour, tmp_path):
    m = model("llama")
    s = session(m, tmp_path, flavour=flavour)
    layers = m.config.num_hidden_layers
    prefill, branch = (np.array([[11, 200, 35, 6, 90]]), tree.chain(5)), (np.array([[41, 7, 150]]), np.array([-1, 0, 0]))
    ref = reference_cache_steps(m, [prefill, branch])

    cache = s.new_cache(16)
    buffers = list(cache.buffers)
    for step, (ids, parents) in enumerate([prefill, branch]):
        past, t = cache.length, ids.shape[1]
        s.forward(cache, ids, past + tree.depths(parents)[None], tree.ancestor_mask(parents), np.array([t - 1]))
        if step == 0:
            before = [b.copy() for b in cache.buffers]
        cache.advance(t)

    assert all(a is b for a, b in zip(buffers, cache.buffers))  # the very arrays the graph wrote into
    for i in range(layers):
        for j in (0, 1):  # key, value
            buf = cache.buffers[2 * i + j]
            full = ref[1][i][j]  # [1, kv_heads, 8, head_dim]
            assert (np.abs(before[2 * i + j][:, :, :5]).max(axis=-1) > 0).all()  # every written row is non-zero
            np.testing.assert_allclose(before[2 * i + j][:, :, :5], ref[0][i][j], rtol=1e-5, atol=1e-5)
            assert not before[2 * i + j][:, :, 5:].any()  # nothing beyond the rows written
            np.testing.assert_array_equal(buf[:, :, :5], before[2 * i + j][:, :, :5])  # past rows untouched
            np.testing.assert_allclose(buf[:, :, 5:8], full[:, :, 5:8], rtol=1e-5, atol=1e-5)
            assert not buf[:, :, 8:].any()


def test_forward_refuses_to_overflow_the_cache(tmp_path):
    s = session(model("mistral"), tmp_path)
    cache = s.new_cache(4)
    with pytest.raises(ValueError, match="KV cache overflow: 0 \\+ 5 > capacity 4"):
        s.forward(cache, np.ones((1, 5), np.int64), np.arange(5)[None], tree.causal_mask(5), np.array([4]))


# ---- what is not supported ----------------------------------------------------------------------


def test_unsupported_architecture():
    from transformers import GPT2Config

    with pytest.raises(UserError, match="unsupported architecture 'gpt2'; supported: cohere2, gemma, gemma2, "
                                        "gemma3_text, gpt_oss, granite, llama, mistral, mixtral, olmo2, olmo3, phi3, "
                                        "phimoe, qwen2, qwen3, qwen3_moe, smollm3$"):
        arch.dims_from_config(GPT2Config())
    with pytest.raises(UserError, match="unsupported architecture 'deepseek_v3'"):
        arch.spec_for("deepseek_v3")


def test_unsupported_rope_and_activation():
    with pytest.raises(UserError, match="unsupported RoPE type 'dynamic'"):
        arch.dims_from_config(tiny_config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}))
    with pytest.raises(UserError, match="unsupported MLP activation 'tanh'"):
        arch.dims_from_config(tiny_config("llama", hidden_act="tanh"))


@pytest.mark.parametrize("aux", [(2,), (-1,), (0, 5)])
def test_aux_layer_out_of_range(aux):
    dims = arch.dims_from_config(model("llama").config)
    with pytest.raises(UserError, match="out of range: the model has 2 layers"):
        GraphOptions(aux_layers=aux).check(dims)


def test_builder_checks_options():
    m = model("llama")
    spec, dims = arch.spec_for("llama"), arch.dims_from_config(m.config)
    weights = extract_weights(spec, dims, m.state_dict())
    rope = arch.rope_tables(np.ones(8, np.float32), 1.0, 8)
    for bad, match in [(dict(aux_layers=(3,)), "out of range"), (dict(precision="int3"), "unknown precision 'int3'"),
                       (dict(flavour="tensorrt"), "unknown graph flavour 'tensorrt'"),
                       (dict(flavour="trt", precision="int8"), "trt flavour takes precision")]:
        with pytest.raises(UserError, match=match):
            DecoderGraphBuilder(spec, dims, weights, GraphOptions(**bad), rope)


def test_int4_qdq_needs_whole_blocks():
    m = tiny_model("mistral", intermediate_size=80)  # down_proj's input dim 80 is not a multiple of 32
    spec, dims = arch.spec_for("mistral"), arch.dims_from_config(m.config)
    weights = extract_weights(spec, dims, m.state_dict())
    builder = DecoderGraphBuilder(spec, dims, weights, GraphOptions(precision="int4", flavour="onnx"),
                                 arch.rope_tables(np.ones(8, np.float32), 1.0, 8))
    with pytest.raises(UserError, match="int4 needs input dims divisible by 32; layers.0.down has 80"):
        builder.build()


def test_weights_are_loaded_strictly():
    m = model("mistral")
    spec, dims = arch.spec_for("mistral"), arch.dims_from_config(m.config)
    state = dict(m.state_dict())
    assert set(extract_weights(spec, dims, state)) == set(arch.weight_table(spec, dims, m.config))
    missing = {k: v for k, v in state.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(UserError, match="missing weight 'model.layers.1.mlp.up_proj.weight' for mistral"):
        extract_weights(spec, dims, missing)
    with pytest.raises(UserError, match="unexpected weights for mistral: model.layers.0.self_attn.q_proj.bias"):
        extract_weights(spec, dims, {**state, "model.layers.0.self_attn.q_proj.bias": torch.zeros(64)})
    misshapen = {**state, "model.norm.weight": torch.ones(65)}
    with pytest.raises(UserError, match=r"weight 'model.norm.weight' has shape \(65,\), expected \(64,\)"):
        extract_weights(spec, dims, misshapen)


# ---- ragged rows: a batched step computes its real rows only --------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen3"])  # qwen3: its q/k head norms run in the padded layout
def test_ragged_rows_equal_the_padded_call(kind, tmp_path):
    """A batched step of trees of different sizes, padded to the widest: told which rows are real (`live`), the
    ort tree graph computes only those, and their logits, hidden states, layer inputs and cache rows are the padded
    call's, bit for bit at fp32; a batch row with no real row (a cancelled sequence) writes nothing anyone reads."""
    m = model(kind)
    s = session(m, tmp_path, aux_layers=(1,))
    assert s.ragged and {"live_rows", "padded_rows"} <= {i["name"] for i in s.info["inputs"]}
    rng = np.random.default_rng(3)
    n, width, lengths = 4, 5, [7, 12, 3, 9]
    caches = []
    for _ in range(2):  # one pool for the padded call, one for the ragged one, both after the same prefills
        pool = s.new_pool(n, 32)
        for b, length in enumerate(lengths):
            ids = np.random.default_rng(b).integers(0, m.config.vocab_size, (1, length))
            s.forward(pool.slot(b), ids, np.arange(length)[None], tree.causal_mask(length), np.array([length - 1]))
            pool.slot(b).commit(list(range(length)))
        caches.append(pool)
    live = np.array([5, 1, 3, 0])
    trees = {0: [-1, 0, 0, 1, 2], 1: [-1], 2: [-1, 0, 1]}
    ids = rng.integers(0, m.config.vocab_size, (n, width))
    positions = np.array(lengths)[:, None] + np.zeros(width, np.int64)
    mask = np.broadcast_to(np.eye(width, dtype=np.bool_), (n, width, width)).copy()
    rows = []
    for b, parents in trees.items():
        positions[b, :len(parents)] += tree.depths(parents)
        mask[b, :len(parents), :len(parents)] = tree.ancestor_mask(parents)
        rows += [b * width + r for r in range(len(parents))]
    want = ("logits", "hidden_states", "layer_input.1")
    padded = s.forward(caches[0].rows(n), ids, positions, mask, np.array(rows), want)
    ragged = s.forward(caches[1].rows(n), ids, positions, mask, np.array(rows), want, live=live)
    np.testing.assert_array_equal(ragged["logits"], padded["logits"])
    for name in want[1:]:
        for b, parents in trees.items():
            np.testing.assert_array_equal(ragged[name][b, :len(parents)], padded[name][b, :len(parents)])
    for ours, theirs in zip(caches[1].buffers, caches[0].buffers):
        for b, parents in trees.items():  # the past and the step's real rows
            np.testing.assert_array_equal(ours[b, :, :lengths[b] + len(parents)], theirs[b, :, :lengths[b] + len(parents)])
        np.testing.assert_array_equal(ours[3, :, :lengths[3]], theirs[3, :, :lengths[3]])  # no real row: its past kept
    with pytest.raises(ValueError, match="do not fit"):
        s.forward(caches[1].rows(n), ids, positions, mask, np.array(rows), want, live=np.array([6, 1, 3, 0]))


def test_a_plain_step_is_laid_out_as_two_rows_and_returns_one(tmp_path):
    """Plain decoding's chain-only graph takes ragged rows too: its one-row steps run as two (the padding row for
    attention only, runtime/backends/layout.py), and the caller sees one row's outputs, the cache one row longer."""
    s = session(model("llama"), tmp_path, chain_only=True)
    assert s.ragged and "live_rows" in {i["name"] for i in s.info["inputs"]}
    cache = s.new_cache(32)
    s.forward(cache, np.array([[5, 6, 7]]), np.arange(3)[None], np.tri(3, dtype=bool), np.array([2]))
    cache.advance(3)
    out = s.forward(cache, np.array([[8]]), np.array([[3]]), np.ones((1, 1), bool), np.array([0]),
                    want=("logits", "hidden_states"))
    assert out["logits"].shape[0] == 1 and out["hidden_states"].shape[:2] == (1, 1)
