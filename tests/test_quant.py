"""Weight quantization: error bounds, the nibble layout, and ORT's MatMulNBits reading our layout."""

import numpy as np
import pytest

from specexport.exporter.quant import (
    INT4_BLOCK,
    dequantize_int4,
    int4_blocks,
    int8_per_channel,
    matmul_nbits,
    pack_nibbles,
)


def weights(out_dim, in_dim, seed=0):
    return np.random.default_rng(seed).standard_normal((out_dim, in_dim)).astype(np.float32)


def test_int8_per_channel_round_trip():
    w = weights(48, 80)
    w[3] *= 100  # one loud channel must not cost the others precision
    q, scale = int8_per_channel(w)
    assert q.dtype == np.int8 and q.shape == (80, 48)  # [in, out]
    assert scale.dtype == np.float32 and scale.shape == (48,)
    np.testing.assert_allclose(scale, np.abs(w).max(axis=1) / 127, rtol=1e-6)
    assert q.min() >= -127 and q.max() <= 127
    assert (np.abs(q).max(axis=0) == 127).all()  # every channel uses its full range
    error = np.abs(q.T * scale[:, None] - w)
    assert (error <= scale[:, None] / 2 * (1 + 1e-5)).all()
    quiet = np.delete(np.arange(48), 3)
    assert error[quiet].max() < 0.03


def test_int8_zero_channel():
    w = weights(4, 8)
    w[1] = 0
    q, scale = int8_per_channel(w)
    assert scale[1] == 1.0 and not q[:, 1].any()


@pytest.mark.parametrize("in_dim", [64, 96, 40])  # 40: padded to 64
def test_int4_blocks_within_half_a_step(in_dim):
    w = weights(24, in_dim, seed=1)
    q, scale, zero = int4_blocks(w)
    blocks = -(-in_dim // INT4_BLOCK)
    assert q.shape == (24, blocks * INT4_BLOCK) and q.dtype == np.uint8
    assert scale.shape == zero.shape == (24, blocks)
    assert q.max() <= 15 and zero.max() <= 15
    back = dequantize_int4(q, scale, zero, in_dim)
    assert back.shape == w.shape
    step = np.repeat(scale, INT4_BLOCK, axis=1)[:, :in_dim]
    assert (np.abs(back - w) <= step / 2 * (1 + 1e-5) + 1e-7).all()


def test_int4_zero_is_exact_and_constant_block():
    w = np.zeros((2, 64), np.float32)
    w[0, :32] = 0.5  # all-positive block: range [0, 0.5]
    q, scale, zero = int4_blocks(w)
    back = dequantize_int4(q, scale, zero, 64)
    np.testing.assert_array_equal(back[1], 0.0)  # all-zero blocks: scale 1, exactly zero
    assert scale[1].tolist() == [1.0, 1.0]
    np.testing.assert_allclose(back[0, :32], 0.5, rtol=1e-6)
    np.testing.assert_array_equal(back[0, 32:], 0.0)


def test_pack_nibbles_literal():
    values = np.array([[1, 2, 3, 4, 15], [0, 15, 15, 0, 7]], np.uint8)
    packed = pack_nibbles(values)
    # low nibble first; the odd last value is padded with a zero high nibble
    assert packed.dtype == np.uint8
    assert packed.tolist() == [[0x21, 0x43, 0x0F], [0xF0, 0x0F, 0x07]]
    assert pack_nibbles(np.array([5, 10], np.uint8)).tolist() == [0xA5]


def test_matmul_nbits_layout():
    w = weights(6, 96)  # 3 blocks per row: zero points pad each row to 2 bytes
    packed = matmul_nbits(w)
    assert packed["B"].shape == (6, 3, 16) and packed["B"].dtype == np.uint8
    assert packed["scales"].shape == (18,) and packed["zero_points"].shape == (12,)
    q, scale, zero = int4_blocks(w)
    np.testing.assert_array_equal(packed["B"].reshape(6, -1), pack_nibbles(q))
    np.testing.assert_array_equal(packed["scales"], scale.ravel())
    np.testing.assert_array_equal(packed["zero_points"].reshape(6, 2), pack_nibbles(zero))


def _matmul_nbits_session(k, n, packed, accuracy_level, bits=4):
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(v, name) for name, v in packed.items()]
    node = helper.make_node("MatMulNBits", ["A", "B", "scales", "zero_points"], ["Y"], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=INT4_BLOCK, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "nbits", [helper.make_tensor_value_info("A", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("k, n", [(64, 48), (96, 40)])
def test_matmul_nbits_in_onnxruntime(k, n):
    """One MatMulNBits node fed our layout computes x @ dequantized(W).T."""
    w = weights(n, k, seed=2)
    x = np.random.default_rng(3).standard_normal((5, k)).astype(np.float32)
    q, scale, zero = int4_blocks(w)
    expected = x @ dequantize_int4(q, scale, zero, k).T
    y = _matmul_nbits_session(k, n, matmul_nbits(w), accuracy_level=0).run(None, {"A": x})[0]
    assert y.shape == (5, n)
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
    # and it is int4: far from the float weights, relative to the quantized result's own error
    assert np.abs(y - x @ w.T).max() > 1e-2


@pytest.mark.parametrize("k, n", [(64, 48), (96, 40)])
def test_8_bit_matmul_nbits_in_onnxruntime(k, n):
    """`--int8-rows`' layout: 8-bit blocks of 32 with zero points, one byte each; the node computes
    x @ dequantized(W).T, within 8 bits' error of the float weights."""
    w = weights(n, k, seed=4)
    x = np.random.default_rng(5).standard_normal((5, k)).astype(np.float32)
    packed = matmul_nbits(w, bits=8)
    blocks = k // INT4_BLOCK
    assert packed["B"].shape == (n, blocks, INT4_BLOCK) and packed["zero_points"].shape == (n * blocks,)
    q, scale, zero = int4_blocks(w, bits=8)
    assert q.max() > 15 and q.max() <= 255
    expected = x @ dequantize_int4(q, scale, zero, k).T
    y = _matmul_nbits_session(k, n, packed, accuracy_level=0, bits=8).run(None, {"A": x})[0]
    np.testing.assert_allclose(y, expected, rtol=1e-4, atol=1e-4)
    assert np.abs(y - x @ w.T).max() < np.abs(expected).max() * 0.02
