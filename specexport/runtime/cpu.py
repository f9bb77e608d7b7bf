"""What this CPU can do, as far as the int8 kernels care.

ONNX Runtime's DynamicQuantizeMatMul multiplies uint8 activations by int8 weights. With VNNI (AVX512-VNNI,
AVX-VNNI) or AMX the products accumulate in int32. Without them (AVX2 only, or AVX-512 without VNNI) the kernel
adds pairs of products in int16 first (vpmaddubsw), which saturates when both are large: 255 * 127 * 2 > 32767.
Measured on an AVX2-only AMD EPYC: logits off by up to 1.3 on a tiny model with 8-bit weights, 0.2 with 7-bit
ones (255 * 63 * 2 fits). So int8 weights keep 8 bits only where the CPU has an int8 dot product.
"""

from __future__ import annotations

import platform
from functools import cache

INT8_DOT = {"avx512_vnni", "avx_vnni", "amx_int8"}  # /proc/cpuinfo flags of an int32-accumulating int8 dot


@cache
def flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def int8_weight_bits() -> int:
    """Bits the int8 weights may use on this CPU without saturating ORT's kernels: 8 with an int8 dot product, or
    off x86 (ARM's dot products accumulate in int32), else 7."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686") or not flags():
        return 8
    return 8 if flags() & INT8_DOT else 7
