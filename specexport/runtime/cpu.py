"""What this CPU can do, as far as the int8 kernels care.

ONNX Runtime's DynamicQuantizeMatMul multiplies uint8 activations by int8 weights. With VNNI (AVX512-VNNI,
AVX-VNNI) or AMX the products accumulate in int32. Without them (AVX2 only, or AVX-512 without VNNI) the kernel
adds pairs of products in int16 first (vpmaddubsw), which saturates when both are large: 255 * 127 * 2 > 32767.
Measured on an AVX2-only AMD EPYC: logits off by up to 1.3 on a tiny model with 8-bit weights, 0.2 with 7-bit
ones (255 * 63 * 2 fits). So int8 weights keep 8 bits only where the CPU has an int8 dot product.
"""

from __future__ import annotations

import os
import platform
from functools import cache

INT8_DOT = {"avx512_vnni", "avx_vnni", "amx_int8"}  # /proc/cpuinfo flags of an int32-accumulating int8 dot
# The features that choose ONNX Runtime's CPU kernels (MLAS): the vector width and the int8 dot product. A profile's
# speeds hold on a CPU with the same ones (runtime speeds differ by 2x between an AVX2-only and a VNNI EPYC).
KERNEL_FEATURES = ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8",  # x86
                   "asimddp", "i8mm", "sve")  # Arm: the int8 dot product, int8 matrix multiply, scalable vectors
# numpy's names for them (its CPU dispatch table), where the OS has no /proc/cpuinfo flags (macOS, Windows)
NUMPY_NAMES = {"AVX2": "avx2", "AVX512F": "avx512f", "AVX512_CLX": "avx512_vnni", "AVX512_SPR": "amx_int8",
               "ASIMDDP": "asimddp", "SVE": "sve"}


@cache
def flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them ("flags" on x86, "Features" on Arm); empty elsewhere."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


@cache
def kernel_features() -> tuple[str, ...]:
    """This CPU's KERNEL_FEATURES, in that order, e.g. ("avx2", "avx512f", "avx512_vnni") on a Zen 4 EPYC: from the
    OS's flags, else from numpy's dispatch table."""
    found = flags()
    if not found:
        try:
            from numpy._core._multiarray_umath import __cpu_features__ as table
        except ImportError:  # numpy < 2
            from numpy.core._multiarray_umath import __cpu_features__ as table
        found = {NUMPY_NAMES[name] for name, present in table.items() if present and name in NUMPY_NAMES}
    return tuple(f for f in KERNEL_FEATURES if f in found)


def int8_weight_bits() -> int:
    """Bits the int8 weights may use on this CPU without saturating ORT's kernels: 8 with an int8 dot product, or
    off x86 (ARM's dot products accumulate in int32), else 7."""
    if platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686") or not flags():
        return 8
    return 8 if flags() & INT8_DOT else 7


@cache
def model_name() -> str:
    """The CPU's model name, e.g. "AMD EPYC" (/proc/cpuinfo, else the platform's)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def describe() -> str:
    """E.g. "AMD EPYC, 2 cores, avx2 avx512f avx512_vnni": what sets the speed of ONNX Runtime's CPU kernels."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return f"{model_name()}, {cores} cores, {' '.join(kernel_features()) or 'no vector features found'}"
