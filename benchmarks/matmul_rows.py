#!/usr/bin/env python
"""What a verification row costs in each CPU precision's matmul kernel: one ONNX Runtime op on SmolLM2-135M's
shapes (a layer's projections and the LM head), M = 1..16 rows, side by side in one run.

Kernels: fp32 MatMul; int8 `DynamicQuantizeMatMul` (per-channel int8 weights, activations quantized per call: what
the int8 bundles run); int8 with each row quantized on its own into `MatMulIntegerToFloat` (`--int8-rows channel`); int4
`MatMulNBits` (blocks of 32, 64, 128; accuracy level 4 = int8 activations, as the int4 bundles run, 0 = fp32
activations, 3 = bf16). Prints per kernel the ms of one layer's six projections plus 1/30 of the LM head (so the
column times 30 is the whole model's matmuls), at each M, the cost of each row past the first relative to the
first: how much wider verification costs in that kernel, which decides whether a tree pays; and whether a row's
result is the same bits at every M ("rows": yes, from 2 rows on, or no), which exactness needs.

    python benchmarks/matmul_rows.py [--rows 1,2,4,8,16] [--reps 200] [--threads 2]

numpy and onnxruntime only; random weights (a kernel's time does not depend on them).
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

HIDDEN, FFN, KV, VOCAB, LAYERS = 576, 1536, 192, 49152, 30
# one layer's projections (in, out) and the LM head, which runs once a step for 30 layers
SHAPES = [(HIDDEN, HIDDEN), (HIDDEN, KV), (HIDDEN, KV), (HIDDEN, HIDDEN), (HIDDEN, FFN), (HIDDEN, FFN), (FFN, HIDDEN)]
KERNELS = ["fp32", "int8", "int8-rows", "int4-b32", "int4-b64", "int4-b128", "int4-b32-fp32act", "int4-b32-bf16act"]


def weight_inputs(kernel: str, k: int, n: int, rng) -> tuple[list, list[str], str, dict]:
    """Initializers, input names after x, the op type, its attributes."""
    if kernel == "fp32":
        w = rng.standard_normal((k, n), np.float32) * 0.05
        return [numpy_helper.from_array(w, "w")], ["w"], "MatMul", {}
    if kernel == "int8":
        q = rng.integers(-127, 128, (k, n), dtype=np.int8)
        scale = np.full(n, 0.01, np.float32)
        return [numpy_helper.from_array(q, "w"), numpy_helper.from_array(scale, "s")], ["w", "s"], \
            "DynamicQuantizeMatMul", {"domain": "com.microsoft"}
    if kernel == "int8-rows":
        q = rng.integers(-127, 128, (k, n), dtype=np.int8)
        scale = np.full(n, 0.01, np.float32)
        return [numpy_helper.from_array(q, "w"), numpy_helper.from_array(scale, "s"),
                numpy_helper.from_array(np.array(128, np.uint8), "zp")], ["w", "s", "zp"], "MatMulIntegerToFloat", \
            {"domain": "com.microsoft"}
    block = int(kernel.split("-b")[1].split("-")[0])
    blocks = (k + block - 1) // block
    packed = rng.integers(0, 256, (n, blocks, block // 2), dtype=np.uint8)
    scales = np.full(n * blocks, 0.01, np.float32)
    zeros = np.full((n * ((blocks + 1) // 2),), 0x88, np.uint8)
    accuracy = 0 if kernel.endswith("fp32act") else 3 if kernel.endswith("bf16act") else 4
    return [numpy_helper.from_array(packed, "w"), numpy_helper.from_array(scales, "s"),
            numpy_helper.from_array(zeros, "z")], ["w", "s", "z"], "MatMulNBits", \
        {"domain": "com.microsoft", "K": k, "N": n, "bits": 4, "block_size": block, "accuracy_level": accuracy}


def session(kernel: str, k: int, n: int, threads: int, rng) -> ort.InferenceSession:
    inits, names, op, attrs = weight_inputs(kernel, k, n, rng)
    nodes = [helper.make_node(op, ["x", *names], ["y"], **attrs)]
    if op == "MatMulIntegerToFloat":  # each row its own scale, as exporter/graph.py's _rows_int8 (--int8-rows channel)
        inits += [numpy_helper.from_array(np.array(v, np.float32), name) for name, v in (("step", 1 / 127),
                                                                                       ("tiny", 1e-30))]
        inits.append(numpy_helper.from_array(np.array([-1], np.int64), "last"))
        nodes = [helper.make_node("Abs", ["x"], ["ax"]), helper.make_node("ReduceMax", ["ax", "last"], ["mx"]),
                 helper.make_node("Max", ["mx", "tiny"], ["top"]), helper.make_node("Div", ["x", "top"], ["xd"]),
                 helper.make_node("QuantizeLinear", ["xd", "step", names[2]], ["xq"]),
                 helper.make_node(op, ["xq", names[0], "top", *names[1:]], ["y"], **attrs)]
    graph = helper.make_graph(nodes, "mm", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "1")
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def median_ms(sess: ort.InferenceSession, x: np.ndarray, reps: int) -> float:
    for _ in range(5):
        sess.run(None, {"x": x})
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        sess.run(None, {"x": x})
        times.append(time.perf_counter() - start)
    return float(np.median(times)) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    sessions = {kern: [session(kern, k, n, args.threads, rng) for k, n in SHAPES + [(HIDDEN, VOCAB)]]
                for kern in KERNELS}
    table = {kern: [] for kern in KERNELS}
    for m in rows:  # kernels interleaved at each M, so that they see the same machine
        x = rng.standard_normal((m, max(FFN, HIDDEN)), np.float32)
        for kern in KERNELS:
            total = 0.0
            for (k, _), sess, share in zip(SHAPES + [(HIDDEN, VOCAB)], sessions[kern], [1.0] * len(SHAPES) + [1 / LAYERS]):
                total += share * median_ms(sess, np.ascontiguousarray(x[:, :k]), args.reps)
            table[kern].append(total)
    print(f"ms of one layer's matmuls (+1/{LAYERS} of the LM head) by rows M; x{LAYERS} for the model")
    print(f"{'kernel':18s}" + "".join(f"{'M=' + str(m):>9s}" for m in rows) + "   per row past the first, x M=1"
          + "   rows")
    x = rng.standard_normal((max(rows), max(FFN, HIDDEN)), np.float32)
    for kern, ms in table.items():
        per_row = (ms[-1] - ms[0]) / (rows[-1] - rows[0]) / ms[0] if len(rows) > 1 else 0.0
        print(f"{kern:18s}" + "".join(f"{v:9.3f}" for v in ms) + f"   {per_row:25.3f}   {invariance(sessions[kern], x, rows)}")


def invariance(sessions, x: np.ndarray, rows: list[int]) -> str:
    """Whether row 0's output is the same bits in calls of every M ('yes'), of every M >= 2 ('2+'), or not ('no')."""
    seen = {m: [s.run(None, {"x": np.ascontiguousarray(x[:m, :k])})[0][0] for (k, _), s in
                zip(SHAPES + [(HIDDEN, VOCAB)], sessions)] for m in rows}
    same = lambda ms: all(np.array_equal(a, b) for m in ms for a, b in zip(seen[ms[0]], seen[m]))  # noqa: E731
    return "yes" if same(rows) else "2+" if same([m for m in rows if m >= 2]) else "no"


if __name__ == "__main__":
    main()
