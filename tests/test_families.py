"""Every model family's target graph against transformers, on tiny random models built offline from the family's own
config class, with sizes that are not powers of two (hidden 96, 3 heads over 1 KV head, intermediate 160) and windows
shorter than validation's prompts, so that every quirk, every window and every RoPE table is exercised: fp32 in the
ort, onnx and trt flavours on every shape class validate.compare checks (prefill, decode, trees with and without past,
batch 2), and the one-line refusals."""

from functools import lru_cache

import numpy as np
import pytest
import torch
from conftest import tiny_config, tiny_model
from test_graph import check_report

from specexport.errors import UserError
from specexport.exporter import arch, families, validate
from specexport.exporter.graph import GraphOptions
from specexport.exporter.save import write_graph
from specexport.exporter.tensorrt.lint import lint_path
from specexport.exporter.weights import extract_weights
from specexport.runtime.backends.host import GraphSession

MAX_CONTEXT = 128
ODD = dict(hidden_size=96, intermediate_size=160, num_attention_heads=3, num_key_value_heads=1, head_dim=32)
WINDOW = 8  # shorter than validation's 32-token prefill and its 20-token past
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
            "short_factor": [1.0 + 0.1 * i for i in range(8)], "long_factor": [2.0 + 0.5 * i for i in range(8)],
            "partial_rotary_factor": 0.5}  # fmt: skip

FAMILIES = {
    # Mistral with a window on every layer; Qwen2 with a window from layer 1 on
    "mistral_window": ("mistral", dict(ODD, sliding_window=WINDOW)),
    "qwen2_window": ("qwen2", dict(ODD, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)),
    "gemma": ("gemma", dict(ODD)),
    "gemma2": ("gemma2", dict(ODD, query_pre_attn_scalar=20, sliding_window=WINDOW, attn_logit_softcapping=3.0,
                              final_logit_softcapping=20.0)),
    "gemma3": ("gemma3_text", dict(ODD, query_pre_attn_scalar=20, sliding_window=WINDOW,
                                   layer_types=["sliding_attention", "full_attention"])),
    # Phi-3 with its window; Phi-4-mini's partial rotary (24 of 32 dims: rotated outside GQA, its halves are not a
    # multiple of 8); Phi-3.5's LongRoPE (a 128-position bundle past the original 16 takes the long factors)
    "phi3": ("phi3", dict(ODD, sliding_window=WINDOW, pad_token_id=None)),
    "phi4_partial": ("phi3", dict(ODD, pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                            "partial_rotary_factor": 0.75})),
    "phi3_longrope": ("phi3", dict(ODD, pad_token_id=None, rope_parameters=LONGROPE, original_max_position_embeddings=16)),
    "granite": ("granite", dict(ODD, embedding_multiplier=3.0, residual_multiplier=0.4, attention_multiplier=0.09,
                                logits_scaling=2.5)),
    "olmo2": ("olmo2", dict(ODD)),
    "olmo3": ("olmo3", dict(ODD, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])),
    "smollm3": ("smollm3", dict(ODD, pad_token_id=None, no_rope_layers=[1, 0], use_sliding_window=True,
                                sliding_window=WINDOW, layer_types=["full_attention", "sliding_attention"])),
    # mixtures of experts: Mixtral (8 experts, top 2, a window), Qwen3-MoE (6 experts of 80, the top 2 not
    # renormalized, layer 1 dense), GPT-OSS (sinks, router bias, clamped SwiGLU, interleaved experts, alternating
    # windows, YaRN)
    "mixtral": ("mixtral", dict(ODD, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW)),
    "qwen3_moe": ("qwen3_moe", dict(ODD, num_experts=6, num_experts_per_tok=2, moe_intermediate_size=80,
                                    mlp_only_layers=[1], norm_topk_prob=False)),
    "gpt_oss": ("gpt_oss", dict(ODD, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW)),
    # Phi-MoE: sparsemixer over 6 experts, LayerNorm with biases, an LM head bias, attention biases, a window
    "phimoe": ("phimoe", dict(ODD, num_local_experts=6, num_experts_per_tok=2, pad_token_id=None, lm_head_bias=True,
                              router_jitter_noise=0.3,
                              attention_bias=True, sliding_window=WINDOW)),
    # Cohere2: parallel blocks, LayerNorm, interleaved RoPE on the sliding layers only, logit scale
    "cohere2": ("cohere2", dict(ODD, pad_token_id=None, sliding_window=WINDOW, logit_scale=0.3,
                                layer_types=["sliding_attention", "full_attention"])),
}


@lru_cache(maxsize=None)
def model(kind: str):
    model_type, overrides = FAMILIES[kind]
    return tiny_model(model_type, **overrides)


def session(kind, folder, **graph) -> GraphSession:
    folder.mkdir(exist_ok=True)
    info = write_graph(model(kind), "target", GraphOptions(**graph), MAX_CONTEXT, folder, quiet=True)
    return GraphSession(folder / info["file"], info, threads=1, device="cpu")


def test_every_family_is_registered():
    assert set(families.supported()) >= {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text",
                                         "phi3", "granite", "olmo2", "olmo3", "smollm3"}


def test_the_quirks_are_live():
    """The tiny models exercise what they are here for: windows, soft-caps, scales, NoPE and partial rotary change
    the plan, and transformers' logits spread like a real model's."""
    plans = {kind: arch.dims_from_config(model(kind).config) for kind in FAMILIES}
    assert plans["mistral_window"].windows == (WINDOW, WINDOW)
    assert plans["qwen2_window"].windows == (0, WINDOW)
    assert plans["gemma3"].windows == (WINDOW, 0) and plans["gemma3"].rope_layers == ("sliding_attention",
                                                                                      "full_attention")
    assert plans["gemma2"].attn_softcap == 3.0 and plans["gemma2"].final_softcap == 20.0
    assert plans["gemma2"].attn_scale == pytest.approx(20 ** -0.5) and plans["gemma2"].activation == "gelu_tanh"
    assert plans["smollm3"].rope_layers == ("default", "") and plans["smollm3"].windows == (0, WINDOW)
    assert plans["phi4_partial"].rotary_dim == 24 and plans["phi3_longrope"].rotary_dim == 16
    assert plans["granite"].logits_scaling == 2.5 and plans["granite"].residual_scale == 0.4
    assert arch.longrope_policy(model("phi3_longrope").config, MAX_CONTEXT) == "long"
    assert arch.longrope_policy(model("phi3_longrope").config, 16) == "short"
    for kind in FAMILIES:
        assert model(kind)(torch.arange(3, 40)[None]).logits.std() > 0.3, kind


@pytest.mark.parametrize("flavour", ["ort", "onnx", "trt"])
@pytest.mark.parametrize("kind", list(FAMILIES))
def test_fp32_matches_transformers(kind, flavour, tmp_path):
    if flavour == "trt" and kind == "gemma2":  # TensorRT's Attention layer has no soft-cap: refused before any work
        with pytest.raises(UserError, match="gemma2: attention logit soft-capping cannot be expressed in TensorRT"):
            GraphOptions(flavour="trt").check(arch.dims_from_config(model(kind).config))
        return
    s = session(kind, tmp_path / "g", flavour=flavour)
    # fp32 rounding: a decode row's attention takes the many-row kernel (runtime/backends/layout.py), whose
    # order differs from transformers' by up to ~1.1e-4 on Gemma 3's scaled logits
    check_report(validate.compare(model(kind), s, max_context=MAX_CONTEXT), max_diff=2e-4, min_top1=1.0)
    if flavour == "trt":  # the lint finds nothing TensorRT cannot parse (fp32 is a warning: not what trt is for)
        assert lint_path(tmp_path / "g").errors == []


@pytest.mark.parametrize("kind", list(FAMILIES))
def test_attention_rows_match_transformers(kind, tmp_path, rows4_library):
    """Our attention kernel (--attention-rows) in every family whose attention it takes (scales, partial rotary,
    q/k norms, LongRoPE, experts); a family with windows or sinks is refused in one line before any work."""
    dims = arch.dims_from_config(model(kind).config)
    if dims.sinks or any(dims.windows):
        with pytest.raises(UserError, match="sliding-window layers, which specexport's attention kernel does not take"):
            GraphOptions(attention_rows=True).check(dims)
        return
    s = session(kind, tmp_path / "g", attention_rows=True)
    check_report(validate.compare(model(kind), s, max_context=MAX_CONTEXT), max_diff=2e-4, min_top1=1.0)


@pytest.mark.parametrize("kind", ["gemma3", "mistral_window", "smollm3", "mixtral", "gpt_oss"])
def test_chain_only_graphs_keep_the_windows(kind, tmp_path):
    """Plain decoding's graph (GQA's causal path) masks the windows from positions alone."""
    s = session(kind, tmp_path / "g", chain_only=True)
    report = validate.compare(model(kind), s, chain_only=True, max_context=MAX_CONTEXT)
    assert max(case["max_abs_diff"] for case in report.values()) < 2e-4, report  # fp32 rounding, as above


def test_a_window_wider_than_the_context_builds_no_window_mask(tmp_path):
    """A window the bundle's context never fills is left out of the graph (a 4096-window Mistral built for 128)."""
    import onnx

    m = tiny_model("mistral", **dict(ODD, sliding_window=4096))
    write_graph(m, "target", GraphOptions(chain_only=True), MAX_CONTEXT, tmp_path, quiet=True)
    ops = {n.op_type for n in onnx.load(str(tmp_path / "target.onnx"), load_external_data=False).graph.node}
    assert "LessOrEqual" not in ops and "Where" not in ops


def test_head_dim_the_ort_kernel_cannot_take(tmp_path):
    """head_dim 24: the ort flavour refuses in one line naming the flavour that takes it; onnx matches."""
    m = tiny_model("qwen3", **dict(ODD, head_dim=24))
    dims = arch.dims_from_config(m.config)
    with pytest.raises(UserError, match="head_dim 24: .*GroupQueryAttention.*--flavour onnx"):
        GraphOptions(flavour="ort").check(dims)
    info = write_graph(m, "target", GraphOptions(flavour="onnx"), MAX_CONTEXT, tmp_path, quiet=True)
    s = GraphSession(tmp_path / info["file"], info, threads=1, device="cpu")
    check_report(validate.compare(m, s), max_diff=1e-4, min_top1=1.0)


def test_fused_checkpoint_matrices_are_split_strictly():
    """Phi-3's qkv_proj and gate_up_proj are sliced into q, k, v, gate, up; a fused matrix of the wrong size is
    one line naming it."""
    m = model("phi3")
    family, dims = families.get("phi3"), arch.dims_from_config(m.config)
    state = m.state_dict()
    w = extract_weights(family, dims, state, m.config)
    qkv = state["model.layers.0.self_attn.qkv_proj.weight"].numpy()
    assert np.array_equal(np.concatenate([w["layers.0.q"], w["layers.0.k"], w["layers.0.v"]]), qkv)
    bad = {**state, "model.layers.0.mlp.gate_up_proj.weight": torch.zeros(300, 96)}
    with pytest.raises(UserError, match=r"'model.layers.0.mlp.gate_up_proj.weight' has shape \(300, 96\), expected "
                                        r"\(320, 96\)"):
        extract_weights(family, dims, bad, m.config)


@pytest.mark.parametrize("config, match", [
    (tiny_config("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}),
     "unsupported RoPE type 'dynamic'"),
    (tiny_config("llama", hidden_act="tanh"), "unsupported MLP activation 'tanh'"),
    (tiny_config("gemma3_text", **dict(ODD, use_bidirectional_attention=True)), "bidirectional attention"),
    (tiny_config("phi3", **dict(ODD, pad_token_id=None, rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                         "partial_rotary_factor": 0.3})),
     "unsupported partial rotary: 9 of head_dim 32"),
])  # fmt: skip
def test_unsupported_combinations_are_one_line(config, match):
    with pytest.raises(UserError, match=match):
        arch.dims_from_config(config)
