"""DFlash in ONNX: the block draft as its own graph with its own in-place cache of context rows, and the context
feature the target graph returns for it.

Draft graph (the step graphs' calling convention: input_ids, position_ids, tree_mask, past_len, logits_indices,
its layers' past/present KV in place), plus `context` [1, T, h] and `context_rows` [1, T] (bool): a call's rows are
the context rows committed since the last call (their keys and values are made from `context`, their own outputs
unused) and then the block (the last committed token and mask tokens, whose keys and values come from their own
hidden states), under the tree mask: context rows causal, block rows seeing every row. The cache keeps the context
rows (the runtime advances it by them); the block's rows are written past them and overwritten by the next call.
Outputs: `draft_logp` [rows, K] and `draft_tokens` [rows, K], the top K of the selected rows' log-softmax over the
target's vocabulary. Attention with a mask that is not causal takes the standard Attention op: the ort flavour's
draft graph is built in the onnx flavour (GroupQueryAttention masks causally).

Target side: `dflash_context` [1, T, h] = hidden_norm(fc(cat(inputs of the target layers))) for each verified row.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields, replace

import numpy as np
from onnx import TensorProto, helper

from specexport.exporter.arch import Dims, rope_tables
from specexport.exporter.dflash import DFlashDraft
from specexport.exporter.eagle import draft_rope
from specexport.exporter.eagle_graph import rms_norm
from specexport.exporter.graph import make_model

DFLASH_TOP_K = 10  # candidates per block row in the graph


@dataclass(frozen=True)
class DFlashContext:
    """The target graph's extension: `dflash_context` [1, T, h]."""

    draft: DFlashDraft

    def add(self, builder, final: str, flat: str, accepted_row: str | None) -> list:
        c, g = self.draft.config, builder.g
        if not set(c.target_layers) <= set(builder.opt.aux_layers):
            raise ValueError("a DFlash draft needs its target layers among the graph's aux_layers")
        parts = [f"layer_input.{i}" for i in c.target_layers]
        fused = g.op("Concat", parts, axis=-1) if len(parts) > 1 else parts[0]
        ctx = rms_norm(builder, builder.linear(fused, "dflash.fc", self.draft.weights["fc"]),
                       self.draft.weights["hidden_norm"], c.rms_eps, "dflash.hidden_norm")
        g.op("Identity", [ctx], outputs=["dflash_context"])
        return [helper.make_tensor_value_info("dflash_context", builder.opt.compute_type, ["batch", "seq", c.hidden])]


def draft_dims(draft: DFlashDraft, target_dims: Dims) -> Dims:
    c = draft.config
    return replace(Dims(**{f.name: getattr(target_dims, f.name) for f in fields(Dims) if f.default is MISSING}),
                   hidden=c.hidden, intermediate=c.intermediate, layers=c.layers, heads=c.heads, kv_heads=c.kv_heads,
                   head_dim=c.head_dim, rms_eps=c.rms_eps,
                   tie_embeddings=target_dims.tie_embeddings and not c.draft_vocab)


def draft_weights(draft: DFlashDraft, target_weights: dict) -> dict:
    w = {k.replace(".post_norm", ".mlp_norm"): v for k, v in draft.weights.items() if k.startswith("layers.")}
    w["embed"] = target_weights["embed"]
    w["lm_head"] = draft.weights["lm_head"] if draft.config.draft_vocab else target_weights["lm_head"]
    return w


def rope_for(draft: DFlashDraft, max_positions: int):
    return rope_tables(*draft_rope(draft.config), max_positions)


def build_draft_graph(builder, draft: DFlashDraft):
    """The block draft graph on a DecoderGraphBuilder made with draft_dims/draft_weights (onnx or trt flavour)."""
    g, c, w = builder.g, draft.config, draft.weights
    et = builder.opt.compute_type
    extra = (helper.make_tensor_value_info("context", et, ["batch", "seq", c.hidden]),
             helper.make_tensor_value_info("context_rows", TensorProto.BOOL, ["batch", "seq"]))
    inputs, outputs = builder.step_io(c.layers, extra)
    outputs[:0] = [helper.make_tensor_value_info("draft_logp", TensorProto.FLOAT, ["rows", DFLASH_TOP_K]),
                   helper.make_tensor_value_info("draft_tokens", TensorProto.INT64, ["rows", DFLASH_TOP_K])]
    lengths = builder.step_attention()
    is_context = g.op("Unsqueeze", ["context_rows", g.const("dflash.last_axis", np.array([-1], np.int64))])
    h = g.op("Gather", [g.const("embed", builder.w["embed"], compute=True), "input_ids"])
    for i in range(c.layers):
        p = f"layers.{i}."
        x, _ = builder.norm(h, None, w[p + "attn_norm"], p + "attn_norm")
        attn = builder.attention(i, x, lengths, kv_source=g.op("Where", [is_context, "context", x]))
        h = g.op("Add", [h, builder.linear(attn, p + "o", w[p + "o"])])
        normed, _ = builder.norm(h, None, w[p + "post_norm"], p + "mlp_norm")
        h = g.op("Add", [h, builder.mlp(normed, p, w[p + "gate"], w[p + "up"], w[p + "down"])])
    flat = g.op("Reshape", [h, g.const("flat_hidden", np.array([-1, c.hidden], np.int64))])
    rows, _ = builder.norm(g.op("Gather", [flat, "logits_indices"], axis=0), None, w["norm"], "norm")
    logits = builder.lm_head(rows)
    if et != TensorProto.FLOAT:
        logits = g.op("Cast", [logits], to=TensorProto.FLOAT)
    logp = g.op("LogSoftmax", [logits], axis=-1)
    top = g.const("top_k", np.array([DFLASH_TOP_K], np.int64))
    if "hot" in w:  # a draft vocabulary: its ids mapped to the target's
        g.op("TopK", [logp, top], outputs=["draft_logp", "draft_ids"], axis=-1)
        g.op("Gather", [g.const("dflash.hot", w["hot"]), "draft_ids"], outputs=["draft_tokens"])
    else:
        g.op("TopK", [logp, top], outputs=["draft_logp", "draft_tokens"], axis=-1)
    return make_model(helper.make_graph(g.nodes, "dflash_draft", inputs, outputs, initializer=g.initializers))
