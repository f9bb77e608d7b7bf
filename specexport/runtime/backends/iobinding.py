"""ONNX Runtime with the KV cache and the step's buffers resident on the session's device (`--device cuda`;
`cpu-iobinding` runs the very same code on the CPU, which is how CI tests it).

Per step only the tokens cross: the inputs are written into OrtValues on the device (`update_inplace`, one kept per
shape), the outputs are bound to preallocated device buffers (grown to the largest step, bound by address with the
step's shape; an output whose length depends on the data, such as the accepted rows, is left to ONNX Runtime), and
only the outputs the step wants are copied to the host. The cache is one device allocation
[2 * layers, batch, kv_heads, capacity, head_dim] (layer l's keys at 2l, its values at 2l + 1), each layer's slice
bound by address as both past input and present output, so the graph writes the new rows in place. A commit of a
path that is not a prefix compacts the accepted rows on the device with a two-node graph (Gather, then
TensorScatter into the same buffer) run on the same device.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specexport.errors import UserError
from specexport.runtime.backends.host import check_step, load_session, ragged_inputs, session_options
from specexport.runtime.kvcache import CacheRows
from specexport.runtime.verify import greedy_inputs

_TYPES = {"fp32": (np.float32, 1), "fp16": (np.float16, 10)}  # numpy type, ONNX element type
_KEEP = 64  # staged input OrtValues kept per session (the steady state repeats a few shapes; prefills vary)


class DeviceCache(CacheRows):
    """The KV cache of a `DeviceSession`, on its device. Its buffer never moves (`pointer` is fixed)."""

    def __init__(self, owner: "DeviceSession", batch: int, capacity: int):
        i = owner.info
        self.owner, self.capacity, self.length = owner, capacity, 0
        self.shape = (2 * i["layers"], batch, i["kv_heads"], capacity, i["head_dim"])
        self.value = ort.OrtValue.ortvalue_from_shape_and_type(list(self.shape), owner.dtype, owner.device, 0)
        if i.get("flavour") != "ort":  # its attention reads every row under the mask: no garbage (0 * NaN) there
            self.value.update_inplace(np.zeros(self.shape, owner.dtype))
        self.pointer = self.value.data_ptr()
        self.layer_bytes = int(np.prod(self.shape[1:])) * np.dtype(owner.dtype).itemsize
        self.bindings: dict[tuple, ort.IOBinding] = {}

    def move(self, src: np.ndarray) -> None:
        self.owner.compact(self, src)  # on the device


class DeviceSession:
    """A step graph (or any graph, through `run`) on `device` ("cuda" or "cpu") with device-resident I/O: the
    `backend.Backend` protocol."""

    def __init__(self, graph_path: Path, graph_info: dict, threads: int | None, device: str, spin: bool = True):
        if graph_info["kv_dtype"] not in _TYPES:
            raise UserError(f"KV dtype {graph_info['kv_dtype']} cannot run with ONNX Runtime's I/O binding")
        self.info, self.device = graph_info, device
        self.dtype, self.elem_type = _TYPES[graph_info["kv_dtype"]]
        self.session = load_session(graph_path, threads, device, spin)
        self.layers = graph_info.get("layers", 0)
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.output_dims = {o.name: o.shape for o in self.session.get_outputs()}
        self.output_types = {o.name: _NUMPY.get(o.type) for o in self.session.get_outputs()}
        names = {i.name for i in self.session.get_inputs()}
        if "attention_bias" in names:
            raise UserError(f"{graph_path.name} takes the wide attention bias of bundles exported before the compact "
                            f"tree mask: re-export the bundle to run it on a device")
        self.fused_inputs = "sample_u" in names  # exporter/fused.py
        self.ragged = "live_rows" in names  # exporter/graph.py
        self.calls, self.seconds = 0, 0.0
        self.staged: dict[tuple, ort.OrtValue] = {}  # (input name, shape) -> its device buffer
        self.results: dict[str, ort.OrtValue] = {}  # output name -> its device buffer, grown to the largest step
        self.compactor = None  # the compaction graph's session, made on the first commit that needs it
        self.providers = self.session.get_providers()

    def new_cache(self, capacity: int, batch: int = 1) -> DeviceCache:
        return DeviceCache(self, batch, self.info.get("kv_capacity") or capacity)

    def forward(self, cache: DeviceCache, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray,
                logits_indices: np.ndarray, want: tuple[str, ...] = ("logits",),
                inputs: dict[str, np.ndarray] | None = None, accept: dict[str, np.ndarray] | None = None,
                live: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """One step (the `Backend` protocol)."""
        b, t = input_ids.shape
        check_step(cache, t, tree_mask)
        io = self._binding(cache, want)
        mask = tree_mask.reshape((-1,) + tree_mask.shape[-2:])
        self._stage(io, "input_ids", input_ids, np.int64)
        self._stage(io, "position_ids", position_ids, np.int64)
        self._stage(io, "tree_mask", np.broadcast_to(mask, (b,) + mask.shape[1:]), np.bool_)
        self._stage(io, "past_len", np.full(b, cache.length), np.int32)
        self._stage(io, "logits_indices", logits_indices, np.int64)
        if self.ragged:
            for name, value in ragged_inputs(b, t, live).items():
                self._stage(io, name, value, np.int64)
        for name, value in (inputs or {}).items():
            self._stage(io, name, value, self.dtype)
        if self.fused_inputs:
            for name, value in (accept or greedy_inputs(len(logits_indices))).items():
                self._stage(io, name, value, np.float32)
        sizes = {"batch": b, "seq": t, "rows": len(logits_indices)}
        for name in want:
            self._bind_result(io, name, sizes)
        start = time.perf_counter()
        self.session.run_with_iobinding(io)
        self.calls, self.seconds = self.calls + 1, self.seconds + time.perf_counter() - start
        values = io.get_outputs()  # the cache's presents first, then `want` in binding order
        if len(values) != 2 * self.layers + len(want):
            raise RuntimeError(f"unexpected bound outputs: {len(values)}")
        return {name: self._host(values[2 * self.layers + k]) for k, name in enumerate(want)}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A plain call: every output, by name (for graphs outside the loop's step, e.g. Medusa's heads)."""
        return dict(zip(self.outputs, self.session.run(self.outputs, feeds)))

    def compact(self, cache: DeviceCache, source_rows: np.ndarray) -> None:
        """Copy the cache rows `source_rows` (absolute, ascending) to [cache.length, + n), in every layer, on the
        device: the cache seen as [2 * layers * batch * kv_heads, capacity, head_dim], bound as input and output."""
        if self.compactor is None:
            so = session_options(1, spin=False)
            self.compactor = ort.InferenceSession(compact_model(self.elem_type), so, providers=self.providers)
        flat = [int(np.prod(cache.shape[:3])), cache.capacity, cache.shape[4]]
        io = self.compactor.io_binding()
        io.bind_input("cache", self.device, 0, self.dtype, flat, cache.pointer)
        io.bind_output("present", self.device, 0, self.dtype, flat, cache.pointer)
        io.bind_cpu_input("rows", source_rows)
        io.bind_cpu_input("at", np.full(flat[0], cache.length, dtype=np.int64))
        self.compactor.run_with_iobinding(io)

    def _binding(self, cache: DeviceCache, want: tuple[str, ...]) -> ort.IOBinding:
        """One binding per cache and set of wanted outputs: each layer's slice of the cache bound by address as its
        past input and present output."""
        io = cache.bindings.get(want)
        if io is None:
            io = cache.bindings[want] = self.session.io_binding()
            shape = list(cache.shape[1:])
            for layer in range(self.layers):
                for j, kind in enumerate(("key", "value")):
                    address = cache.pointer + (2 * layer + j) * cache.layer_bytes
                    io.bind_input(f"past_key_values.{layer}.{kind}", self.device, 0, self.dtype, shape, address)
                    io.bind_output(f"present.{layer}.{kind}", self.device, 0, self.dtype, shape, address)
        return io

    def _stage(self, io: ort.IOBinding, name: str, value: np.ndarray, dtype) -> None:
        """Write an input into its device buffer (one per shape) and bind it."""
        value = np.ascontiguousarray(value, dtype=dtype)
        key = (name, value.shape)
        buffer = self.staged.get(key)
        if buffer is None:
            if len(self.staged) >= _KEEP:
                self.staged.clear()
            buffer = self.staged[key] = ort.OrtValue.ortvalue_from_shape_and_type(list(value.shape), dtype,
                                                                                  self.device, 0)
        buffer.update_inplace(value)
        io.bind_ortvalue_input(name, buffer)

    def _host(self, value: ort.OrtValue) -> np.ndarray:
        """An output on the host: a copy (on the CPU `numpy()` is a view of the buffer the next step overwrites)."""
        array = value.numpy()
        return array.copy() if self.device == "cpu" else array

    def _bind_result(self, io: ort.IOBinding, name: str, sizes: dict[str, int]) -> None:
        """Bind an output to its device buffer with this step's shape; one whose shape the step does not fix (the
        accepted rows) is allocated by ONNX Runtime on the device."""
        dims = [sizes.get(d) if isinstance(d, str) else d for d in self.output_dims[name]]
        dtype = self.output_types[name]
        if None in dims or dtype is None:
            io.bind_output(name, self.device, 0)
            return
        count = int(np.prod(dims))
        buffer = self.results.get(name)
        if buffer is None or int(np.prod(buffer.shape())) < count:
            buffer = self.results[name] = ort.OrtValue.ortvalue_from_shape_and_type([count], dtype, self.device, 0)
        io.bind_output(name, self.device, 0, dtype, dims, buffer.data_ptr())


_NUMPY = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
          "tensor(int32)": np.int32, "tensor(bool)": np.bool_}


def compact_model(elem_type: int) -> bytes:
    """The compaction graph, serialized here (the runtime does not import onnx): inputs `cache` [n, s, d] of
    `elem_type`, `rows` [k] int64 and `at` [n] int64; output `present` = cache with rows [at, at + k) of each slice
    set to its rows `rows` (Gather on axis 1, then TensorScatter, linear, axis 1)."""
    def value(name, elem, dims):
        shape = b"".join(_field(1, _field(2, d)) for d in dims)  # TensorShapeProto.dim: Dimension.dim_param
        return _field(1, name) + _field(2, _field(1, _field(1, elem) + _field(2, shape)))  # ValueInfo/Type/Tensor

    def node(op, inputs, outputs, axis):
        attribute = _field(1, "axis") + _field(3, axis) + _field(20, 2)  # AttributeProto: name, i, type INT
        return b"".join(_field(1, i) for i in inputs) + b"".join(_field(2, o) for o in outputs) + _field(4, op) \
            + _field(5, attribute)

    graph = (_field(1, node("Gather", ["cache", "rows"], ["picked"], 1))
             + _field(1, node("TensorScatter", ["cache", "picked", "at"], ["present"], 1))
             + _field(2, "kv_compact")
             + _field(11, value("cache", elem_type, ["n", "s", "d"])) + _field(11, value("rows", 7, ["k"]))
             + _field(11, value("at", 7, ["n"])) + _field(12, value("present", elem_type, ["n", "s", "d"])))
    opset = _field(1, "") + _field(2, 24)
    return _field(1, 10) + _field(2, "specexport") + _field(7, graph) + _field(8, opset)  # ModelProto, IR 10


def _field(number: int, value: int | str | bytes) -> bytes:
    """One protobuf field: a varint, or length-delimited bytes/text."""
    if isinstance(value, int):
        return _varint(number << 3) + _varint(value)
    data = value.encode() if isinstance(value, str) else value
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)
