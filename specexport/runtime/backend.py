"""ONNX Runtime backend: a step graph (the target's, a draft's) as one session with IO binding, the KV cache bound
in place; other graphs (Medusa's stand-alone heads) as a plain session."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specexport.errors import UserError
from specexport.runtime.kvcache import KVCache
from specexport.runtime.verify import greedy_inputs

_NUMPY_TYPES = {"fp32": np.float32, "fp16": np.float16}


def providers(device: str = "auto") -> list[str]:
    """CUDA when asked for or available (GPU package + GPU), else CPU."""
    available = ort.get_available_providers()
    if device == "cpu":
        return ["CPUExecutionProvider"]
    if device == "cuda" and "CUDAExecutionProvider" not in available:
        raise UserError("CUDA requested but this onnxruntime has no CUDAExecutionProvider (pip install onnxruntime-gpu)")
    if "CUDAExecutionProvider" in available and device in ("auto", "cuda"):
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


def session_options(threads: int | None = None, optimized_path: Path | None = None, spin: bool = True):
    """`spin`: the intra-op threads busy-wait for the next run (fastest for the session that runs most). A second
    session in the same loop (a draft) must not spin: its idle threads would steal the cores from the target's
    next call (measured on a 2-core CPU: EAGLE at 19 tokens/s with both spinning, 35 with the draft's off)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or len(os.sched_getaffinity(0))
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.add_session_config_entry("session.intra_op.allow_spinning", "1" if spin else "0")
    if optimized_path is not None:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        so.optimized_model_filepath = str(optimized_path)
        so.add_session_config_entry("session.optimized_model_external_initializers_file_name", optimized_path.name + ".data")
        so.add_session_config_entry("session.optimized_model_external_initializers_min_size_in_bytes", "1024")
    return so


class GraphSession:
    """One graph of a bundle. A step graph (the target, a draft) runs `forward(cache, ids, positions, bias, rows)`
    -> its wanted outputs, the KV cache bound in place; any graph runs `run(feeds)`."""

    def __init__(self, graph_path: Path, graph_info: dict, threads: int | None = None, device: str = "auto",
                 spin: bool = True):
        self.info = graph_info
        self.dtype = _NUMPY_TYPES.get(graph_info["kv_dtype"])
        if self.dtype is None:
            raise UserError(f"KV dtype {graph_info['kv_dtype']} cannot run with this runtime on CPU")
        self.full_width_bias = graph_info["bias_width"] == "capacity"
        try:
            self.session = ort.InferenceSession(str(graph_path), session_options(threads, spin=spin),
                                                providers=providers(device))
        except Exception as e:  # noqa: BLE001 - ORT raises its own exception types
            raise UserError(f"cannot load graph {graph_path.name}: {str(e).splitlines()[0]}") from None
        self.layers = graph_info.get("layers", 0)
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.fused_inputs = "sample_u" in {i.name for i in self.session.get_inputs()}  # exporter/fused.py
        self.calls, self.seconds = 0, 0.0  # forward calls so far and their time (for `specexport profile`)

    def new_cache(self, capacity: int, batch: int = 1) -> KVCache:
        """A cache of `capacity` rows, or of the graph's own fixed length (the trt flavour's S_max: the bundle's
        context; the steps near its end are cut to the room left)."""
        i = self.info
        capacity = i.get("kv_capacity") or capacity
        return KVCache(i["layers"], batch, i["kv_heads"], capacity, i["head_dim"], self.dtype)

    def bias_width(self, cache: KVCache, past: int, t: int) -> int:
        return cache.capacity if self.full_width_bias else past + t

    def forward(self, cache: KVCache, input_ids: np.ndarray, position_ids: np.ndarray, bias: np.ndarray,
                logits_indices: np.ndarray, want: tuple[str, ...] = ("logits",),
                inputs: dict[str, np.ndarray] | None = None, accept: dict[str, np.ndarray] | None = None
                ) -> dict[str, np.ndarray]:
        """One step over T new tokens; K/V land at rows [cache.length, cache.length + T). `inputs`: the
        graph's other inputs (an EAGLE draft's `hidden`). `accept`: the fused acceptance's inputs
        (`verify.fused_inputs`), greedy when not given."""
        b, t = input_ids.shape
        if cache.length + t > cache.capacity:
            raise ValueError(f"KV cache overflow: {cache.length} + {t} > capacity {cache.capacity}")
        io = self._binding(cache, want)
        io.bind_cpu_input("input_ids", np.ascontiguousarray(input_ids, dtype=np.int64))
        io.bind_cpu_input("position_ids", np.ascontiguousarray(position_ids, dtype=np.int64))
        io.bind_cpu_input("attention_bias", np.ascontiguousarray(bias, dtype=np.float32))
        io.bind_cpu_input("past_len", np.full(b, cache.length, dtype=np.int32))
        io.bind_cpu_input("logits_indices", np.ascontiguousarray(logits_indices, dtype=np.int64))
        for name, value in (inputs or {}).items():
            io.bind_cpu_input(name, np.ascontiguousarray(value, dtype=self.dtype))
        if self.fused_inputs:
            for name, value in (accept or greedy_inputs(len(logits_indices))).items():
                io.bind_cpu_input(name, np.ascontiguousarray(value, dtype=np.float32))
        for name in want:  # rebound each run: ORT allocates them with this run's shapes
            io.bind_output(name, "cpu")
        start = time.perf_counter()
        self.session.run_with_iobinding(io)
        self.calls, self.seconds = self.calls + 1, self.seconds + time.perf_counter() - start
        values = io.get_outputs()  # the cache's presents first, then `want` in binding order
        if len(values) != 2 * self.layers + len(want):
            raise RuntimeError(f"unexpected bound outputs: {len(values)}")
        return {name: values[2 * self.layers + k].numpy() for k, name in enumerate(want)}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """A plain call: every output, by name."""
        names = [o.name for o in self.session.get_outputs()]
        return dict(zip(names, self.session.run(names, feeds)))

    def _binding(self, cache: KVCache, want: tuple[str, ...]):
        """An IO binding per cache and set of wanted outputs, made once: each cache buffer bound as
        both past and present (in place). The wanted outputs come after them, in order."""
        if cache.handle is None:  # wrap the numpy buffers once; the OrtValues share their memory
            cache.handle = {"values": [ort.OrtValue.ortvalue_from_numpy(buf) for buf in cache.buffers]}
        io = cache.handle.get(want)
        if io is None:
            io = cache.handle[want] = self.session.io_binding()
            for layer in range(self.layers):
                for j, kind in enumerate(("key", "value")):
                    value = cache.handle["values"][2 * layer + j]
                    io.bind_ortvalue_input(f"past_key_values.{layer}.{kind}", value)
                    io.bind_ortvalue_output(f"present.{layer}.{kind}", value)
        return io

