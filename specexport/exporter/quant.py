"""Weight quantization into the layouts ONNX Runtime's kernels read.

All functions take a PyTorch-layout weight [out, in] (float32) and return numpy arrays.
"""

from __future__ import annotations

import numpy as np

from specexport.errors import UserError

INT4_BLOCK = 32
ROWS4_TILE = 16  # output columns in one tile of MatMulRows4
TRT_INT4_BLOCK = 64  # TensorRT's weight-only int4: signed, symmetric, blocks of 64 or 128 (the finer one here)


def int8_per_channel(w: np.ndarray, bits: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric signed int8, one scale per output channel: (q [in, out] int8, scale [out] fp32). `bits` 7 keeps
    |q| <= 63, for CPUs whose int8 kernels saturate on larger products (runtime/cpu.py).

    Signed weights keep ORT's DynamicQuantizeMatMul on the AMX/VNNI path (unsigned ones lose it).
    """
    top = 2 ** (bits - 1) - 1
    amax = np.abs(w).max(axis=1)
    scale = np.where(amax > 0, amax / top, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / scale[:, None]), -top, top).astype(np.int8)
    return np.ascontiguousarray(q.T), scale


def int4_blocks(w: np.ndarray, block: int = INT4_BLOCK, bits: int = 4) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Asymmetric unsigned ints of `bits` (4: uint4) in blocks of `block` along the input dim.

    Returns (q [out, in_padded] uint8 values 0..2^bits - 1, scale [out, blocks] fp32, zero [out, blocks] uint8);
    w ~= (q - zero) * scale blockwise.
    """
    out_dim, in_dim = w.shape
    top = 2 ** bits - 1
    pad = (-in_dim) % block
    wp = np.pad(w, ((0, 0), (0, pad))).reshape(out_dim, -1, block)
    lo = np.minimum(wp.min(axis=2), 0.0)
    hi = np.maximum(wp.max(axis=2), 0.0)
    scale = np.where(hi > lo, (hi - lo) / top, 1.0).astype(np.float32)
    zero = np.clip(np.rint(-lo / scale), 0, top).astype(np.uint8)
    q = np.clip(np.rint(wp / scale[..., None]) + zero[..., None], 0, top).astype(np.uint8)
    return q.reshape(out_dim, -1), scale, zero


def int4_symmetric_blocks(w: np.ndarray, block: int = TRT_INT4_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Signed symmetric int4 in blocks of `block` along the input dim (TensorRT's layout: no zero points).

    Returns (q [out, in] int8 values -7..7, scale [out, blocks] fp32); w ~= q * scale blockwise. `in` must be a
    multiple of `block`.
    """
    out_dim, in_dim = w.shape
    wb = w.reshape(out_dim, in_dim // block, block)
    amax = np.abs(wb).max(axis=2)
    scale = np.where(amax > 0, amax / 7.0, 1.0).astype(np.float32)
    q = np.clip(np.rint(wb / scale[..., None]), -7, 7).astype(np.int8)
    return q.reshape(out_dim, in_dim), scale


def pack_nibbles(values: np.ndarray) -> np.ndarray:
    """Pack uint8 values 0..15 pairwise along the last axis, low nibble first."""
    if values.shape[-1] % 2:
        values = np.concatenate([values, np.zeros(values.shape[:-1] + (1,), np.uint8)], axis=-1)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def matmul_nbits(w: np.ndarray, block: int = INT4_BLOCK, bits: int = 4) -> dict[str, np.ndarray]:
    """Inputs of com.microsoft::MatMulNBits (bits 4 or 8): B [N, blocks, block * bits / 8], scales, zero_points."""
    q, scale, zero = int4_blocks(w, block, bits)
    out_dim = w.shape[0]
    if bits == 8:
        return {"B": q.reshape(out_dim, -1, block), "scales": scale.reshape(-1), "zero_points": zero.reshape(-1)}
    return {
        "B": pack_nibbles(q).reshape(out_dim, -1, block // 2),
        "scales": scale.reshape(-1),
        "zero_points": pack_nibbles(zero).reshape(-1),
    }


def rows4(w: np.ndarray) -> dict[str, np.ndarray]:
    """specexport's MatMulRows4 (runtime/kernels/rows4.c) weight inputs for a PyTorch-layout weight [out, in]: the int4 blocks of MatMulNBits' int4
    (quant.int4_blocks: w ~= (q - zero) * scale) in rows4.c's tile order. Example: w [576, 576] -> B [36, 18, 256],
    scales and zeros [36, 18, 16]. `in` must be a multiple of 32; `out` is padded to a multiple of 16 with zero
    weights (the kernel never writes their columns)."""
    if w.shape[1] % INT4_BLOCK:
        raise UserError(f"--int4-rows needs input dims divisible by {INT4_BLOCK}; got {w.shape[0]} x {w.shape[1]}")
    w = np.pad(w, ((0, -w.shape[0] % ROWS4_TILE), (0, 0)))
    out_dim, in_dim = w.shape
    q, scale, zero = int4_blocks(w)
    blocks = in_dim // INT4_BLOCK
    # [tile, column, block, run p, half h, j] -> input 8p + 4h + j of the block
    t = q.reshape(out_dim // ROWS4_TILE, ROWS4_TILE, blocks, 4, 2, 4)
    t = t.transpose(0, 2, 3, 1, 5, 4)  # [tile, block, p, column, j, h]
    packed = (t[..., 0] | (t[..., 1] << 4)).astype(np.uint8)
    by_tile = (out_dim // ROWS4_TILE, ROWS4_TILE, blocks)  # scales and zeros [N, blocks] -> [tile, block, column]
    return {"B": np.ascontiguousarray(packed.reshape(out_dim // ROWS4_TILE, blocks, 256)),
            "scales": np.ascontiguousarray(scale.reshape(by_tile).transpose(0, 2, 1)),
            "zeros": np.ascontiguousarray(zero.reshape(by_tile).transpose(0, 2, 1))}


def dequantize_int4(q: np.ndarray, scale: np.ndarray, zero: np.ndarray, in_dim: int) -> np.ndarray:
    """Inverse of int4_blocks (for tests and the numerics report)."""
    out_dim = q.shape[0]
    blocks = scale.shape[1]
    w = (q.reshape(out_dim, blocks, -1).astype(np.float32) - zero[..., None]) * scale[..., None]
    return w.reshape(out_dim, -1)[:, :in_dim]


def qmoe_block(hidden: int, inter: int) -> int:
    """The int4 block of ONNX Runtime's QMoE: 32, or 16 where a dimension is not a multiple of 32 (both dims must
    divide by it)."""
    for block in (INT4_BLOCK, 16):
        if hidden % block == 0 and inter % block == 0:
            return block
    raise UserError(f"int4 experts need hidden and expert sizes divisible by 16 (ONNX Runtime's QMoE); got {hidden} "
                    f"and {inter}")


def qmoe_experts(experts, bits: int, block: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Experts (each [out, in]: an [E, out, in] array or a list) in ONNX Runtime's QMoE layout, quantized one at a
    time so that the transients stay one expert's: uint8 with zero point 2^(bits-1) (no zero-point input), row-major
    [E, out, in * bits / 8], low nibble first; int8 one scale per output row [E, out], int4 symmetric blocks of
    `block` along `in` [E, out, in / block] (qmoe_block)."""
    codes, scales = [], []
    for w in experts:
        if bits == 8:
            q, scale = int8_per_channel(w)
            codes.append((q.T.astype(np.int16) + 128).astype(np.uint8))
        else:
            q, scale = int4_symmetric_blocks(w, block)
            codes.append(pack_nibbles((q + 8).astype(np.uint8)))
            scale = scale.reshape(w.shape[0], -1)
        scales.append(scale)
    return np.stack(codes), np.stack(scales)
