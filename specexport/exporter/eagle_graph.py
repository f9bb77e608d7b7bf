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
from specexport.exporter.eagle import EagleDraft
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
    """The draft decoder as a one-layer Dims (for the graph builder's blocks): a plain Llama layer, whatever the
    target's family."""
    c = draft.config
    return replace(Dims(**{f.name: getattr(target_dims, f.name) for f in fields(Dims) if f.default is MISSING}),
                   vocab=c.draft_vocab, hidden=c.hidden, intermediate=c.intermediate, layers=1, heads=c.heads,
                   kv_heads=c.kv_heads, head_dim=c.head_dim, rms_eps=c.rms_eps,
                   tie_embeddings=target_dims.tie_embeddings and c.version == 1)


def draft_weights(draft, target_weights: dict) -> dict:
    """Our graph builder's names for the draft's tensors (the layer as layers.0.*)."""
    w = {f"layers.0.{k}": v for k, v in draft.weights.items() if k in ("q", "k", "v", "o", "gate", "up", "down")}
    w["layers.0.mlp_norm"] = draft.weights["post_norm"]
    w["embed"] = target_weights["embed"]
    w["lm_head"] = draft.weights["lm_head"] if draft.config.version == 3 else target_weights["lm_head"]
    return w


def add_target_features(builder, draft: EagleDraft, final: str) -> None:
    """Append `eagle_features` to the target graph (the aux layers' inputs are captured as layer_input.*)."""
    g = builder.g
    if draft.config.version == 3:
        parts = [f"layer_input.{i}" for i in draft.config.aux_layers]
        fused = g.op("Concat", parts, axis=-1)
        g.op("Identity", [builder.linear(fused, "eagle.fc", draft.weights["fc"])], outputs=["eagle_features"])
    else:
        g.op("Identity", [final], outputs=["eagle_features"])


def rope_for(draft, max_positions: int):
    d = draft.config.head_dim
    inv = 1.0 / draft.config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)
    return rope_tables(inv.astype(np.float32), 1.0, max_positions)


def build_draft_graph(builder, draft):
    """The draft graph on a DecoderGraphBuilder made with draft_dims/draft_weights (one layer)."""
    g, c, w = builder.g, draft.config, draft.weights
    et = builder.opt.compute_type
    inputs, outputs = builder.step_io(1, (helper.make_tensor_value_info("hidden", et, ["batch", "seq", c.hidden]),))
    outputs[:0] = [helper.make_tensor_value_info("hidden_out", et, ["batch", "seq", c.hidden]),
                   helper.make_tensor_value_info("draft_logp", TensorProto.FLOAT, ["rows", EAGLE_TOP_K]),
                   helper.make_tensor_value_info("draft_tokens", TensorProto.INT64, ["rows", EAGLE_TOP_K])]
    lengths = builder.step_attention()
    embed = g.const("embed", builder.w["embed"], compute=True)
    emb = g.op("Gather", [embed, "input_ids"])
    if c.version == 3:
        e, _ = builder.norm(emb, None, w["in_norm"], "in_norm")
        h, _ = builder.norm("hidden", None, w["hidden_norm"], "hidden_norm")
        x, residual = g.op("Concat", [e, h], axis=-1), "hidden"
    else:
        x = residual = builder.linear(g.op("Concat", [emb, "hidden"], axis=-1), "fc", w["fc"], w.get("fc_bias"))
    attn = builder.attention(0, x, lengths)
    h1 = g.op("Add", [residual, builder.linear(attn, "layers.0.o", builder.w["layers.0.o"])])
    normed, _ = builder.norm(h1, None, w["post_norm"], "layers.0.mlp_norm")
    out = g.op("Add", [h1, builder.mlp(normed, "layers.0.", w["gate"], w["up"], w["down"])])
    g.op("Identity", [out], outputs=["hidden_out"])

    flat = g.op("Reshape", [out, g.const("flat_hidden", np.array([-1, c.hidden], np.int64))])
    rows = g.op("Gather", [flat, "logits_indices"], axis=0)
    if c.version == 3:
        rows, _ = builder.norm(rows, None, w["norm"], "norm")
        logits = builder.linear(rows, "lm_head", w["lm_head"])
    else:
        logits = builder.lm_head(rows)
    if et != TensorProto.FLOAT:
        logits = g.op("Cast", [logits], to=TensorProto.FLOAT)
    logp = g.op("LogSoftmax", [logits], axis=-1)
    values, index = g.op("TopK", [logp, g.const("top_k", np.array([EAGLE_TOP_K], np.int64))], outputs=2, axis=-1)
    g.op("Identity", [values], outputs=["draft_logp"])
    g.op("Gather", [g.const("hot_ids", draft.hot_ids), index], axis=0, outputs=["draft_tokens"])
    return make_model(helper.make_graph(g.nodes, "eagle_draft", inputs, outputs, initializer=g.initializers))
