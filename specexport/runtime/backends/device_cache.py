"""CUDA device memory through NVIDIA's cuda-python (imported lazily): checked runtime calls, and the KV cache of a
TensorRT engine (runtime/backends/tensorrt.py) in one device allocation, committed with 2-D copies on the device.

Written to cuda-python's documented runtime API (`cuda.bindings.runtime`, or `cuda.cudart` before 12.6); not yet
run on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport.runtime.kvcache import CacheRows

ALIGN = 256  # TensorRT's alignment for I/O tensor addresses


def load_cudart():
    """cuda-python's runtime module, or None when it is not installed."""
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python < 12.6
        except ImportError:
            return None
    return cudart


def row_runs(rows) -> list[tuple[int, int, int]]:
    """The copies that commit accepted rows (offsets from the cache's length, ascending): (to, from, count) for
    each run of rows that must move and whose sources are consecutive; rows already in place are left. Copied in
    order, no copy overwrites a row a later one reads (each source lies at or after its destination)."""
    runs = []
    for to, src in enumerate(int(r) for r in rows):
        if src == to:
            continue
        if runs and runs[-1][0] + runs[-1][2] == to and runs[-1][1] + runs[-1][2] == src:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((to, src, 1))
    return runs


class Cuda:
    """The few cuda-python runtime calls the backend makes, each checked: an error raises with its name."""

    def __init__(self, cudart):
        self.rt = cudart
        self.ok = cudart.cudaError_t.cudaSuccess
        kinds = cudart.cudaMemcpyKind
        self.h2d, self.d2h, self.d2d = (kinds.cudaMemcpyHostToDevice, kinds.cudaMemcpyDeviceToHost,
                                        kinds.cudaMemcpyDeviceToDevice)

    def __call__(self, result):
        err, *values = result if isinstance(result, tuple) else (result,)
        if err != self.ok:
            raise RuntimeError(f"CUDA error {getattr(err, 'name', err)}")
        return values[0] if len(values) == 1 else tuple(values)

    def malloc(self, nbytes: int) -> int:
        return int(self(self.rt.cudaMalloc(max(nbytes, 1))))

    def free(self, ptr: int) -> None:
        self(self.rt.cudaFree(ptr))


@dataclass(frozen=True)
class Layout:
    """Where a cache's rows lie in its one allocation, in bytes from its start: K and V of every layer
    [B, kv_heads, S_max, head_dim] one after another (k0, v0, k1, v1, ...), each block starting 256-byte aligned."""

    row: int  # one row of one head
    pitch: int  # from a head's first row to the next head's
    stride: int  # from one layer's K (or V) to the next block
    blocks: int  # 2 x layers
    heads: int  # batch x kv_heads: the rows of `pitch` in a block

    @classmethod
    def of(cls, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int, itemsize: int) -> "Layout":
        row = head_dim * itemsize
        block = batch * kv_heads * capacity * row
        return cls(row, capacity * row, -(-block // ALIGN) * ALIGN, 2 * layers, batch * kv_heads)

    @property
    def size(self) -> int:
        return self.stride * self.blocks

    def copies(self, length: int, rows) -> list[tuple[int, int, int, int]]:
        """The 2-D copies (to, from, width, height; pitch `pitch`) that commit the step's `rows` (offsets from
        `length`, ascending): one per run of moved rows spanning every block when the blocks lie back to back
        (then a block's heads continue at the same pitch), else one per run and block."""
        spans = [(0, self.blocks * self.heads)] if self.stride == self.heads * self.pitch else \
            [(j * self.stride, self.heads) for j in range(self.blocks)]
        return [(start + (length + to) * self.row, start + (length + src) * self.row, n * self.row, height)
                for to, src, n in row_runs(rows) for start, height in spans]


class DeviceCache(CacheRows):
    """The KV cache in device memory (`Layout`): the runtime's cache protocol (backend.Cache)."""

    def __init__(self, cuda: Cuda, stream, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 itemsize: int):
        self.cuda, self.stream = cuda, stream
        self.capacity, self.batch, self.length = capacity, batch, 0
        self.layout = Layout.of(layers, batch, kv_heads, capacity, head_dim, itemsize)
        self.base = cuda.malloc(self.layout.size)
        cuda(cuda.rt.cudaMemsetAsync(self.base, 0, self.layout.size, stream))
        self.addresses = [self.base + j * self.layout.stride for j in range(self.layout.blocks)]  # k0, v0, k1, ...

    def move(self, src: np.ndarray) -> None:
        """Copied down on the device, a 2-D copy per run of moved rows."""
        pitch = self.layout.pitch
        for to, frm, width, height in self.layout.copies(self.length, src - self.length):
            self.cuda(self.cuda.rt.cudaMemcpy2DAsync(self.base + to, pitch, self.base + frm, pitch, width, height,
                                                     self.cuda.d2d, self.stream))

    def __del__(self):
        try:
            self.cuda.free(self.base)
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may already be gone
            pass
