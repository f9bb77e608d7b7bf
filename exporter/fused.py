"""Greedy verification fused into the target graph (standard ONNX ops only, so TensorRT can fuse it).

Given the tree in the step's input (its tokens in `input_ids`, its shape in the tree block of
`attention_bias`) and the logits of every row, the graph returns the accepted rows (the root and the
accepted drafts, in order) and the bonus token: a few integers per step instead of T x vocab logits.
Same rule as `runtime.verify.accept_greedy`: descend into the first child whose token is the
target's argmax at its parent. Batch 1, and `logits_indices` must select every row of the step; the
nodes also run on other calls (prefill, decode), where they see the last selected rows as a tree
and their outputs are ignored.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto


def add_greedy_accept(g, logits: str, seq_len: str) -> tuple[str, str, str]:
    """Append the acceptance to graph `g`; returns (accept_rows [n] int64, bonus_token [1] int64, and the
    step row of the last accepted node [1] int64: the row whose hidden state comes next)."""
    f = TensorProto.FLOAT

    def c(name, value, dtype=np.float32):
        return g.const(f"accept.{name}", np.array(value, dtype))

    target = g.op("ArgMax", [logits], axis=1, keepdims=0)  # [n] the target's token after each row
    seq = g.op("Reshape", [seq_len, c("one", [1], np.int64)])
    n = g.op("Min", [g.op("Shape", [logits], end=1), seq])  # the tree: the last n tokens of the step
    first = g.op("Sub", [seq, n])
    zero, batch0 = c("zero", [0], np.int64), c("batch0", 0, np.int64)
    ids = g.op("Cast", [g.op("Slice", [g.op("Gather", ["input_ids", batch0], axis=0), first, seq, zero])], to=f)
    target = g.op("Slice", [target, g.op("Sub", [g.op("Shape", [target]), n]), g.op("Shape", [target]), zero])
    # the tree's own block of the bias (batch 0): visible[i, j] = j is i or an ancestor of i
    start = g.op("Add", [g.op("Cast", [g.op("Slice", ["past_len", zero, c("one_b", [1], np.int64)])], to=TensorProto.INT64), first])
    block = g.op("Slice", ["attention_bias", g.op("Concat", [first, start], axis=0),
                           g.op("Concat", [seq, g.op("Add", [start, n])], axis=0), c("axes", [2, 3], np.int64)])
    block = g.op("Gather", [g.op("Gather", [block, batch0], axis=0), batch0], axis=0)  # [n, n]
    anc = g.op("Cast", [g.op("Greater", [block, c("half", -0.5)])], to=f)
    depth = g.op("Sub", [g.op("ReduceSum", [anc, c("row", [1], np.int64)], keepdims=0), c("1", 1.0)])
    strict = g.op("Sub", [anc, g.op("EyeLike", [anc])])
    one_up = g.op("Equal", [g.op("Unsqueeze", [depth, c("ax0", [0], np.int64)]),
                            g.op("Sub", [g.op("Unsqueeze", [depth, c("ax1", [1], np.int64)]), c("1b", 1.0)])])
    parent = g.op("Mul", [strict, g.op("Cast", [one_up], to=f)])  # [T, T] one-hot parent per row (root: none)
    col = c("col", [1], np.int64)
    wanted = g.op("Squeeze", [g.op("MatMul", [parent, g.op("Unsqueeze", [g.op("Cast", [target], to=f), col])]), col])
    match = g.op("Or", [g.op("Equal", [ids, wanted]), g.op("Equal", [depth, c("0", 0.0)])])
    # a later sibling with an earlier sibling's token is never taken (the first child wins)
    siblings = g.op("Greater", [g.op("MatMul", [parent, g.op("Transpose", [parent])]), c("half_b", 0.5)])
    same = g.op("Equal", [g.op("Unsqueeze", [ids, col]), g.op("Unsqueeze", [ids, c("ax0b", [0], np.int64)])])
    ones = g.op("Expand", [c("1c", 1.0), g.op("Concat", [g.op("Shape", [anc])], axis=0)])
    earlier = g.op("Cast", [g.op("Trilu", [ones, c("k", -1, np.int64)], upper=0)], to=TensorProto.BOOL)
    dup = g.op("ReduceMax", [g.op("Cast", [g.op("And", [g.op("And", [siblings, same]), earlier])], to=f), col], keepdims=0)
    ok = g.op("And", [match, g.op("Not", [g.op("Cast", [dup], to=TensorProto.BOOL)])])
    bad = g.op("MatMul", [anc, g.op("Unsqueeze", [g.op("Cast", [g.op("Not", [ok])], to=f), col])])
    accepted = g.op("Cast", [g.op("Equal", [g.op("Squeeze", [bad, col]), c("0b", 0.0)])], to=f)
    best = g.op("ArgMax", [g.op("Mul", [accepted, g.op("Add", [depth, c("1d", 1.0)])])], axis=0, keepdims=1)
    path = g.op("Gather", [anc, best], axis=0)  # [1, T]: the best row's ancestors, itself included
    rows = g.op("Gather", [g.op("NonZero", [path]), c("dim1", 1, np.int64)], axis=0, outputs=["accept_rows"])
    bonus = g.op("Gather", [target, best], axis=0, outputs=["bonus_token"])
    return rows, bonus, g.op("Add", [first, best])
