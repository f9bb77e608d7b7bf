"""Whether ONNX Runtime's MatMulNBits keeps a row's bits whatever else is in its call, measured on this CPU.

Why measured, not read from the CPU's features: it is a property of the kernel ONNX Runtime picks at run time. On an
AVX2-only EPYC (onnxruntime 1.32) its int4 kernel (accuracy level 4) has a one-row path of its own that rounds
otherwise than calls of two or more rows, which agree with each other; its 8-bit blocks and its AVX-512 VNNI kernels
do not differ. Where a one-row call differs, speculation and batching can change a token at a near-tie, so `build`
takes our own kernel there (`--int4-rows`, exact everywhere: docs/precision.md).

Example: `rows_apart(4)` is True on that EPYC, False on an AVX-512 VNNI one.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from specexport.exporter import quant


@lru_cache(maxsize=None)
def rows_apart(bits: int) -> bool:
    """Whether MatMulNBits with `bits`-bit blocks of 32 (accuracy level 4, as our graphs run it) gives a row alone
    other bits than the same row beside others, here: three rows alone against the three in one call."""
    rng = np.random.default_rng(0)
    n, k = 64, 256
    weights = quant.matmul_nbits(rng.standard_normal((n, k)).astype(np.float32), bits=bits)
    node = helper.make_node("MatMulNBits", ["x", *weights], ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=quant.INT4_BLOCK, accuracy_level=4)
    graph = helper.make_graph([node], "rows", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])],
                              [numpy_helper.from_array(v, name) for name, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((3, k)).astype(np.float32)
    alone = np.concatenate([session.run(None, {"x": x[i:i + 1]})[0] for i in range(3)])
    return not np.array_equal(alone, session.run(None, {"x": x})[0])
