"""Verification fused into the target graph (standard ONNX ops only, so TensorRT can fuse it).

The graph takes the step's tree (its tokens in `input_ids`, its shape in `tree_mask`), the random numbers and, for sampled drafts, the draft distributions; it returns
the accepted rows (the root and the accepted drafts, in order) and the token the target adds after
them: a few integers per step instead of T x vocab logits. The rules are `runtime.verify`'s:
`accept_greedy` at temperature 0, `accept_tree` otherwise. Inputs it adds to the target graph:

    sample_u       [n, S] float   the uniforms of verify.uniforms_shape (zeros when greedy)
    sample_q       [m, V] float   m = n: the processed draft distribution each row's children were
                                  drawn from (sampled drafts); m = 0: deterministic candidates ("topk")
    sample_params  [4] float      temperature (0 = greedy), top_k (0 = off), top_p (1 = off), and
                                  1 when sampled drafts were drawn without replacement

The target's distribution is `runtime.sampling.probabilities` (temperature, top-k, top-p). Batch 1; the
tree is the rows `logits_indices` selects, in its order (a step laid out in lanes has padding rows between
them: runtime/backends/layout.py); the nodes also run on other calls (prefill, decode), where they see the
selected rows as a tree and their outputs are ignored.
`add_batch_accept` adds the greedy rule for every sequence of a batched step at once (the batched engine's).

At temperature 0 (greedy decoding, the common case) an If takes the greedy rule on one ArgMax per row (computed
before the If, once, and shared with the batched acceptance), so greedy speculation pays no pass over the
vocabulary beyond it; sampling's branch runs the rest. A single greedy row (plain decoding) skips the tree
altogether: its ArgMax is the bonus token; so does a batched call (more than one sequence: the batched acceptance's,
whose runtime passes greedy inputs here and reads none of these outputs), where the tree would cost a call ~1.4 ms
on the 2-core CPU (16 sequences of 2 rows, ONNX Runtime's profiler).
Deterministic candidates are accepted in parallel: after rejecting the earlier siblings, whose
tokens then have no mass, child x of row r is accepted when u * (1 - their mass) < p_r(x). Sampled
drafts change the residual with each rejection (max(0, p - q), renormalised), so a Loop runs over
the sibling rank, all rows at once: one pass for a chain.

Greedy only (`sampling=False`, the trt flavour; the graph then takes none of the sampling inputs, and the
runtime accepts sampled steps from the logits, `runtime.verify.accept`): a child is accepted when its token is
the argmax at its parent and no earlier sibling has it. Why not sampling for TensorRT: top-p sorts the whole
vocabulary (TopK with k = vocab), and TensorRT's TopK takes k < 3840; cutting to a fixed top-3839 first would
drop the tail's mass whenever no top-k <= 3839 is set, and the output would no longer follow the target's
distribution. The greedy graph has no If, Loop, TopK or CumSum: ArgMax, comparisons, small [n, n] MatMuls and
one NonZero (the accepted rows, a data-dependent length). A TensorRT build may replace it with the tree acceptance
plugin, which also samples (`build --backend tensorrt --sampling-accept plugin`, exporter/tensorrt/build.py); it rewires
what reads ACCEPTED_ROW.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from specexport.runtime.sampling import NUCLEUS_FLOORS

F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
ACCEPTED_ROW = "accepted_row"  # the step row of the last accepted node, named so a TensorRT build can rewire it
INPUTS = (("sample_u", F, ["rows", "slots"]), ("sample_q", F, ["draft_rows", "vocab"]), ("sample_params", F, [4]))


def add_accept(g, logits: str, sampling: bool = True, vocab_size: int | None = None
               ) -> tuple[str, str, str, str]:
    """Append the acceptance to graph `g` (`sampling` False: greedy only); returns (accept_rows [k] int64,
    bonus_token [1] int64, the step row of the last accepted node [1] int64: the row whose hidden state comes
    next, and the argmax of every selected row [rows] int64, which add_batch_accept shares). `vocab_size`, the
    logits' width when known at export, makes the argmax run in blocks (`_argmax_rows`)."""
    c = _consts(g)
    rows = g.op("Shape", [logits], end=1)
    n = rows  # the tree: the selected rows, in the order `logits_indices` gives them
    width = g.op("Shape", ["input_ids"], start=1, end=2)
    ids = g.op("Gather", [g.op("Reshape", ["input_ids", c("flat", [-1])]), "logits_indices"], axis=0)
    # the selected rows' rows and columns of the tree mask: anc[i, j] = selected row j is i or an ancestor of i
    # (rows of another batch row than the first are read as if they were its own: in range, and ignored)
    cols = g.op("Shape", ["tree_mask"], start=2, end=3)
    at = g.op("Add", [g.op("Mod", ["logits_indices", width]), g.op("Sub", [cols, width])])
    flat_mask = g.op("Reshape", ["tree_mask", g.op("Concat", [c("minus_one", [-1]), cols], axis=0)])
    anc = g.op("Cast", [g.op("Gather", [g.op("Gather", [flat_mask, "logits_indices"], axis=0), at], axis=1)], to=F)
    target = logits  # [n, V]
    # the argmax of every selected row, once: the greedy rules read it (an If's branches see the outer graph)
    top_all = _argmax_rows(g, logits, vocab_size) if vocab_size else g.op("ArgMax", [logits], axis=1, keepdims=0)
    top = top_all

    if not sampling:
        rows_out, best, bonus = _accept(g, target, ids, n, anc, top)
    else:  # greedy, a single row (plain decoding) or a batch (add_batch_accept's) skips the tree: the last argmax
        temperature = g.op("Gather", ["sample_params", c("zero_s", 0)], axis=0)
        greedy = g.op("LessOrEqual", [temperature, c("0f", 0.0, np.float32)])
        batch = g.op("Squeeze", [g.op("Shape", ["input_ids"], end=1), c("zero", [0])])
        alone = g.op("Or", [g.op("Equal", [g.op("Squeeze", [n, c("zero", [0])]), c("one_s", 1)]),
                            g.op("Greater", [batch, c("one_s", 1)])])
        rows_out, best, bonus = _if(g, "tree", g.op("And", [alone, greedy]),
                                    lambda b: [_consts(b)("zero", [0]), _consts(b)("zero", [0]), _last(b, top)],
                                    lambda b: list(_accept(b, target, ids, n, anc, top, (temperature, greedy))),
                                    [I64, I64, I64])
    rows_out = g.op("Identity", [rows_out], outputs=["accept_rows"])
    bonus = g.op("Reshape", [bonus, c("one", [1])], outputs=["bonus_token"])
    return rows_out, bonus, g.op("Gather", ["logits_indices", best], axis=0, outputs=[ACCEPTED_ROW]), top_all


def _last(g, values: str) -> str:
    """The last element of a 1-D tensor, as a [1] tensor."""
    c = _consts(g)
    return g.op("Slice", [values, c("minus_one", [-1]), c("end", [np.iinfo(np.int64).max]), c("zero", [0])])


def _accept(g, target: str, ids: str, n: str, anc: str, top: str, sampling: tuple[str, str] | None = None
            ) -> tuple[str, str, str]:
    """The tree's acceptance into graph (or If branch) `g`: (accepted rows [k], the deepest accepted row [1], the
    bonus token [1]), rows counted among the selected ones. `anc` [n, n] float: 1 where selected row j is row i or
    an ancestor of it; `top`: the target's argmax at each of the tree's rows [n]. `sampling`: the step's temperature
    and whether it is greedy, from the graph's sample_params (None: greedy only, no sampling inputs)."""
    c = _consts(g)
    depth = g.op("Sub", [g.op("ReduceSum", [anc, c("one", [1])], keepdims=0), c("1f", 1.0, np.float32)])
    node = g.op("Range", [c("zero_s", 0), g.op("Squeeze", [n, c("zero", [0])]), c("one_s", 1)])  # [n] 0..n-1
    col, row_of = g.op("Unsqueeze", [node, c("zero", [0])]), g.op("Unsqueeze", [node, c("one", [1])])
    strict = g.op("Sub", [anc, g.op("Cast", [g.op("Equal", [row_of, col])], to=F)])  # not EyeLike: static dims only in TRT
    one_up = g.op("Equal", [g.op("Unsqueeze", [depth, c("zero", [0])]),
                            g.op("Sub", [g.op("Unsqueeze", [depth, c("one", [1])]), c("1f", 1.0, np.float32)])])
    parent = g.op("Mul", [strict, g.op("Cast", [one_up], to=F)])  # [n, n] one-hot parent per row (root: none)
    par = g.op("ArgMax", [parent], axis=1, keepdims=0)  # [n] (root: 0, unused)
    same_parent = g.op("Greater", [g.op("MatMul", [parent, g.op("Transpose", [parent])]), c("half_b", 0.5, np.float32)])
    before = g.op("And", [same_parent, g.op("Less", [col, row_of])])  # [i, j]: j is an earlier sibling of i
    same = g.op("Equal", [g.op("Unsqueeze", [ids, c("one", [1])]), g.op("Unsqueeze", [ids, c("zero", [0])])])
    dup = _any(g, c, g.op("And", [before, same]))  # an earlier sibling has the same token
    if sampling is None:
        acc = g.op("And", [g.op("Not", [dup]), g.op("Equal", [ids, g.op("Gather", [top, par], axis=0)])])
        rows_out, best = _path(g, c, acc, anc, depth, before)
        return rows_out, best, g.op("Gather", [top, best], axis=0)
    # greedy (temperature 0) takes one ArgMax over the vocabulary; sampling's passes over it run only when sampling
    vocab = g.op("Shape", [target], start=1, end=2)
    temperature, greedy = sampling

    def accept_greedy(b):
        acc = b.op("And", [b.op("Not", [dup]), b.op("Equal", [ids, b.op("Gather", [top, par], axis=0)])])
        return [acc, b.op("ConstantOfShape", [_consts(b)("empty", [0, 0])], value=helper.make_tensor("z", F, [1], [0.0]))]

    def accept_sampling(b):
        bc = _consts(b)
        vrange = b.op("Range", [bc("zero_s", 0), b.op("Squeeze", [vocab]), bc("one_s", 1)])  # [V] 0..V-1
        rank = b.op("Cast", [b.op("ReduceSum", [b.op("Cast", [before], to=F), bc("one", [1])], keepdims=0)], to=I64)
        last_slot = b.op("Sub", [b.op("Squeeze", [b.op("Shape", ["sample_u"], start=1, end=2)]), bc("one_s", 1)])
        rank_u = b.op("Min", [rank, last_slot])
        slot = b.op("Concat", [b.op("Unsqueeze", [par, bc("one", [1])]), b.op("Unsqueeze", [rank_u, bc("one", [1])])],
                    axis=1)
        p = _process(b, target, temperature, vocab)
        tree = (parent, par, rank, slot, ids, dup, before, vrange)
        sampled = b.op("Greater", [b.op("Shape", ["sample_q"], end=1), bc("zero", [0])])  # [1]
        return _if(b, "accept", b.op("Squeeze", [sampled]), lambda bb: _accept_sampled(bb, p, tree),
                   lambda bb: _accept_topk(bb, p, tree), [BOOL, F])

    acc, table = _if(g, "accept", greedy, accept_greedy, accept_sampling, [BOOL, F])
    rows_out, best = _path(g, c, acc, anc, depth, before)

    def bonus_greedy(b):
        return [b.op("Gather", [top, best], axis=0)]

    def bonus_sampling(b):  # from the residual at the last accepted row once its children were rejected
        bc = _consts(b)
        vrange = b.op("Range", [bc("zero_s", 0), b.op("Squeeze", [vocab]), bc("one_s", 1)])
        row = b.op("Gather", [table, best], axis=0)  # [1, V]
        kids = b.op("NonZero", [b.op("Squeeze", [b.op("Gather", [parent, best], axis=1), bc("one", [1])])])  # [1, c]
        kid_tokens = b.op("Gather", [ids, b.op("Squeeze", [kids, bc("zero", [0])])], axis=0)
        keep = b.op("ScatterElements", [b.op("Expand", [bc("1f_row", [[1.0]], np.float32), b.op("Shape", [row])]),
                                        b.op("Unsqueeze", [kid_tokens, bc("zero", [0])]),
                                        b.op("Expand", [bc("0f_row", [[0.0]], np.float32),
                                                        b.op("Shape", [b.op("Unsqueeze", [kid_tokens, bc("zero", [0])])])])],
                      axis=1)  # every write is 0, so repeated tokens do not matter
        sampled = b.op("Greater", [b.op("Shape", ["sample_q"], end=1), bc("zero", [0])])
        row = b.op("Where", [sampled, row, b.op("Mul", [row, keep])])  # topk: the rejected candidates lose their mass
        u_end = b.op("Slice", [b.op("Gather", ["sample_u", best], axis=0), bc("minus1", [-1]), bc("big", [2**62]),
                               bc("one", [1])])
        return [_draw(b, bc, row, u_end, vrange, vocab)]

    return rows_out, best, _if(g, "bonus", greedy, bonus_greedy, bonus_sampling, [I64])[0]


def add_batch_accept(g, top: str) -> list:
    """Greedy acceptance for every sequence of a batched step (runtime/scheduler.py), appended to graph `g`; returns
    the value infos of its outputs:

        batch_accept_mask [batch, seq] bool   the accepted rows of each sequence's tree (its root and the accepted
                                              drafts; a path, so in order)
        batch_accept_len  [batch] int64       how many (the accept length: accepted drafts + 1)
        batch_bonus       [batch] int64       the target's token at the deepest accepted row

    The rule is `runtime.verify.accept_greedy` (descend into the first child whose token is the target's argmax at
    its parent), applied to each batch row's tree: rows and columns of its tree_mask's last `seq` columns
    (ancestor-or-self). `top` is the argmax of each row that `logits_indices` selects (add_accept's; the scheduler
    leaves a sequence's padded rows out), scattered back to its place in [batch, seq], the rest -1. A
    padded row sees only itself, so it is a tree of one row that nothing descends into. Only standard ops with no
    data-dependent shapes (no If, Loop, NonZero, TopK), so it also runs in TensorRT; every call computes it (prefill
    included, where it is ignored: [seq, seq] matmuls, small next to the layers). Sampling is accepted on the host,
    each sequence with its own settings and random stream (runtime/verify.accept)."""
    c = _consts(g)
    shape = g.op("Shape", ["input_ids"])  # [batch, seq]
    width = g.op("Shape", ["input_ids"], start=1, end=2)
    unset = g.op("ConstantOfShape", [g.op("ReduceProd", [shape, c("zero", [0])], keepdims=1)],
                 value=helper.make_tensor("m1", I64, [1], [-1]))
    top = g.op("Reshape", [g.op("ScatterElements", [unset, "logits_indices", top], axis=0), shape])  # [B, W]
    ids = "input_ids"
    cols = g.op("Shape", ["tree_mask"], start=2, end=3)
    anc = g.op("Cast", [g.op("Slice", ["tree_mask", g.op("Sub", [cols, width]), cols, c("two", [2])])], to=F)  # [B,W,W]
    depth = g.op("Sub", [g.op("ReduceSum", [anc, c("two", [2])], keepdims=0), c("1f", 1.0, np.float32)])  # [B, W]
    node = g.op("Range", [c("zero_s", 0), g.op("Squeeze", [width, c("zero", [0])]), c("one_s", 1)])
    col, row_of = g.op("Unsqueeze", [node, c("zero", [0])]), g.op("Unsqueeze", [node, c("one", [1])])  # [1,W], [W,1]
    strict = g.op("Sub", [anc, g.op("Cast", [g.op("Equal", [row_of, col])], to=F)])
    one_up = g.op("Equal", [g.op("Unsqueeze", [depth, c("one", [1])]),
                            g.op("Sub", [g.op("Unsqueeze", [depth, c("two", [2])]), c("1f", 1.0, np.float32)])])
    parent = g.op("Mul", [strict, g.op("Cast", [one_up], to=F)])  # [B, W, W] one-hot parent per row (roots: none)
    parent_top = g.op("MatMul", [parent, g.op("Unsqueeze", [g.op("Cast", [top], to=F), c("two", [2])])])  # [B,W,1]
    parent_top = g.op("Cast", [g.op("Squeeze", [parent_top, c("two", [2])])], to=I64)  # exact: ids < 2^24
    same_parent = g.op("Greater", [g.op("MatMul", [parent, g.op("Transpose", [parent], perm=[0, 2, 1])]),
                                   c("half_b", 0.5, np.float32)])
    before = g.op("And", [same_parent, g.op("Less", [col, row_of])])  # [b, i, j]: j is an earlier sibling of i
    same = g.op("Equal", [g.op("Unsqueeze", [ids, c("two", [2])]), g.op("Unsqueeze", [ids, c("one", [1])])])
    dup = _any(g, c, g.op("And", [before, same]), 2)  # an earlier sibling has the same token
    acc = g.op("And", [g.op("Not", [dup]), g.op("Equal", [ids, parent_top])])
    earlier_ok = _any(g, c, g.op("And", [before, g.op("Unsqueeze", [acc, c("one", [1])])]), 2)
    first_ok = g.op("And", [acc, g.op("Not", [earlier_ok])])
    ok = g.op("Or", [first_ok, g.op("Equal", [depth, c("0f", 0.0, np.float32)])])
    bad = g.op("MatMul", [anc, g.op("Unsqueeze", [g.op("Cast", [g.op("Not", [ok])], to=F), c("two", [2])])])
    accepted = g.op("Cast", [g.op("Equal", [g.op("Squeeze", [bad, c("two", [2])]), c("0f", 0.0, np.float32)])], to=F)
    best = g.op("ArgMax", [g.op("Mul", [accepted, g.op("Add", [depth, c("1f", 1.0, np.float32)])])], axis=1,
                keepdims=1)  # [B, 1]: the deepest accepted row (the root wins ties: the first maximum)
    gather = g.op("Expand", [g.op("Unsqueeze", [best, c("two", [2])]),
                             g.op("Concat", [c("one_one", [1, 1]), width], axis=0)])  # [B, 1, W]
    mask = g.op("Squeeze", [g.op("GatherElements", [anc, gather], axis=1), c("one", [1])])
    g.op("Cast", [mask], to=BOOL, outputs=["batch_accept_mask"])
    length = g.op("Add", [g.op("GatherElements", [depth, best], axis=1), c("1f", 1.0, np.float32)])
    g.op("Cast", [g.op("Squeeze", [length, c("one", [1])])], to=I64, outputs=["batch_accept_len"])
    g.op("Squeeze", [g.op("GatherElements", [top, best], axis=1), c("one", [1])], outputs=["batch_bonus"])
    return [helper.make_tensor_value_info("batch_accept_mask", BOOL, ["batch", "seq"]),
            helper.make_tensor_value_info("batch_accept_len", I64, ["batch"]),
            helper.make_tensor_value_info("batch_bonus", I64, ["batch"])]


def _argmax_rows(b, x: str, vocab: int) -> str:
    """ArgMax over the last axis of x [n, vocab] (the first maximum, as ArgMax), in blocks: each block's maximum
    (ReduceMax, vectorized), the first block holding the row's maximum, then ArgMax inside that block alone. ONNX
    Runtime's CPU ArgMax reads one element at a time: measured on [16, 49152], 1.3 ms against 0.27 ms this way."""
    c = _consts(b)
    block = next((k for k in (1024, 512, 2048, 256) if vocab % k == 0), 1024)
    pad = (-vocab) % block
    if pad:  # a tail of -inf never holds the first maximum
        x = b.op("Pad", [x, c(f"am_pads{pad}", [0, 0, 0, pad]), c("am_ninf", -np.inf, np.float32)])
    blocks = b.op("Reshape", [x, c(f"am_shape{block}", [0, (vocab + pad) // block, block])])  # [n, blocks, block]
    first = b.op("ArgMax", [b.op("ReduceMax", [blocks, c("am_two", [2])], keepdims=0)], axis=1, keepdims=1)  # [n, 1]
    at = b.op("Expand", [b.op("Unsqueeze", [first, c("am_two", [2])]), c(f"am_wide{block}", [1, 1, block])])
    inside = b.op("ArgMax", [b.op("GatherElements", [blocks, at], axis=1)], axis=2, keepdims=0)  # [n, 1]
    index = b.op("Add", [b.op("Mul", [first, c(f"am_block{block}", block)]), inside])
    return b.op("Squeeze", [index, c("am_one", [1])])


def _path(g, c, acc: str, anc: str, depth: str, before: str) -> tuple[str, str]:
    """The accepted path from each row's test `acc` [n] bool: a node stays when it and its ancestors are each
    their parent's first accepted child. Returns (accept_rows [k], the deepest accepted row [1])."""
    first_ok = g.op("And", [acc, g.op("Not", [_any(g, c, g.op("And", [before, g.op("Unsqueeze", [acc, c("zero", [0])])]))])])
    ok = g.op("Or", [first_ok, g.op("Equal", [depth, c("0f", 0.0, np.float32)])])
    bad = g.op("MatMul", [anc, g.op("Unsqueeze", [g.op("Cast", [g.op("Not", [ok])], to=F), c("one", [1])])])
    accepted = g.op("Cast", [g.op("Equal", [g.op("Squeeze", [bad, c("one", [1])]), c("0f", 0.0, np.float32)])], to=F)
    best = g.op("ArgMax", [g.op("Mul", [accepted, g.op("Add", [depth, c("1f", 1.0, np.float32)])])], axis=0, keepdims=1)
    path = g.op("Gather", [anc, best], axis=0)  # [1, n]: the best row's ancestors, itself included
    return g.op("Gather", [g.op("NonZero", [path]), c("one_s", 1)], axis=0), best


def _consts(g):
    """c(name, value, dtype=int64): a named constant of graph `g` (defined once, shared by name)."""
    def c(name, value, dtype=np.int64):
        return g.const(f"accept.{name}", np.array(value, dtype))
    return c


def _any(g, c, matrix: str, axis: int = 1) -> str:
    """Any over the last axis of a bool matrix: [n, n] -> [n] (axis 1), or [B, n, n] -> [B, n] (axis 2)."""
    axes = c("one", [1]) if axis == 1 else c("two", [2])
    return g.op("Cast", [g.op("ReduceMax", [g.op("Cast", [matrix], to=F), axes], keepdims=0)], to=BOOL)


def _if(g, name: str, cond: str, then, otherwise, types: list[int]) -> list[str]:
    """An If node; `then`/`otherwise` fill a subgraph and return its output names."""
    branches = {}
    for key, fill in (("then_branch", then), ("else_branch", otherwise)):
        b = g.subgraph(f"{name}.{key[:4]}")
        outs = [b.op("Identity", [o]) for o in fill(b)]
        branches[key] = helper.make_graph(b.nodes, f"{name}_{key}", [], [helper.make_tensor_value_info(o, t, None)
                                                                          for o, t in zip(outs, types)],
                                          initializer=b.initializers)
    return g.op("If", [cond], outputs=len(types), **branches) if len(types) > 1 else [g.op("If", [cond], **branches)]


def _process(b, target: str, temperature: str, vocab: str) -> str:
    """sampling.probabilities: temperature, then top-k (ties kept), softmax, then top-p, renormalised."""
    c = _consts(b)

    x = b.op("Div", [target, temperature])
    k = b.op("Cast", [b.op("Gather", ["sample_params", c("k_at", [1])], axis=0)], to=I64)  # [1]
    use_k = b.op("And", [b.op("Greater", [k, c("zero", [0])]), b.op("Less", [k, vocab])])
    values, _ = b.op("TopK", [x, b.op("Where", [use_k, k, c("one", [1])])], outputs=2, axis=-1)  # k = 1 when off: cheap
    kth = b.op("ReduceMin", [values, c("one", [1])], keepdims=1)
    x = b.op("Where", [b.op("And", [use_k, b.op("Less", [x, kth])]), c("ninf", -np.inf, np.float32), x])
    probs = b.op("Softmax", [x], axis=-1)
    top_p = b.op("Gather", ["sample_params", c("p_at", [2])], axis=0)
    use_p = b.op("Less", [top_p, c("1f", 1.0, np.float32)])
    k_p = _if(b, "nucleus", b.op("Squeeze", [use_p]), lambda bb: [_nucleus_bound(bb, _consts(bb), probs, top_p)],
              lambda bb: [_consts(bb)("one", [1])], [I64])[0]  # 1 when off: cheap
    sorted_p, order = b.op("TopK", [probs, k_p], outputs=2, axis=-1)
    before = b.op("CumSum", [sorted_p, c("one_s", 1)], exclusive=1)  # the mass of the more likely ones
    inside = b.op("Cast", [b.op("Less", [before, top_p])], to=F)  # ties: lower id first
    mask = b.op("ScatterElements", [b.op("ConstantOfShape", [b.op("Shape", [probs])],
                                         value=helper.make_tensor("z", F, [1], [0.0])), order, inside], axis=1)
    probs = b.op("Mul", [probs, b.op("Where", [use_p, mask, c("1f", 1.0, np.float32)])])
    return b.op("Div", [probs, b.op("ReduceSum", [probs, c("one", [1])], keepdims=1)])


NUCLEUS_LEVELS = (*NUCLEUS_FLOORS, 0.0)  # the probability floors tried for the nucleus' candidates (the host's)
NUCLEUS_MARGIN = 1e-4  # a floor's mass must pass top_p by this much: its sum and TopK's CumSum round differently


def _nucleus_bound(b, c, probs: str, top_p: str) -> str:
    """How many of the most likely tokens the top-p rule needs to see [1]: for each row the candidates at or above
    the highest floor of NUCLEUS_LEVELS whose mass reaches top_p (every tie with the floor included, so they are
    the first ones of the full sort, and the nucleus lies inside them), the most over the rows. Sorting those
    instead of the vocabulary (TopK with k = V) gives the same nucleus: measured on 3 rows of 49152, TopK 10.1 ms
    at k = V, 0.16 ms at k = 64."""
    levels = c("nucleus_levels", [[v] for v in NUCLEUS_LEVELS], np.float32)  # [L, 1]
    wide = b.op("Unsqueeze", [probs, c("one", [1])])  # [n, 1, V]
    at_least = b.op("GreaterOrEqual", [wide, levels])  # [n, L, V]
    mass = b.op("ReduceSum", [b.op("Where", [at_least, wide, c("0f", 0.0, np.float32)]), c("two", [2])], keepdims=0)
    count = b.op("ReduceSum", [b.op("Cast", [at_least], to=F), c("two", [2])], keepdims=0)  # [n, L]
    last = c("nucleus_last", [[k == len(NUCLEUS_LEVELS) - 1 for k in range(len(NUCLEUS_LEVELS))]], np.bool_)
    enough = b.op("Or", [b.op("GreaterOrEqual", [mass, b.op("Add", [top_p, c("nucleus_margin", NUCLEUS_MARGIN, np.float32)])]),
                         last])
    level = b.op("ArgMax", [b.op("Cast", [enough], to=F)], axis=1, keepdims=1)  # [n, 1]: the first floor with enough
    need = b.op("ReduceMax", [b.op("GatherElements", [count, level], axis=1)], keepdims=0)
    return b.op("Reshape", [b.op("Cast", [need], to=I64), c("one", [1])])


def _accept_topk(b, p: str, tree) -> list[str]:
    """Deterministic candidates: every child's test at once. Returns (accepted [n] bool, the table of p)."""
    parent, par, rank, slot, ids, dup, before, vrange = tree

    c = _consts(b)

    pair = b.op("Concat", [b.op("Unsqueeze", [par, c("one", [1])]), b.op("Unsqueeze", [ids, c("one", [1])])], axis=1)
    px = b.op("GatherND", [p, pair])  # [n] p at the parent of each child's token
    counted = b.op("Cast", [b.op("And", [before, b.op("Not", [b.op("Unsqueeze", [dup, c("zero", [0])])])])], to=F)
    gone = b.op("Squeeze", [b.op("MatMul", [counted, b.op("Unsqueeze", [px, c("one", [1])])]), c("one", [1])])
    u = b.op("GatherND", ["sample_u", slot])
    test = b.op("Less", [b.op("Mul", [u, b.op("Sub", [c("1f", 1.0, np.float32), gone])]), px])
    return [b.op("And", [b.op("Not", [dup]), test]), p]


def _accept_sampled(b, p: str, tree) -> list[str]:
    """Sampled drafts: a Loop over the sibling rank j updates every row's residual after its j-th child
    is rejected. Returns (accepted [n] bool, the residual of each row after all its children)."""
    parent, par, rank, slot, ids, dup, before, vrange = tree

    c = _consts(b)

    trips = b.op("Cast", [b.op("ReduceMax", [b.op("ReduceSum", [parent, c("zero", [0])], keepdims=0)], keepdims=0)], to=I64)
    body = b.subgraph("rank")
    j, cond, p_in, q_in = "rank.j", "rank.cond", "rank.p", "rank.q"
    bc = _consts(body)
    is_j = body.op("Cast", [body.op("Equal", [rank, j])], to=F)
    child = body.op("Mul", [body.op("Transpose", [parent]), body.op("Unsqueeze", [is_j, bc("zero", [0])])])  # [r, i]
    x = body.op("Gather", [ids, body.op("ArgMax", [child], axis=1, keepdims=1)], axis=0)  # [n, 1] (no child: masked)
    has = body.op("Greater", [body.op("ReduceSum", [child, bc("one", [1])], keepdims=1), bc("half", 0.5, np.float32)])
    px = body.op("GatherElements", [p_in, x], axis=1)
    qx = body.op("GatherElements", [q_in, x], axis=1)
    u = body.op("Gather", ["sample_u", body.op("Unsqueeze", [j, bc("zero", [0])])], axis=1)  # [n, 1]
    live = body.op("And", [has, body.op("Greater", [qx, bc("0f", 0.0, np.float32)])])  # q(x) = 0: no such draw
    acc = body.op("And", [live, body.op("Less", [body.op("Mul", [u, qx]), px])])
    rejected = body.op("And", [live, body.op("Not", [acc])])
    residual = body.op("Relu", [body.op("Sub", [p_in, q_in])])
    p_next = _renormalised(body, bc, residual, p_in)
    drawn = body.op("Equal", [body.op("Unsqueeze", [vrange, bc("zero", [0])]), x])
    q_left = body.op("Where", [drawn, bc("0f", 0.0, np.float32), q_in])
    without = body.op("Greater", [body.op("Gather", ["sample_params", bc("three", 3)], axis=0), bc("half", 0.5, np.float32)])
    q_next = body.op("Where", [without, _renormalised(body, bc, q_left, q_left), q_in])
    outs = [body.op("Identity", [cond]), body.op("Where", [rejected, p_next, p_in]),
            body.op("Where", [rejected, q_next, q_in]), body.op("Squeeze", [acc, bc("one", [1])])]
    graph = helper.make_graph(
        body.nodes, "rank_body",
        [helper.make_tensor_value_info(j, I64, []), helper.make_tensor_value_info(cond, BOOL, []),
         helper.make_tensor_value_info(p_in, F, None), helper.make_tensor_value_info(q_in, F, None)],
        [helper.make_tensor_value_info(o, t, None) for o, t in zip(outs, (BOOL, F, F, BOOL))],
        initializer=body.initializers)
    residual, _, per_rank = b.op("Loop", [trips, "", p, "sample_q"], outputs=3, body=graph)  # per_rank [K, n]
    # row K of zeros: the root's lookup, and trees with no children, stay in range
    pad = b.op("ConstantOfShape", [b.op("Concat", [c("one", [1]), b.op("Shape", [par])], axis=0)],
               value=helper.make_tensor("z", F, [1], [0.0]))
    per_rank = b.op("Concat", [b.op("Cast", [per_rank], to=F), pad], axis=0)
    index = b.op("Concat", [b.op("Unsqueeze", [rank, c("one", [1])]), b.op("Unsqueeze", [par, c("one", [1])])], axis=1)
    return [b.op("Greater", [b.op("GatherND", [per_rank, index]), c("half", 0.5, np.float32)]), residual]


def _renormalised(b, c, x: str, fallback: str) -> str:
    """x / sum(x) per row, or `fallback` where x has no mass (only rounding gets there; see verify._reject)."""
    total = b.op("ReduceSum", [x, c("one", [1])], keepdims=1)
    return b.op("Where", [b.op("Greater", [total, c("0f", 0.0, np.float32)]), b.op("Div", [x, total]), fallback])


def _draw(g, c, row: str, u: str, vrange: str, vocab: str) -> str:
    """sampling.sample in the graph: the inverse-CDF draw from `row` [1, V] with u [1, 1], never a token
    of zero probability."""
    cdf = g.op("CumSum", [row, c("one_s", 1)])
    total = g.op("Slice", [cdf, c("minus1", [-1]), c("big", [2**62]), c("one", [1])])
    token = g.op("ReduceSum", [g.op("Cast", [g.op("LessOrEqual", [cdf, g.op("Mul", [u, total])])], to=I64)], keepdims=0)
    last = g.op("ReduceMax", [g.op("Where", [g.op("Greater", [row, c("0f", 0.0, np.float32)]),
                                             g.op("Unsqueeze", [vrange, c("zero", [0])]), c("minus1_s", -1)])],
                keepdims=0)
    inside = g.op("Less", [token, g.op("Squeeze", [vocab])])
    at = g.op("Min", [token, g.op("Sub", [g.op("Squeeze", [vocab]), c("one_s", 1)])])
    has_mass = g.op("Greater", [g.op("Gather", [g.op("Squeeze", [row, c("zero", [0])]), at], axis=0), c("0f", 0.0, np.float32)])
    return g.op("Where", [g.op("And", [inside, has_mass]), token, last])
