"""Medusa heads inside an ONNX graph: ResBlocks, the LM head(s), and the top-k candidates per head.

Used by the target graph (fused step: heads at the row of the last accepted node, so one call verifies,
accepts and proposes) and by the stand-alone heads graph the runtime uses when sampling, where the accepted
row is chosen outside the graph. ResBlocks stay in float whatever the precision (they are 1/80 of the LM
head's size); the LM head is the target's own initializer when the heads share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from specexport.exporter.graph import make_model
from specexport.exporter.medusa import MedusaHeads


@dataclass(frozen=True)
class HeadsAtAcceptedRow:
    """The target graph's extension: `medusa_tokens` [1, heads, top_k], the heads' candidates at the row of the
    last accepted node (needs the fused acceptance, which picks that row)."""

    heads: MedusaHeads
    top_k: int

    def add(self, builder, final: str, flat: str, accepted_row: str | None) -> list:
        if accepted_row is None:
            raise ValueError("Medusa heads in the target graph need the fused acceptance (fused_accept)")
        add_medusa_heads(builder, self.heads, self.top_k, builder.g.op("Gather", [flat, accepted_row], axis=0),
                         "medusa_tokens")
        return [helper.make_tensor_value_info("medusa_tokens", TensorProto.INT64, [1, self.heads.count, self.top_k])]


def add_medusa_heads(builder, heads: MedusaHeads, top_k: int, hidden: str, output: str) -> str:
    """Append the heads to `builder`'s graph: hidden [n, h] (compute type) -> `output` [n, heads, top_k]."""
    g = builder.g
    subset = heads.vocab_subset
    outs = []
    for k, blocks in enumerate(heads.blocks):
        x = hidden
        for j, (w, b) in enumerate(blocks):
            name = f"medusa.{k}.{j}"
            z = g.op("Add", [g.op("MatMul", [x, g.const(f"{name}.weight", np.ascontiguousarray(w.T), compute=True)]),
                             g.const(f"{name}.bias", b, compute=True)])
            x = g.op("Add", [x, g.op("Mul", [z, g.op("Sigmoid", [z])])])
        if heads.lm_heads is not None:
            w = heads.lm_heads[k] if subset is None else heads.lm_heads[k][subset]
            x = builder.linear(x, f"medusa.{k}.lm_head", w)
        outs.append(g.op("Unsqueeze", [x, g.const(f"medusa.{k}.axis", np.array([1], np.int64))]))
    stacked = g.op("Concat", outs, axis=1)  # [n, heads, hidden] or [n, heads, vocab] (own LM heads)
    if heads.lm_heads is None:
        shape = g.op("Shape", [stacked])
        flat = g.op("Reshape", [stacked, g.const("medusa.flat", np.array([-1, builder.d.hidden], np.int64))])
        if subset is None:
            logits = builder.lm_head(flat)
        else:  # the LM head's rows of the subset, a matrix of its own
            logits = builder.linear(flat, "medusa.lm_head_subset", builder.w["lm_head"][subset])
        stacked = g.op("Reshape", [logits, g.op("Concat", [g.op("Slice", [shape, g.const("medusa.s0", np.array([0], np.int64)),
                                                                          g.const("medusa.s2", np.array([2], np.int64))]),
                                                           g.const("medusa.v", np.array([-1], np.int64))], axis=0)])
    _, index = g.op("TopK", [stacked, g.const("medusa.k", np.array([top_k], np.int64))], outputs=2, axis=-1)
    ids = subset if subset is not None else heads.token_map
    if ids is not None:  # positions in the subset (or rows of a truncated vocabulary) -> token ids
        index = g.op("Gather", [g.const("medusa.vocab_subset", ids.astype(np.int64)), index], axis=0)
    return g.op("Identity", [index], outputs=[output])


def build_heads_graph(builder, heads: MedusaHeads, top_k: int) -> onnx.ModelProto:
    """A graph of the heads alone: `hidden` [n, hidden] (compute type) -> `medusa_tokens` [n, heads, top_k]."""
    et, d = builder.opt.compute_type, builder.d
    add_medusa_heads(builder, heads, top_k, "hidden", "medusa_tokens")
    g = builder.g
    return make_model(helper.make_graph(
        g.nodes, "medusa_heads",
        [helper.make_tensor_value_info("hidden", et, ["rows", d.hidden])],
        [helper.make_tensor_value_info("medusa_tokens", TensorProto.INT64, ["rows", heads.count, top_k])],
        initializer=g.initializers))
