"""ONNX Runtime's host backend (`GraphSession`: the cache in host numpy buffers bound in place, the CPU default),
and the session helpers the other ONNX Runtime backend (iobinding.DeviceSession) shares. The `Backend` and `Cache`
protocols every backend implements are in backends/protocol.py."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specexport.errors import UserError
from specexport.runtime import kernels, tree
from specexport.runtime.backends.layout import check_live, lay_out
from specexport.runtime.kvcache import KVCache, KVPool
from specexport.runtime.verify import greedy_inputs

_NUMPY_TYPES = {"fp32": np.float32, "fp16": np.float16}
ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64,
             "tensor(int32)": np.int32, "tensor(bool)": np.bool_}  # ONNX Runtime's type names -> numpy


def providers(device: str = "auto") -> list[str]:
    """CUDA when asked for or available (GPU package + GPU), else CPU."""
    available = ort.get_available_providers()
    if device in ("cpu", "cpu-iobinding"):
        return ["CPUExecutionProvider"]
    if device == "cuda" and "CUDAExecutionProvider" not in available:
        raise UserError("CUDA requested but this onnxruntime has no CUDAExecutionProvider (pip install onnxruntime-gpu)")
    if "CUDAExecutionProvider" in available and device in ("auto", "cuda"):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def session_options(threads: int | None = None, optimized_path: Path | None = None, spin: bool = True,
                    graph_info: dict | None = None):
    """`spin`: the intra-op threads busy-wait for the next run (fastest for the session that runs most). A second
    session in the same loop (a draft) must not spin: its idle threads would steal the cores from the target's
    next call (measured on a 2-core CPU: EAGLE at 19 tokens/s with both spinning, 35 with the draft's off).
    `graph_info`: a manifest's graph entry; where it lists "kernels", specexport's own (compiled here at first use)."""
    so = ort.SessionOptions()
    if (graph_info or {}).get("kernels"):
        unknown = set(graph_info["kernels"]) - set(kernels.NAMES)
        if unknown:
            raise UserError(f"this graph needs kernels this specexport does not have ({', '.join(sorted(unknown))}): "
                            "upgrade specexport")
        so.register_custom_ops_library(str(kernels.library()))
    so.intra_op_num_threads = threads or len(os.sched_getaffinity(0))
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if optimized_path is not None:
        so.log_severity_level = 3  # the optimizer's notes on initializers it drops are not the user's concern
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.optimized_model_filepath = str(optimized_path)
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", optimized_path.name + ".data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    return so


class GraphSession:
    """ONNX Runtime with host buffers (the CPU default): the numpy KV cache bound in place as past and present with IO
    binding, the step's inputs bound from numpy. A graph of an older bundle that takes the wide `attention_bias`
    still runs: its bias is built here from the tree mask."""

    def __init__(self, graph_path: Path, graph_info: dict, threads: int | None = None, device: str = "auto",
                 spin: bool = True):
        self.info = graph_info
        self.dtype = _NUMPY_TYPES.get(graph_info["kv_dtype"])
        if self.dtype is None:
            raise UserError(f"KV dtype {graph_info['kv_dtype']} cannot run with this runtime on CPU")
        self.session = load_session(graph_path, threads, device, spin, graph_info)
        self.layers = graph_info.get("layers", 0)
        self.outputs = [o.name for o in self.session.get_outputs()]
        # outputs per batch row ([batch, seq, ...]: hidden states, features) rather than per selected row
        self.batch_outputs = {o.name for o in self.session.get_outputs() if o.shape and o.shape[0] == "batch"}
        self.seq_outputs = {o.name for o in self.session.get_outputs() if o.shape[:2] == ["batch", "seq"]}
        names = {i.name for i in self.session.get_inputs()}
        # a graph's own per-row inputs (EAGLE's features, DFlash's context rows) in their declared types
        self.input_types = {i.name: ORT_TYPES.get(i.type, self.dtype) for i in self.session.get_inputs()}
        self.fused_inputs = "sample_u" in names  # exporter/fused.py
        self.wide_bias = "attention_bias" in names  # bundles exported before the compact tree mask
        self.ragged = "live_rows" in names  # computes a batched step's real rows only (exporter/graph.py)
        self.lays_out = self.ragged and on_cpu(self.session) and kernels.ATTENTION_ROWS not in graph_info.get("kernels", ())  # the CPU kernels' layout (backends/layout.py)
        self.lanes = self.lays_out and bool(graph_info.get("tree_lanes"))
        self.calls, self.seconds = 0, 0.0  # forward calls so far and their time (for `specexport profile`)

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        """A cache of `capacity` rows, or of the graph's own fixed length (the trt flavour's S_max: the bundle's
        context; the steps near its end are cut to the room left)."""
        i = self.info
        capacity = i.get("kv_capacity") or capacity
        return KVCache(i["layers"], batch, i["kv_heads"], capacity, i["head_dim"], self.dtype)

    def new_pool(self, slots: int, capacity: int) -> KVPool:
        """The KV cache of a batch of `slots` sequences of up to `capacity` rows each (runtime/scheduler.py)."""
        i = self.info
        if i.get("kv_capacity"):
            raise UserError("this graph's cache length is fixed (trt flavour): batched serving runs on ort-flavour graphs")
        return KVPool(i["layers"], slots, i["kv_heads"], capacity, i["head_dim"], self.dtype)

    def forward(self, cache: KVCache, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray,
                logits_indices: np.ndarray, want: tuple[str, ...] = ("logits",),
                inputs: dict[str, np.ndarray] | None = None, accept: dict[str, np.ndarray] | None = None,
                live: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """One step (the `Backend` protocol)."""
        b, t = input_ids.shape
        past = cache.past_lengths(b)
        check_step(cache, t, tree_mask, past)
        layout = laid_out(self, cache, input_ids, position_ids, tree_mask, logits_indices, live, inputs, past)
        real = None
        if layout is not None:
            input_ids, position_ids, tree_mask, logits_indices = (layout.input_ids, layout.position_ids,
                                                                  layout.tree_mask, layout.logits_indices)
            t, real = input_ids.shape[1], layout.real
        io, staged = self._binding(cache, want)
        stage = lambda name, value, dtype: self._stage(io, staged, name, value, dtype)  # noqa: E731
        stage("input_ids", input_ids, np.int64)
        stage("position_ids", position_ids, np.int64)
        mask = tree_mask.reshape((-1,) + tree_mask.shape[-2:])
        if self.wide_bias:
            start = cache.length + t - mask.shape[-1]
            width = cache.capacity if self.info.get("bias_width") == "capacity" else cache.length + t
            stage("attention_bias", tree.mask_bias(mask[0], start, width, b), np.float32)
        else:
            stage("tree_mask", np.broadcast_to(mask, (b,) + mask.shape[1:]), np.bool_)
        stage("past_len", past, np.int32)
        stage("logits_indices", logits_indices, np.int64)
        if self.ragged:
            for name, value in ragged_inputs(b, t, live, real).items():
                stage(name, value, np.int64)
        for name, value in (inputs or {}).items():
            stage(name, value, self.input_types[name])
        if self.fused_inputs:
            for name, value in (accept or greedy_inputs(len(logits_indices))).items():
                stage(name, value, np.float32)
        for name in want:  # rebound each run: ORT allocates them with this run's shapes
            io.bind_output(name, "cpu")
        start = time.perf_counter()
        self.session.run_with_iobinding(io)
        self.calls, self.seconds = self.calls + 1, self.seconds + time.perf_counter() - start
        # the cache's presents come first, then `want` in binding order; the binding's own list of ORT values is
        # read, not IOBinding.get_outputs(), which wraps all 2 * layers + len(want) of them in Python every step
        values = io._iobinding.get_outputs()
        if len(values) != 2 * self.layers + len(want):
            raise RuntimeError(f"unexpected bound outputs: {len(values)}")
        out = {name: values[2 * self.layers + k].numpy() for k, name in enumerate(want)}
        return out if layout is None else layout.outputs(out, self.seq_outputs)

    @staticmethod
    def _stage(io, staged: dict, name: str, value, dtype) -> None:
        """Bind an input through a host buffer kept per binding: the value is copied into it, and the buffer is bound
        again only when its shape changes (a steady state of same-shaped steps binds nothing)."""
        value = np.asarray(value)
        kept = staged.get(name)
        if kept is not None and kept[0].shape == value.shape:
            np.copyto(kept[0], value, casting="unsafe")  # the bound OrtValue shares this memory
            return
        buffer = np.array(value, dtype=dtype, order="C")
        staged[name] = (buffer, ort.OrtValue.ortvalue_from_numpy(buffer))
        io.bind_ortvalue_input(name, staged[name][1])

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A plain call: every output, by name."""
        return dict(zip(self.outputs, self.session.run(self.outputs, feeds)))

    def _binding(self, cache: KVCache, want: tuple[str, ...]) -> tuple:
        """An IO binding per cache and set of wanted outputs, made once, with its staged inputs (`_stage`): each cache
        buffer bound as both past and present (in place). The wanted outputs come after them, in order."""
        if cache.handle is None:  # wrap the numpy buffers once; the OrtValues share their memory
            cache.handle = {"values": [ort.OrtValue.ortvalue_from_numpy(buf) for buf in cache.buffers]}
        bound = cache.handle.get(want)
        if bound is None:
            io = self.session.io_binding()
            for layer in range(self.layers):
                for j, kind in enumerate(("key", "value")):
                    value = cache.handle["values"][2 * layer + j]
                    io.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", value)
                    io.bind_ortvalue_output(f"present.{layer}.{kind}", value)
            bound = cache.handle[want] = (io, {})
        return bound


def on_cpu(session: ort.InferenceSession) -> bool:
    """Whether the session runs on ONNX Runtime's CPU kernels, whose float order the step layouts are made for."""
    return session.get_providers()[0] == "CPUExecutionProvider"


def load_session(graph_path: Path, threads: int | None, device: str, spin: bool, graph_info: dict | None = None
                 ) -> ort.InferenceSession:
    options = session_options(threads, spin=spin, graph_info=graph_info)
    try:
        return ort.InferenceSession(str(graph_path), options, providers=providers(device))
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
        raise UserError(f"cannot load graph {graph_path.name}: {str(e).splitlines()[0]}") from None


def ragged_inputs(b: int, t: int, live: np.ndarray | None = None, real: np.ndarray | None = None
                  ) -> dict[str, np.ndarray]:
    """A ragged-rows graph's `live_rows` [R] (each real row as b * T + t) and `padded_rows` [B, T] (the real row each
    position of the padded layout takes: its own, or for padding the first real row) for a step of B x T rows whose
    batch row b holds live[b] real rows first (None: all T), or whose real rows are `real` [B, T] (a layout's)."""
    if live is None and real is None:
        every = np.arange(b * t)
        return {"live_rows": every, "padded_rows": every.reshape(b, t)}
    if real is None:
        real = np.arange(t) < check_live(b, t, live)[:, None]
    real = real.reshape(-1)  # [B * T]
    padded = np.zeros(b * t, np.int64)
    padded[real] = np.arange(int(real.sum()))
    return {"live_rows": np.flatnonzero(real), "padded_rows": padded.reshape(b, t)}


def laid_out(session, cache, input_ids, position_ids, tree_mask, logits_indices, live, inputs, past):
    """The step's layout on `session`'s graph (runtime/backends/layout.py), or None: a ragged graph's step on the CPU
    with no per-row inputs of its own (an EAGLE draft's features) is laid out, branching trees in lanes where the
    graph takes them (`tree_lanes`) and the cache can place rows; the cache learns where each batch row's rows went. (A
    fused acceptance exported before `tree_lanes` reads the tree from the step's last rows: only its one-row steps,
    whose tree is that row, are padded.)"""
    t = input_ids.shape[1]
    layout = None
    if session.lays_out and not inputs and (session.lanes or not session.fused_inputs or t == 1):
        layout = lay_out(input_ids, position_ids, tree_mask, logits_indices, live,
                         session.lanes and cache.places_rows, cache.capacity - int(past.max()) - t)
    if cache.places_rows:
        for k in range(len(input_ids)):
            cache.place(k, None if layout is None else layout.moved[k])
    return layout


def check_step(cache, t: int, tree_mask: np.ndarray, past: np.ndarray | None = None) -> None:
    """A step must fit the cache and its mask must be [.., T, K >= T] with K - T rows already written (`past`: each
    batch row's length, when they differ)."""
    rows, cols = tree_mask.shape[-2:]
    shortest, longest = (cache.length,) * 2 if past is None else (int(past.min()), int(past.max()))
    if rows != t or not t <= cols <= shortest + t:
        raise ValueError(f"tree mask {list(tree_mask.shape)} does not fit a step of {t} tokens after {shortest}")
    if longest + t > cache.capacity:
        raise ValueError(f"KV cache overflow: {longest} + {t} > capacity {cache.capacity}")
