"""EAGLE in ONNX: the draft decoder as its own graph with its own in-place KV cache, and the feature the
target graph returns for it.

Draft graph (same calling convention as the target graph: input_ids, position_ids, tree_mask, past_len,
logits_indices, one layer of past/present KV bound in place), plus `hidden` [1, T, h], the input hidden of each
new token (the target's feature for accepted tokens, the parent's draft output for tree nodes). Outputs:
`hidden_out` [1, T, h] and, for the selected rows, the draft's top-k as cumulative-score material:
`draft_logp` [rows, K] (log-softmax over the draft vocabulary) and `draft_tokens` [rows, K] (target ids, the
d2t map applied in the graph).

Target side: `eagle_features` [1, T, h] is what the draft needs for each row the target verified: EAGLE-3's
fc(cat(inputs of the aux layers)) (the fc runs inside the target graph, so only h floats per row leave it),
EAGLE-1's last hidden state after the final norm.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields, replace

import numpy as np
from onnx import TensorProto, helper

from specexport.exporter.arch import Dims, rope_tables
from specexport.exporter.eagle import EagleDraft, draft_rope
from specexport.exporter.graph import make_model

EAGLE_TOP_K = 10  # candidates per draft row in the graph: any --draft-top-k up to this runs on the bundle


@dataclass(frozen=True)
class TargetFeatures:
    """The target graph's extension: `eagle_features` [1, T, h] for the draft (the aux layers' inputs must be among
    the graph's aux_layers)."""

    draft: EagleDraft

    def add(self, builder, final: str, flat: str, accepted_row: str | None) -> list:
        if not set(self.draft.config.aux_layers) <= set(builder.opt.aux_layers):
            raise ValueError("an EAGLE-3 draft needs its aux layers among the graph's aux_layers")
        add_target_features(builder, self.draft, final)
        return [helper.make_tensor_value_info("eagle_features", builder.opt.compute_type,
                                              ["batch", "seq", self.draft.config.hidden])]


def draft_dims(draft, target_dims):
    """The draft decoder as a Dims (for the graph builder's blocks): plain Llama layers (with Qwen3's q/k norms and
    biases where the draft's weights have them), whatever the target's family."""
    c = draft.config
    return replace(Dims(**{f.name: getattr(target_dims, f.name) for f in fields(Dims) if f.default is MISSING}),
                   vocab=c.draft_vocab, hidden=c.hidden, intermediate=c.intermediate, layers=c.layers, heads=c.heads,
                   kv_heads=c.kv_heads, head_dim=c.head_dim, rms_eps=c.rms_eps,
                   tie_embeddings=target_dims.tie_embeddings and c.version == 1)


def draft_weights(draft, target_weights: dict) -> dict:
    """Our graph builder's names for the draft's tensors (its layers' names are the builder's but for the MLP's
    norm)."""
    w = {k.replace(".post_norm", ".mlp_norm"): v for k, v in draft.weights.items() if k.startswith("layers.")}
    w["embed"] = target_weights["embed"]
    w["lm_head"] = draft.weights["lm_head"] if draft.config.version == 3 else target_weights["lm_head"]
    return w


def rms_norm(builder, x: str, weight: np.ndarray, eps: float, name: str) -> str:
    """RMSNorm with the draft's epsilon, in the target graph whatever the target's own norms are."""
    g = builder.g
    w = g.const(name, weight, compute=True)
    if builder.ort:
        return g.op("SimplifiedLayerNormalization", [x, w], axis=-1, epsilon=eps)
    return g.op("RMSNormalization", [x, w], axis=-1, epsilon=eps, stash_type=1)


def add_target_features(builder, draft: EagleDraft, final: str) -> None:
    """Append `eagle_features` to the target graph (the aux layers' inputs are captured as layer_input.*), through
    the draft's feature norms (EAGLE 3.1) and fc for EAGLE-3."""
    g, c = builder.g, draft.config
    if c.version != 3:
        g.op("Identity", [builder.last_stream() if c.prenorm_feature else final], outputs=["eagle_features"])
        return
    parts = [f"layer_input.{i}" for i in c.aux_layers]
    if c.feature_norm == "each":
        parts = [rms_norm(builder, part, draft.weights[f"fc_norm.{k}"], c.rms_eps, f"eagle.fc_norm.{k}")
                 for k, part in enumerate(parts)]
    fused = g.op("Concat", parts, axis=-1) if len(parts) > 1 else parts[0]
    if c.feature_norm == "concat":
        fused = rms_norm(builder, fused, draft.weights["feature_norm"], c.rms_eps, "eagle.feature_norm")
    g.op("Identity", [builder.linear(fused, "eagle.fc", draft.weights["fc"])], outputs=["eagle_features"])


def rope_for(draft, max_positions: int):
    return rope_tables(*draft_rope(draft.config), max_positions)


def build_draft_graph(builder, draft):
    """The draft graph on a DecoderGraphBuilder made with draft_dims/draft_weights."""
    g, c, w = builder.g, draft.config, draft.weights
    et = builder.opt.compute_type
    inputs, outputs = builder.step_io(c.layers, (helper.make_tensor_value_info("hidden", et, ["batch", "seq", c.hidden]),))
    outputs[:0] = [helper.make_tensor_value_info("hidden_out", et, ["batch", "seq", c.hidden]),
                   helper.make_tensor_value_info("draft_logp", TensorProto.FLOAT, ["rows", EAGLE_TOP_K]),
                   helper.make_tensor_value_info("draft_tokens", TensorProto.INT64, ["rows", EAGLE_TOP_K])]
    lengths = builder.step_attention()
    embed = g.const("embed", builder.w["embed"], compute=True)
    emb = g.op("Gather", [embed, "input_ids"])
    if c.version == 3:
        e, _ = builder.norm(emb, None, w["in_norm"], "in_norm")
        h = builder.norm("hidden", None, w["hidden_norm"], "hidden_norm")[0] if c.hidden_norm else "hidden"
        x, stream = g.op("Concat", [e, h], axis=-1), (h if c.norm_before_residual else "hidden")
    elif c.mtp:
        keep = g.op("Cast", [g.op("Not", [g.op("Equal", ["position_ids", g.const("mtp.zero", np.array(0, np.int64))])])],
                    to=et)
        e, _ = builder.norm(g.op("Mul", [emb, g.op("Unsqueeze", [keep, g.const("mtp.last_axis", np.array([-1], np.int64))])]),
                            None, w["in_norm"], "in_norm")
        h, _ = builder.norm("hidden", None, w["hidden_norm"], "hidden_norm")
        stream = builder.linear(g.op("Concat", [h, e] if c.hidden_first else [e, h], axis=-1), "fc", w["fc"])
    else:
        x = stream = builder.linear(g.op("Concat", [emb, "hidden"], axis=-1), "fc", w["fc"], w.get("fc_bias"))
    for i in range(c.layers):
        p = f"layers.{i}."
        if i or c.mtp:
            x, _ = builder.norm(stream, None, w[p + "attn_norm"], p + "attn_norm")
        attn = builder.attention(i, x, lengths)
        h1 = g.op("Add", [stream, builder.linear(attn, p + "o", w[p + "o"], w.get(p + "o_bias"))])
        normed, _ = builder.norm(h1, None, w[p + "post_norm"], p + "mlp_norm")
        stream = g.op("Add", [h1, builder.mlp(normed, p, w[p + "gate"], w[p + "up"], w[p + "down"])])
    final_norm = c.final_norm if c.version == 3 else c.mtp
    final = builder.norm(stream, None, w["norm"], "norm")[0] if final_norm else stream
    g.op("Identity", [final if c.norm_output or c.mtp else stream], outputs=["hidden_out"])

    flat = g.op("Reshape", [final, g.const("flat_hidden", np.array([-1, c.hidden], np.int64))])
    rows = g.op("Gather", [flat, "logits_indices"], axis=0)
    logits = builder.linear(rows, "lm_head", w["lm_head"]) if c.version == 3 else builder.lm_head(rows)
    if et != TensorProto.FLOAT:
        logits = g.op("Cast", [logits], to=TensorProto.FLOAT)
    logp = g.op("LogSoftmax", [logits], axis=-1)
    values, index = g.op("TopK", [logp, g.const("top_k", np.array([EAGLE_TOP_K], np.int64))], outputs=2, axis=-1)
    g.op("Identity", [values], outputs=["draft_logp"])
    g.op("Gather", [g.const("hot_ids", draft.hot_ids), index], axis=0, outputs=["draft_tokens"])
    return make_model(helper.make_graph(g.nodes, "eagle_draft", inputs, outputs, initializer=g.initializers))
