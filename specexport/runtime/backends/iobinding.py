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

The batched engine's pool (`new_pool`, runtime/scheduler.py) is one allocation [2 * layers, slots, kv_heads, capacity,
head_dim] too: the first n slots of a layer are contiguous, so a batched call binds each layer's first n slots by
address as `KVPool.rows(n)` does on the host, and one slot alone likewise. A slot's compaction and the move of a slot
into a freed one run as two more small graphs over the whole pool, in place (`pool_compact_model`, `slot_copy_model`).
A one-sequence cache (a `DeviceCache` of batch 1, a pool's slot) gives rows of every layer to the prefix cache
(runtime/prefix.py) as a new device tensor and takes them back in place, by two more (`take_rows_model`,
`put_rows_model`): kept prompt beginnings never leave the device.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specexport.errors import UserError
from specexport.runtime import kernels
from specexport.runtime.backends.host import (
    ORT_TYPES,
    check_step,
    laid_out,
    load_session,
    on_cpu,
    ragged_inputs,
    session_options,
)
from specexport.runtime.kvcache import CacheRows, SlotPool, SlotView
from specexport.runtime.verify import greedy_inputs

_TYPES = {"fp32": (np.float32, 1), "fp16": (np.float16, 10)}  # numpy type, ONNX element type
_KEEP = 64  # staged input OrtValues kept per session (the steady state repeats a few shapes; prefills vary)


class _DeviceRowsAt(ABC):
    """Rows by offset of a one-sequence device cache (runtime/prefix.py's copies), on the device: `_rows_view` gives
    the buffer's address, its shape as the row graphs see it [slices, capacity, head_dim] and the slices of it that
    are this sequence's."""

    batch: int
    owner: "DeviceSession"

    @property
    def keeps_rows(self) -> bool:
        return self.batch == 1

    def rows_at(self, start: int, n: int) -> list["DeviceRows"]:
        """A copy of rows [start, start + n) of every layer (`HostRows.rows_at`'s counterpart)."""
        return [self.owner.take_rows(*self._rows_view(), start, n)]

    def put_rows(self, start: int, rows: list["DeviceRows"]) -> None:
        """Write `rows_at`'s copy back at rows [start, start + n) (the length is the caller's to advance)."""
        self.owner.put_rows(*self._rows_view(), start, rows[0])

    @abstractmethod
    def _rows_view(self) -> tuple[int, list[int], np.ndarray]:
        """The buffer's address, its shape as the row graphs see it, this sequence's slices of it."""


class DeviceCache(_DeviceRowsAt, CacheRows):
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
        self.batch = batch

    def move(self, src: np.ndarray) -> None:
        self.owner.compact(self, src)  # on the device

    def _rows_view(self) -> tuple[int, list[int], np.ndarray]:
        flat = [int(np.prod(self.shape[:3])), self.capacity, self.shape[4]]
        return self.pointer, flat, np.arange(flat[0])


class DevicePool(SlotPool):
    """The KV cache of a batch on a `DeviceSession`'s device: one allocation [2 * layers, slots, kv_heads, capacity,
    head_dim] (a layer's first n slots contiguous: `rows(n)` binds them by address, no copy); its views are
    `DeviceSlots`, and a slot moves on the device."""

    def __init__(self, owner: "DeviceSession", slots: int, capacity: int):
        super().__init__(slots, capacity)
        i = owner.info
        self.owner, self.shape = owner, (2 * i["layers"], slots, i["kv_heads"], capacity, i["head_dim"])
        self.value = ort.OrtValue.ortvalue_from_shape_and_type(list(self.shape), owner.dtype, owner.device, 0)
        self.value.update_inplace(np.zeros(self.shape, owner.dtype))  # no garbage (0 * NaN) in rows a mask hides
        self.pointer = self.value.data_ptr()
        self.slot_bytes = int(np.prod(self.shape[2:])) * np.dtype(owner.dtype).itemsize
        self.layer_bytes = slots * self.slot_bytes

    @property
    def nbytes(self) -> int:
        return self.layer_bytes * self.shape[0]

    def view(self, start: int, stop: int) -> "DeviceSlots":
        return DeviceSlots(self, start, stop)

    def move_slot(self, src: int, dst: int) -> None:
        self.owner.copy_slot(self, src, dst)  # every row of the slot: as cheap on the device
        self.lengths[dst] = self.lengths[src]
        self.placed.pop(dst, None)


class DeviceSlots(_DeviceRowsAt, SlotView):
    """Device slots as one cache, bound by address like a `DeviceCache` (its layers `layer_bytes` apart)."""

    def __init__(self, pool: DevicePool, start: int, stop: int):
        super().__init__(pool, start, stop)
        self.owner, self.shape = pool.owner, (pool.shape[0], stop - start) + pool.shape[2:]
        self.pointer, self.layer_bytes = pool.pointer + start * pool.slot_bytes, pool.layer_bytes
        self.bindings: dict[tuple, ort.IOBinding] = {}

    def move(self, src: np.ndarray) -> None:
        self.owner.compact_slot(self.pool, self.start, src)  # on the device

    def _rows_view(self) -> tuple[int, list[int], np.ndarray]:
        g, slots, heads, capacity, width = self.pool.shape  # the slot's slices: each layer's keys and values, each head
        slices = (np.arange(g)[:, None] * slots + self.start) * heads + np.arange(heads)
        return self.pool.pointer, [g * slots * heads, capacity, width], slices.reshape(-1)


class DeviceRows:
    """Rows of a cache copied on the device: [2 * layers * kv_heads, n, head_dim], as `rows_at` took them."""

    def __init__(self, value: ort.OrtValue, itemsize: int):
        self.value, self.shape = value, value.shape()
        self.nbytes = int(np.prod(self.shape)) * itemsize


class DeviceSession:
    """A step graph (or any graph, through `run`) on `device` ("cuda" or "cpu") with device-resident I/O: the
    `backend.Backend` protocol."""

    def __init__(self, graph_path: Path, graph_info: dict, threads: int | None, device: str, spin: bool = True):
        if graph_info["kv_dtype"] not in _TYPES:
            raise UserError(f"KV dtype {graph_info['kv_dtype']} cannot run with ONNX Runtime's I/O binding")
        self.info, self.device = graph_info, device
        self.dtype, self.elem_type = _TYPES[graph_info["kv_dtype"]]
        self.session = load_session(graph_path, threads, device, spin, graph_info)
        self.layers = graph_info.get("layers", 0)
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.output_dims = {o.name: o.shape for o in self.session.get_outputs()}
        self.output_types = {o.name: ORT_TYPES.get(o.type) for o in self.session.get_outputs()}
        self.batch_outputs = {name for name, dims in self.output_dims.items() if dims and dims[0] == "batch"}
        names = {i.name for i in self.session.get_inputs()}
        self.input_types = {i.name: ORT_TYPES.get(i.type, self.dtype) for i in self.session.get_inputs()}
        if "attention_bias" in names:
            raise UserError(f"{graph_path.name} takes the wide attention bias of bundles exported before the compact "
                            f"tree mask: re-export the bundle to run it on a device")
        self.fused_inputs = "sample_u" in names  # exporter/fused.py
        self.ragged = "live_rows" in names  # exporter/graph.py
        self.lays_out = self.ragged and on_cpu(self.session) and kernels.ATTENTION_ROWS not in graph_info.get("kernels", ())  # runtime/backends/layout.py
        self.lanes = self.lays_out and bool(graph_info.get("tree_lanes"))
        self.seq_outputs = {name for name, dims in self.output_dims.items() if dims[:2] == ["batch", "seq"]}
        self.calls, self.seconds = 0, 0.0
        self.staged: dict[tuple, ort.OrtValue] = {}  # (input name, shape) -> its device buffer
        self.results: dict[str, ort.OrtValue] = {}  # output name -> its device buffer, grown to the largest step
        # the caches' compaction and slot-copy graphs (`_run_in_place`), each made on its first use
        self.kv_graphs: dict[str, ort.InferenceSession] = {}
        self.providers = self.session.get_providers()

    def new_cache(self, capacity: int, batch: int = 1) -> DeviceCache:
        return DeviceCache(self, batch, self.info.get("kv_capacity") or capacity)

    def new_pool(self, slots: int, capacity: int) -> DevicePool:
        """The KV cache of a batch of `slots` sequences of up to `capacity` rows each (runtime/scheduler.py)."""
        if self.info.get("kv_capacity"):
            raise UserError("this graph's cache length is fixed (trt flavour): batched serving runs on ort-flavour "
                            "graphs")
        return DevicePool(self, slots, capacity)

    def forward(self, cache: DeviceCache, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray,
                logits_indices: np.ndarray, want: tuple[str, ...] = ("logits",),
                inputs: dict[str, np.ndarray] | None = None, accept: dict[str, np.ndarray] | None = None,
                live: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """One step (the `Backend` protocol)."""
        b, t = input_ids.shape
        past = cache.past_lengths(b)
        check_step(cache, t, tree_mask, past)
        layout = laid_out(self, cache, input_ids, position_ids, tree_mask, logits_indices, live, inputs, past)
        real = None
        if layout is not None:  # as the host backend's
            input_ids, position_ids, tree_mask, logits_indices = (layout.input_ids, layout.position_ids,
                                                                  layout.tree_mask, layout.logits_indices)
            t, real = input_ids.shape[1], layout.real
        io = self._binding(cache, want)
        mask = tree_mask.reshape((-1,) + tree_mask.shape[-2:])
        self._stage(io, "input_ids", input_ids, np.int64)
        self._stage(io, "position_ids", position_ids, np.int64)
        self._stage(io, "tree_mask", np.broadcast_to(mask, (b,) + mask.shape[1:]), np.bool_)
        self._stage(io, "past_len", past, np.int32)
        self._stage(io, "logits_indices", logits_indices, np.int64)
        if self.ragged:
            for name, value in ragged_inputs(b, t, live, real).items():
                self._stage(io, name, value, np.int64)
        for name, value in (inputs or {}).items():
            self._stage(io, name, value, self.input_types[name])
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
        out = {name: self._host(values[2 * self.layers + k]) for k, name in enumerate(want)}
        return out if layout is None else layout.outputs(out, self.seq_outputs)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A plain call: every output, by name (for graphs outside the loop's step, e.g. Medusa's heads)."""
        return dict(zip(self.outputs, self.session.run(self.outputs, feeds)))

    def compact(self, cache: DeviceCache, source_rows: np.ndarray) -> None:
        """Copy the cache rows `source_rows` (absolute, ascending) to [cache.length, + n), in every layer, on the
        device: the cache seen as [2 * layers * batch * kv_heads, capacity, head_dim] (`compact_model`)."""
        flat = [int(np.prod(cache.shape[:3])), cache.capacity, cache.shape[4]]
        self._run_in_place("compact", compact_model, cache.pointer, flat,
                           {"rows": source_rows, "at": np.full(flat[0], cache.length)})

    def compact_slot(self, pool: DevicePool, slot: int, source_rows: np.ndarray) -> None:
        """Copy slot `slot`'s rows `source_rows` (absolute, ascending) to [its length, + k), in every layer, on the
        device: one call over the whole pool seen as [2 * layers * slots * kv_heads, capacity, head_dim], the other
        slots rewriting k rows with themselves (`pool_compact_model`)."""
        g, slots, heads, capacity, width = pool.shape
        k = len(source_rows)
        at = np.minimum(pool.lengths, capacity - k)  # the other slots' own rows, rewritten in place
        src = at[:, None] + np.arange(k)
        at[slot], src[slot] = pool.lengths[slot], source_rows
        n = g * slots * heads
        self._run_in_place("pool_compact", pool_compact_model, pool.pointer, [n, capacity, width], {
            "rows": src, "at": at, "rows_shape": [1, slots, 1, k, 1], "rows_dims": [g, slots, heads, k, width],
            "rows_flat": [n, k, width], "at_shape": [1, slots, 1], "at_dims": [g, slots, heads], "at_flat": [n]})

    def copy_slot(self, pool: DevicePool, src: int, dst: int) -> None:
        """Copy every row of slot src into slot dst, on the device (`slot_copy_model`)."""
        g, slots = pool.shape[:2]
        rest = int(np.prod(pool.shape[2:]))
        self._run_in_place("slot_copy", slot_copy_model, pool.pointer, [g, slots, rest],
                           {"slot": [src], "at": [dst] * g})

    def take_rows(self, pointer: int, shape: list[int], slices: np.ndarray, start: int, n: int) -> DeviceRows:
        """Rows [start, start + n) of the buffer at `pointer` seen as `shape` [slices, capacity, head_dim], of the
        `slices` given, copied into a new device tensor (`take_rows_model`)."""
        if start + n > shape[1]:
            raise ValueError(f"rows [{start}, {start + n}) outside a cache of {shape[1]}")
        session = self._kv_graph("take_rows", take_rows_model)
        io = session.io_binding()
        io.bind_input("cache", self.device, 0, self.dtype, shape, pointer)
        io.bind_cpu_input("slices", np.ascontiguousarray(slices, np.int64))
        io.bind_cpu_input("rows", np.arange(start, start + n, dtype=np.int64))
        io.bind_output("picked", self.device, 0)  # allocated by ONNX Runtime on the device, kept by the OrtValue
        session.run_with_iobinding(io)
        return DeviceRows(io.get_outputs()[0], np.dtype(self.dtype).itemsize)

    def put_rows(self, pointer: int, shape: list[int], slices: np.ndarray, start: int, rows: DeviceRows) -> None:
        """Write `take_rows`'s copy back at rows [start, start + n) of the same slices, in place (`put_rows_model`)."""
        n = rows.shape[1]
        if start + n > shape[1] or rows.shape[0] != len(slices):
            raise ValueError(f"rows {rows.shape} at {start} do not fit the cache's {len(slices)} slices of {shape[1]}")
        index = np.stack(np.broadcast_arrays(np.asarray(slices)[:, None], start + np.arange(n)), axis=-1)
        self._run_in_place("put_rows", put_rows_model, pointer, shape, {"index": index}, {"rows": rows.value})

    def _kv_graph(self, name: str, model) -> ort.InferenceSession:
        """One of the caches' small graphs (`model(elem_type)`), made on first use."""
        session = self.kv_graphs.get(name)
        if session is None:
            so = session_options(1, spin=False)
            session = self.kv_graphs[name] = ort.InferenceSession(model(self.elem_type), so, providers=self.providers)
        return session

    def _run_in_place(self, name: str, model, pointer: int, shape: list[int], feeds: dict,
                      values: dict[str, ort.OrtValue] | None = None) -> None:
        """Run one of the cache's graphs (`_kv_graph`) with the device buffer at `pointer` bound as its `cache` input
        and `present` output (`shape`: the graph's view of it; the graph writes in place), the int64 `feeds` from
        the host and device `values`."""
        session = self._kv_graph(name, model)
        io = session.io_binding()
        io.bind_input("cache", self.device, 0, self.dtype, shape, pointer)
        io.bind_output("present", self.device, 0, self.dtype, shape, pointer)
        for key, value in feeds.items():
            io.bind_cpu_input(key, np.ascontiguousarray(value, np.int64))
        for key, value in (values or {}).items():
            io.bind_ortvalue_input(key, value)
        session.run_with_iobinding(io)

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


def compact_model(elem_type: int) -> bytes:
    """The compaction graph, serialized here (the runtime does not import onnx): inputs `cache` [n, s, d] of
    `elem_type`, `rows` [k] int64 and `at` [n] int64; output `present` = cache with rows [at, at + k) of each slice
    set to its rows `rows` (Gather on axis 1, then TensorScatter, linear, axis 1)."""
    nodes = [_node("Gather", ["cache", "rows"], ["picked"], axis=1),
             _node("TensorScatter", ["cache", "picked", "at"], ["present"], axis=1)]
    return _model("kv_compact", nodes, [_value("cache", elem_type, ["n", "s", "d"]), _value("rows", 7, ["k"]),
                                        _value("at", 7, ["n"])], _value("present", elem_type, ["n", "s", "d"]))


def pool_compact_model(elem_type: int) -> bytes:
    """A pool's compaction graph: `cache` [n, s, d] is the pool [2 * layers, slots, kv_heads, capacity, head_dim]
    seen flat, `rows` [slots, k] the rows each slot keeps and `at` [slots] where it writes them; `present` = cache
    with rows [at, at + k) of each of a slot's slices set to its rows `rows`. The per-slot inputs are spread over the
    slices inside the graph (Reshape and Expand to the shapes the host gives: `rows_shape` [1, slots, 1, k, 1],
    `rows_dims` [2 * layers, slots, kv_heads, k, head_dim], `rows_flat` [n, k, head_dim], `at_shape` [1, slots, 1],
    `at_dims` [2 * layers, slots, kv_heads], `at_flat` [n]), then GatherElements and TensorScatter on axis 1."""
    nodes = [_node("Reshape", ["rows", "rows_shape"], ["rows5"]), _node("Expand", ["rows5", "rows_dims"], ["rows_all"]),
             _node("Reshape", ["rows_all", "rows_flat"], ["index"]),
             _node("GatherElements", ["cache", "index"], ["picked"], axis=1),
             _node("Reshape", ["at", "at_shape"], ["at3"]), _node("Expand", ["at3", "at_dims"], ["at_all"]),
             _node("Reshape", ["at_all", "at_flat"], ["at_rows"]),
             _node("TensorScatter", ["cache", "picked", "at_rows"], ["present"], axis=1)]
    shapes = [_value(name, 7, [name + ".rank"]) for name in
              ("rows_shape", "rows_dims", "rows_flat", "at_shape", "at_dims", "at_flat")]
    inputs = [_value("cache", elem_type, ["n", "s", "d"]), _value("rows", 7, ["slots", "k"]),
              _value("at", 7, ["slots"])]
    return _model("kv_pool_compact", nodes, inputs + shapes, _value("present", elem_type, ["n", "s", "d"]))


def slot_copy_model(elem_type: int) -> bytes:
    """A pool's slot copy: `cache` [2 * layers, slots, rest], `slot` [1] and `at` [2 * layers] (the slot to write,
    repeated); `present` = cache with slot `at` set to slot `slot` (Gather, then TensorScatter on axis 1)."""
    nodes = [_node("Gather", ["cache", "slot"], ["picked"], axis=1),
             _node("TensorScatter", ["cache", "picked", "at"], ["present"], axis=1)]
    return _model("kv_slot_copy", nodes, [_value("cache", elem_type, ["g", "s", "r"]), _value("slot", 7, ["one"]),
                                          _value("at", 7, ["g"])], _value("present", elem_type, ["g", "s", "r"]))


def take_rows_model(elem_type: int) -> bytes:
    """Rows of some slices of a cache: `cache` [n, s, d], `slices` [p] and `rows` [k] int64; `picked` [p, k, d] (two
    Gathers, on axes 0 and 1)."""
    nodes = [_node("Gather", ["cache", "slices"], ["sliced"], axis=0),
             _node("Gather", ["sliced", "rows"], ["picked"], axis=1)]
    return _model("kv_take_rows", nodes, [_value("cache", elem_type, ["n", "s", "d"]), _value("slices", 7, ["p"]),
                                          _value("rows", 7, ["k"])], _value("picked", elem_type, ["p", "k", "d"]))


def put_rows_model(elem_type: int) -> bytes:
    """`take_rows_model`'s rows written back: `cache` [n, s, d], `index` [p, k, 2] int64 (slice, row) and `rows`
    [p, k, d]; `present` = cache with those rows set (ScatterND)."""
    nodes = [_node("ScatterND", ["cache", "index", "rows"], ["present"])]
    return _model("kv_put_rows", nodes, [_value("cache", elem_type, ["n", "s", "d"]), _value("index", 7, ["p", "k", "two"]),
                                         _value("rows", elem_type, ["p", "k", "d"])],
                  _value("present", elem_type, ["n", "s", "d"]))


def _value(name: str, elem_type: int, dims: list[str]) -> bytes:
    """A ValueInfoProto: a tensor of `elem_type` with named dims."""
    shape = b"".join(_field(1, _field(2, d)) for d in dims)  # TensorShapeProto.dim: Dimension.dim_param
    return _field(1, name) + _field(2, _field(1, _field(1, elem_type) + _field(2, shape)))  # ValueInfo/Type/Tensor


def _node(op: str, inputs: list[str], outputs: list[str], axis: int | None = None) -> bytes:
    """A NodeProto, with an int attribute `axis` where given."""
    attribute = b"" if axis is None else _field(5, _field(1, "axis") + _field(3, axis) + _field(20, 2))  # INT
    return b"".join(_field(1, i) for i in inputs) + b"".join(_field(2, o) for o in outputs) + _field(4, op) + attribute


def _model(name: str, nodes: list[bytes], inputs: list[bytes], output: bytes) -> bytes:
    """A ModelProto (IR 10, opset 24) of one graph."""
    graph = b"".join(_field(1, n) for n in nodes) + _field(2, name) + b"".join(_field(11, i) for i in inputs) \
        + _field(12, output)
    return _field(1, 10) + _field(2, "specexport") + _field(7, graph) + _field(8, _field(1, "") + _field(2, 24))


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
