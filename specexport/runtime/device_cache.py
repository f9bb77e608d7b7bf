"""CUDA device memory through NVIDIA's cuda-python (imported lazily): checked runtime calls, and the KV cache of a
TensorRT engine (runtime/tensorrt.py) in one device allocation, committed with 2-D copies on the device.

Written to cuda-python's documented runtime API (`cuda.bindings.runtime`, or `cuda.cudart` before 12.6); not yet
run on a GPU.
"""

from __future__ import annotations

import numpy as np

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


class DeviceCache:
    """The KV cache in device memory: K and V of every layer in one allocation, [B, kv_heads, S_max, head_dim]
    each, laid one after another (k0, v0, k1, v1, ...). The runtime's cache protocol (backend.Cache)."""

    def __init__(self, cuda: Cuda, stream, layers: int, batch: int, kv_heads: int, capacity: int, head_dim: int,
                 itemsize: int):
        self.cuda, self.stream = cuda, stream
        self.capacity, self.batch, self.length = capacity, batch, 0
        self.row = head_dim * itemsize  # bytes of one row of one head
        self.pitch = capacity * self.row  # bytes from one head's rows to the next head's
        block = batch * kv_heads * self.pitch  # one layer's K (or V)
        stride = -(-block // ALIGN) * ALIGN
        self.base = cuda.malloc(stride * 2 * layers)
        cuda(cuda.rt.cudaMemsetAsync(self.base, 0, stride * 2 * layers, stream))
        self.addresses = [self.base + j * stride for j in range(2 * layers)]  # k0, v0, k1, v1, ...
        # one 2-D copy spans every layer, kind and head when the blocks lie back to back; else one per block
        heads = batch * kv_heads
        self.segments = [(self.base, 2 * layers * heads)] if stride == block else [(a, heads) for a in self.addresses]

    def room(self) -> int:
        return self.capacity - self.length

    def advance(self, n: int) -> None:
        if self.length + n > self.capacity:
            raise ValueError(f"KV cache overflow: {self.length} + {n} > capacity {self.capacity}")
        self.length += n

    def commit(self, rows) -> None:
        """Keep the last step's rows at these offsets from `length` (ascending), copied down on the device."""
        rows = np.asarray(rows, dtype=np.int64)
        if rows.size and (rows.min() < 0 or self.length + rows.max() >= self.capacity):
            raise ValueError(f"commit rows {rows.tolist()} outside the cache")
        rt = self.cuda.rt
        for to, src, n in row_runs(rows):
            for base, height in self.segments:
                dst, source = base + (self.length + to) * self.row, base + (self.length + src) * self.row
                self.cuda(rt.cudaMemcpy2DAsync(dst, self.pitch, source, self.pitch, n * self.row, height,
                                               self.cuda.d2d, self.stream))
        self.length += int(rows.size)

    def rewind(self, length: int) -> None:
        if not 0 <= length <= self.length:
            raise ValueError(f"cannot rewind to {length} (cache holds {self.length})")
        self.length = length

    def __del__(self):
        try:
            self.cuda.free(self.base)
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may already be gone
            pass
