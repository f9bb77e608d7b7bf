"""Mixture-of-experts specifics: the int4 and int8 expert layouts are exactly what ONNX Runtime's QMoE reads (its
output equals the fp32 MoE op's on our dequantization of them), experts map from transformers' fused tensors in
every stored layout, and bad MoE configs and checkpoints are one line. The families' graphs against transformers are
in test_families.py."""

import numpy as np
import onnxruntime as ort
import pytest
import torch
from conftest import tiny_config
from onnx import TensorProto, helper, numpy_helper
from test_families import ODD, model

from specexport.errors import UserError
from specexport.exporter import arch, families, quant
from specexport.exporter.weights import extract_weights

TOKENS, HIDDEN, EXPERTS, TOP_K = 7, 96, 6, 2


def run_moe(op: str, weights: dict, x: np.ndarray, logits: np.ndarray, **attrs) -> np.ndarray:
    """One com.microsoft MoE or QMoE node over `weights` (its inputs after the router's, "" for an absent one)."""
    node = helper.make_node(op, ["x", "logits", *weights], ["y"], domain="com.microsoft", k=TOP_K,
                            activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=1,
                            activation_alpha=1.0, activation_beta=0.0, **attrs)
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, HIDDEN]),
              helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, EXPERTS])]
    graph = helper.make_graph([node], "moe", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(v, k) for k, v in weights.items() if k])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x, "logits": logits})[0]


def dequantize(q: np.ndarray, scale: np.ndarray, bits: int, in_dim: int) -> np.ndarray:
    """Our reading of QMoE's layout: uint8 codes (int4: two a byte, low nibble first) minus 2^(bits-1), times the
    row's (int8) or block's (int4) scale."""
    if bits == 4:
        q = np.stack([q & 0x0F, q >> 4], axis=-1).reshape(*q.shape[:-1], -1)
    codes = q.astype(np.float32) - 2 ** (bits - 1)
    if bits == 8:
        return codes * scale[..., None]
    return (codes.reshape(*scale.shape, -1) * scale[..., None]).reshape(*q.shape[:-1], in_dim)


@pytest.mark.parametrize("bits, inter, block", [(8, 80, 0), (4, 80, 16), (4, 128, 32)])
def test_quantized_experts_are_what_qmoe_reads(bits, inter, block):
    rng = np.random.default_rng(bits + inter)
    fc1 = rng.standard_normal((EXPERTS, 2 * inter, HIDDEN)).astype(np.float32) / HIDDEN ** 0.5
    fc2 = rng.standard_normal((EXPERTS, HIDDEN, inter)).astype(np.float32) / inter ** 0.5
    x = rng.standard_normal((TOKENS, HIDDEN)).astype(np.float32)
    logits = rng.standard_normal((TOKENS, EXPERTS)).astype(np.float32)
    if bits == 4:
        assert quant.qmoe_block(HIDDEN, inter) == block
    (q1, s1), (q2, s2) = quant.qmoe_experts(fc1, bits, block), quant.qmoe_experts(fc2, bits, block)
    attrs = {"expert_weight_bits": bits, **({"block_size": block} if block else {})}
    got = run_moe("QMoE", {"fc1": q1, "fc1_scales": s1, "": None, "fc2": q2, "fc2_scales": s2}, x, logits, **attrs)
    deq1, deq2 = dequantize(q1, s1, bits, HIDDEN), dequantize(q2, s2, bits, inter)
    want = run_moe("MoE", {"fc1": deq1, "": None, "fc2": deq2}, x, logits)
    assert np.abs(got - want).max() < 1e-5
    # and the codes are faithful: within half a step of the originals
    step = np.repeat(s1, block, axis=-1) if bits == 4 else s1[..., None]
    assert np.all(np.abs(deq1 - fc1) <= step / 2 + 1e-6)


def test_int4_experts_need_sizes_qmoe_takes():
    with pytest.raises(UserError, match="int4 experts need hidden and expert sizes divisible by 16"):
        quant.qmoe_block(96, 72)


@pytest.mark.parametrize("kind", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_experts_map_from_every_stored_layout(kind):
    """Expert e's gate, up and down as transformers computes them: Mixtral and Qwen3-MoE store gate rows then up
    rows of [E, 2I, hidden]; GPT-OSS stores x @ W [E, hidden, 2I] with gate and up interleaved, and biases."""
    m = model(kind)
    family, dims = families.get(m.config.model_type), arch.dims_from_config(m.config)
    w = extract_weights(family, dims, m.state_dict(), m.config)
    experts = m.model.layers[0].mlp.experts
    x = torch.randn(3, dims.hidden)
    for e in (0, dims.experts - 1):
        gate, up = x.numpy() @ w["layers.0.experts.gate"][e].T, x.numpy() @ w["layers.0.experts.up"][e].T
        if family.experts.biases:
            gate, up = gate + w["layers.0.experts.gate_bias"][e], up + w["layers.0.experts.up_bias"][e]
        if family.experts.transposed:
            fused = (x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e]).detach().numpy()
            want_gate, want_up = fused[:, 0::2], fused[:, 1::2]
        else:
            want_gate, want_up = np.split((x @ experts.gate_up_proj[e].T).detach().numpy(), 2, axis=-1)
        assert np.allclose(gate, want_gate, atol=1e-5) and np.allclose(up, want_up, atol=1e-5)
        assert w["layers.0.experts.down"][e].shape == (dims.hidden, dims.expert_dim)


def test_the_moe_plan():
    plans = {kind: arch.dims_from_config(model(kind).config) for kind in ("mixtral", "qwen3_moe", "gpt_oss")}
    assert (plans["mixtral"].experts, plans["mixtral"].top_k, plans["mixtral"].renormalize) == (8, 2, True)
    assert plans["qwen3_moe"].moe_layers == (True, False) and not plans["qwen3_moe"].renormalize
    assert plans["qwen3_moe"].expert_dim == 80 and plans["qwen3_moe"].intermediate == 160
    assert plans["gpt_oss"].swiglu == (1.702, 1.0, 7.0) and plans["gpt_oss"].sinks
    assert plans["gpt_oss"].windows == (8, 0)


@pytest.mark.parametrize("config, match", [
    (tiny_config("mixtral", **dict(ODD, num_local_experts=4, num_experts_per_tok=6)),
     "num_experts_per_tok 6 must be in 1..4"),
    (tiny_config("mixtral", **dict(ODD, hidden_act="gelu")), "unsupported expert activation 'gelu'"),
])  # fmt: skip
def test_bad_moe_configs_are_one_line(config, match):
    with pytest.raises(UserError, match=match):
        arch.dims_from_config(config)


def test_a_checkpoint_missing_its_experts_is_one_line():
    m = model("mixtral")
    family, dims = families.get("mixtral"), arch.dims_from_config(m.config)
    state = {k: v for k, v in m.state_dict().items() if not k.endswith("layers.1.mlp.experts.down_proj")}
    with pytest.raises(UserError, match="missing weight 'model.layers.1.mlp.experts.down_proj' for mixtral"):
        extract_weights(family, dims, state, m.config)
