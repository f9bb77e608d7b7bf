"""TensorRT backend: a step graph's serialized engine (built by exporter/tensorrt/build.py) run with TensorRT's Python API,
the KV cache and every step buffer in device memory allocated with NVIDIA's cuda-python.

Written to the documented APIs of TensorRT >= 10.15 (`tensorrt`) and cuda-python (`cuda.bindings.runtime`, or
`cuda.cudart` from older releases), and not yet run on a GPU; both are imported lazily, so a CPU install never loads
them. Before a plan is deserialized its checksum, TensorRT version and GPU compute capability are checked against
the manifest; a plan for another TensorRT or GPU is one line, not a crash inside TensorRT.

A step: the inputs go to fixed device buffers (one host-to-device copy each), `set_input_shape` per input, one
`execute_async_v3` on the backend's stream (one execution context per optimization profile: tokens-per-step, and
prefill chunks), and only the outputs the step wants come back to the host. The cache's K and V of every layer lie
in one allocation; each layer's `past_key_values.*` input and its `present.*` output (TensorScatter's in-place write,
TensorRT's KVCacheUpdate layer) are bound to the same address. Commit moves an accepted row with one
`cudaMemcpy2DAsync` across every layer, kind and head (the pitch is one head's S_max rows).

Acceptance: the graph's greedy acceptance (`accept_rows` of a data-dependent length, `bonus_token`), or, in an engine
built with `--sampling-accept plugin` (its manifest entry's `sampling_accept`), the tree acceptance plugin for greedy
and sampled steps alike: every call then feeds the plugin's inputs (`plugin_feeds`: the uniforms and draft
distributions of `verify.fused_inputs`, the tree's parents read from the tree mask), and `accept_rows`, padded with
-1, comes back cut to `accept_len` (`trim_accepted`), as the graph's own output would.

CUDA graphs (SPECEXPORT_CUDA_GRAPHS=1): each step shape (tokens per step, mask columns, wanted rows) is run once
eagerly, then captured and replayed with `cudaGraphLaunch`. Off for engines with data-dependent output shapes (the
graph's greedy `accept_rows`): their output allocator cannot be captured. The plugin's outputs have fixed shapes.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specexport.errors import UserError
from specexport.runtime.backends.device_cache import Cuda, DeviceCache, load_cudart
from specexport.runtime.verify import greedy_inputs

MIN_VERSION = (10, 15)  # RMSNormalization, RotaryEmbedding and TensorScatter (KVCacheUpdate) in the ONNX parser
WHAT = "the tensorrt backend"


def version_tuple(text: str) -> tuple[int, ...]:
    """'10.15.1.29' -> (10, 15, 1, 29); non-numeric parts end it."""
    out = []
    for part in str(text).split("."):
        if not part.isdigit():
            break
        out.append(int(part))
    return tuple(out)


@dataclass(frozen=True)
class Platform:
    """What TensorRT runs on here: the imported modules, and the versions a plan is checked against."""

    trt: object
    cuda: object  # cuda-python's runtime module (cudart)
    version: str  # tensorrt.__version__
    gpu: str  # the current device's name
    compute_capability: str  # "9.0"


def require(what: str = WHAT) -> Platform:
    """TensorRT >= 10.15, cuda-python and an NVIDIA GPU, or one line naming each part that is missing."""
    missing, trt, version = [], None, ""
    try:
        import tensorrt as trt

        version = trt.__version__
        if version_tuple(version)[:2] < MIN_VERSION:
            missing.append(f"TensorRT >= 10.15 (found {version}: pip install -U tensorrt)")
    except ImportError:
        missing.append("TensorRT >= 10.15 (pip install tensorrt)")
    cudart = load_cudart()
    gpu = None
    if cudart is None:
        missing.append("cuda-python (pip install cuda-python)")
        if shutil.which("nvidia-smi") is None:
            missing.append("an NVIDIA GPU (no driver found: nvidia-smi is missing)")
    else:
        gpu = _current_gpu(cudart)
        if isinstance(gpu, str):
            missing.append(f"an NVIDIA GPU (none found: {gpu})")
    if missing:
        listed = ", ".join(missing[:-1]) + (" and " if len(missing) > 1 else "") + missing[-1]
        raise UserError(f"{what} needs {listed}")
    return Platform(trt, cudart, version, *gpu)


def _current_gpu(cudart) -> tuple[str, str] | str:
    """(name, compute capability) of the current CUDA device, or why there is none."""
    err, count = cudart.cudaGetDeviceCount()
    if err != cudart.cudaError_t.cudaSuccess or count < 1:
        return "CUDA reports no device" if err == cudart.cudaError_t.cudaSuccess else f"CUDA error {err.name}"
    err, device = cudart.cudaGetDevice()
    err, prop = cudart.cudaGetDeviceProperties(device)
    if err != cudart.cudaError_t.cudaSuccess:
        return f"CUDA error {err.name}"
    name = prop.name.decode(errors="replace").rstrip("\x00") if isinstance(prop.name, bytes) else str(prop.name)
    return name, f"{prop.major}.{prop.minor}"


def plan_mismatch(engine: dict, version: str, compute_capability: str) -> str | None:
    """Why a plan recorded in the manifest (`engine`: its graph's engine entry) cannot run with this TensorRT and GPU,
    or None. A plan runs on the TensorRT that built it (a version-compatible one: that or a later release of the same
    major version) and on GPUs of its compute capability (a hardware-compatible one: any Ampere or newer)."""
    built, cc = engine["tensorrt"], engine["compute_capability"]
    if engine.get("version_compatible"):
        ok = version_tuple(version)[0] == version_tuple(built)[0] and version_tuple(version) >= version_tuple(built)
    else:
        ok = version_tuple(version) == version_tuple(built)
    if not ok:
        return (f"its plan was built with TensorRT {built} and this is TensorRT {version}: rebuild it here "
                "(specexport build --backend tensorrt)")
    if engine.get("hardware_compatible"):
        ok = version_tuple(compute_capability) >= (8, 0)
    else:
        ok = version_tuple(compute_capability) == version_tuple(cc)
    if not ok:
        return (f"its plan was built for compute capability {cc} ({engine.get('gpu', 'another GPU')}) and this GPU "
                f"has {compute_capability}: rebuild it here (specexport build --backend tensorrt)")
    return None


def pick_profile(profiles: list, t: int) -> int:
    """The optimization profile for a step of `t` tokens: the one with the smallest max that holds it (the
    tokens-per-step profile before the prefill one). One line when the engine has none."""
    fitting = [(hi, k) for k, (lo, _, hi) in enumerate(profiles) if lo <= t <= hi]
    if not fitting:
        top = max(hi for _, _, hi in profiles)
        raise UserError(f"a step of {t} tokens is more than this TensorRT engine's optimization profiles allow (at "
                        f"most {top}): use a smaller tree, or rebuild with a larger max_tree_tokens")
    return min(fitting)[1]


def read_plan(path: Path, engine: dict) -> bytes:
    """The plan's bytes, checked against the manifest's size and sha256 (a truncated or edited plan is one line)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read TensorRT plan {path.name}: {e.strerror or e}") from None
    if hashlib.sha256(data).hexdigest() != engine["sha256"]:
        raise UserError(f"TensorRT plan {path.name} does not match its checksum ({len(data)} bytes): the file is "
                        "truncated or changed since the build; rebuild the bundle")
    return data


def sampling_in_engine(engine: dict) -> bool:
    """Whether a plan (its manifest entry) accepts sampled steps itself (exporter/tensorrt/build.py, --sampling-accept)."""
    return engine.get("sampling_accept") == "plugin"


def tree_parents(mask: np.ndarray) -> np.ndarray:
    """Each row's parent in an ancestor mask [T, T] (row i sees itself and its ancestors, which come before it): the
    last earlier row it sees, or -1 (the root). int32, as the acceptance plugin takes it."""
    seen = np.tril(np.asarray(mask, bool), -1)
    last = seen.shape[1] - 1 - np.argmax(seen[:, ::-1], axis=1)
    return np.where(seen.any(axis=1), last, -1).astype(np.int32)


def plugin_feeds(accept: dict[str, np.ndarray], tree_mask: np.ndarray, rows: int, vocab: int) -> dict[str, np.ndarray]:
    """The acceptance plugin's inputs (exporter/tensorrt/plugin.py) for a call whose logits are its last `rows` rows:
    the fused acceptance's inputs (`verify.fused_inputs`, `greedy_inputs`) with a batch axis, no draft rows as
    [1, 0, vocab], and the tree's parents from the last rows and columns of the call's tree mask [T, K]."""
    q = accept["sample_q"]
    return {"accept_parents": tree_parents(tree_mask[-rows:, -rows:])[None],
            "sample_q": (q if q.size else np.zeros((0, vocab), np.float32))[None],
            "sample_u": accept["sample_u"][None], "sample_params": accept["sample_params"][None]}


def trim_accepted(rows: np.ndarray, length: np.ndarray) -> np.ndarray:
    """The plugin's accepted rows [1, T] (root first, then -1) cut to its accept length [1]: [k], as the graph's
    greedy acceptance returns them."""
    n = int(np.asarray(length).reshape(-1)[0])
    if not 1 <= n <= rows.shape[-1] or rows[0, 0] != 0 or (rows[0, :n] < 0).any():
        raise RuntimeError(f"the acceptance plugin returned {n} rows of {rows.tolist()}")
    return rows[0, :n]


def _output_allocator(trt, cuda: Cuda):
    """A TensorRT output allocator for outputs whose shape depends on the data (NonZero's accepted rows): it keeps
    one device buffer per output, grown when a step needs more, and the shape TensorRT reports."""

    class Allocator(trt.IOutputAllocator):
        def __init__(self):
            trt.IOutputAllocator.__init__(self)
            self.buffers, self.sizes, self.shapes = {}, {}, {}

        def reallocate_output(self, tensor_name, memory, size, alignment):
            if self.sizes.get(tensor_name, -1) < size:
                if tensor_name in self.buffers:
                    cuda.free(self.buffers[tensor_name])
                self.buffers[tensor_name], self.sizes[tensor_name] = cuda.malloc(size), size
            return self.buffers[tensor_name]

        def reallocate_output_async(self, tensor_name, memory, size, alignment, stream):
            return self.reallocate_output(tensor_name, memory, size, alignment)

        def notify_shape(self, tensor_name, shape):
            self.shapes[tensor_name] = tuple(shape)

    return Allocator()


def _to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bits (uint16), rounded to nearest even."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


class TensorRTSession:
    """One graph's TensorRT engine: the runtime's Backend protocol (runtime/backends/host.py) on an NVIDIA GPU."""

    def __init__(self, graph_path: Path, graph_info: dict, threads: int | None = None, device: str = "auto",
                 spin: bool = True):
        self.info = graph_info
        engine_info = graph_info["engine"]
        plan_path = Path(graph_path).parent / engine_info["file"]
        platform = require(f"this bundle's TensorRT engine ({plan_path.name})")
        why = plan_mismatch(engine_info, platform.version, platform.compute_capability)
        if why:
            raise UserError(f"cannot run {plan_path.name} on this {platform.gpu}: {why}")
        data = read_plan(plan_path, engine_info)
        trt = platform.trt
        self.trt, self.cuda = trt, Cuda(platform.cuda)
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.runtime = trt.Runtime(self.logger)
        if engine_info.get("version_compatible"):
            self.runtime.engine_host_code_allowed = True
        self.engine = self.runtime.deserialize_cuda_engine(data)
        if self.engine is None:
            raise UserError(f"TensorRT could not deserialize {plan_path.name} (corrupt plan, or one TensorRT cannot "
                            "load here): rebuild the bundle")
        e = self.engine
        names = [e.get_tensor_name(i) for i in range(e.num_io_tensors)]
        self.inputs = [n for n in names if e.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if e.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        shape_inputs = [n for n in self.inputs if e.is_shape_inference_io(n)]
        if shape_inputs:
            raise UserError(f"{plan_path.name}: inputs {shape_inputs} are shape tensors in this engine; the runtime "
                            "feeds data inputs only (rebuild with this specexport)")
        self.fused_inputs = sampling_in_engine(engine_info)  # the acceptance plugin: sampled steps accept inside
        if self.fused_inputs != ("accept_parents" in self.inputs):
            raise UserError(f"{plan_path.name} does not match its manifest entry (sampling_accept): rebuild the bundle")
        self.vocab = int(e.get_tensor_shape("logits")[-1]) if self.fused_inputs else 0  # the plugin's sample_q width
        self.layers = graph_info["layers"]
        self.cache_names = [(f"past_key_values.{i}.{kind}", f"present.{i}.{kind}")
                            for i in range(self.layers) for kind in ("key", "value")]
        self.s_max = int(e.get_tensor_shape(self.cache_names[0][0])[2])
        self.dtypes = {n: e.get_tensor_dtype(n) for n in names}
        self.bf16 = {n for n, t in self.dtypes.items() if t == trt.DataType.BF16}
        self.itemsize = np.dtype(np.uint16 if self.cache_names[0][0] in self.bf16 else
                                 trt.nptype(self.dtypes[self.cache_names[0][0]])).itemsize
        self.profiles = [tuple(p) for p in engine_info["profiles"]]
        self.stream = self.cuda(platform.cuda.cudaStreamCreate())
        self.handle = int(self.stream)  # what TensorRT takes as the stream
        self.contexts = []
        for k in range(e.num_optimization_profiles):
            ctx = e.create_execution_context()
            ctx.set_optimization_profile_async(k, self.handle)
            self.contexts.append(ctx)
        self.allocator = _output_allocator(trt, self.cuda)
        self.buffers = self._allocate()
        data_dependent = [n for n in self.outputs if n not in self.buffers and not n.startswith("present.")]
        self.use_graphs = os.environ.get("SPECEXPORT_CUDA_GRAPHS") == "1" and not data_dependent
        self.graphs = {}  # step shapes + cache address -> an instantiated CUDA graph
        self.bound = [None] * len(self.contexts)  # the cache each context's tensor addresses point into
        self.calls, self.seconds = 0, 0.0

    def _allocate(self) -> dict[str, int]:
        """A device buffer per input and output (the caches aside) at its largest shape over the profiles; outputs
        whose shape depends on the data get the output allocator instead."""
        e, buffers, cache = self.engine, {}, {n for pair in self.cache_names for n in pair}
        largest = {}
        for k, ctx in enumerate(self.contexts):
            for name in self.inputs:
                top = tuple(e.get_tensor_profile_shape(name, k)[2])
                ctx.set_input_shape(name, top)
                if name not in cache:
                    largest[name] = max(largest.get(name, 0), int(np.prod(top)))
            for name in self.outputs:
                shape = tuple(ctx.get_tensor_shape(name))
                if name in cache:
                    continue
                if any(d < 0 for d in shape):
                    ctx.set_output_allocator(name, self.allocator)
                    continue
                largest[name] = max(largest.get(name, 0), int(np.prod(shape)))
        for name, volume in largest.items():
            buffers[name] = self.cuda.malloc(volume * self._itemsize(name))
            for ctx in self.contexts:
                ctx.set_tensor_address(name, buffers[name])
        return buffers

    def _itemsize(self, name: str) -> int:
        return 2 if name in self.bf16 else np.dtype(self._host_type(name)).itemsize

    def _host_type(self, name: str):
        return np.uint16 if name in self.bf16 else self.trt.nptype(self.dtypes[name])

    def new_cache(self, capacity: int, batch: int = 1) -> DeviceCache:
        """A device cache of the engine's S_max rows (its static length: steps near the end are cut to the room)."""
        return DeviceCache(self.cuda, self.stream, self.layers, batch, self.info["kv_heads"], self.s_max,
                           self.info["head_dim"], self.itemsize)

    def forward(self, cache: DeviceCache, input_ids: np.ndarray, position_ids: np.ndarray, tree_mask: np.ndarray,
                logits_indices: np.ndarray, want: tuple[str, ...] = ("logits",),
                inputs: dict[str, np.ndarray] | None = None, accept: dict[str, np.ndarray] | None = None,
                live: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """One step (the Backend protocol): feeds in, `execute_async_v3` (or its CUDA graph), `want` out (batch 1: a
        step's rows are all real, `live` changes nothing)."""
        b, t = input_ids.shape
        if b != 1:
            raise ValueError(f"the TensorRT engines run batch 1, not {b}")
        if cache.length + t > self.s_max:
            raise UserError(f"the context reaches {cache.length + t} tokens, past this TensorRT engine's S_max of "
                            f"{self.s_max}: rebuild with a longer --max-context")
        k = pick_profile(self.profiles, t)
        ctx = self.contexts[k]
        mask = tree_mask.reshape((-1,) + tree_mask.shape[-2:])
        feeds = {"input_ids": input_ids, "position_ids": position_ids,
                 "tree_mask": np.broadcast_to(mask, (b,) + mask.shape[1:]),
                 "past_len": np.full(b, cache.length), "logits_indices": logits_indices, **(inputs or {})}
        if self.fused_inputs:
            rows = len(logits_indices)
            feeds.update(plugin_feeds(accept or greedy_inputs(rows), mask[0], rows, self.vocab))
        fetch = want + (("accept_len",) if self.fused_inputs and "accept_rows" in want else ())
        self._bind_cache(k, cache)
        rt, cuda = self.cuda.rt, self.cuda
        start = time.perf_counter()
        for name, value in feeds.items():
            value = _to_bf16(value) if name in self.bf16 else np.ascontiguousarray(value, self._host_type(name))
            ctx.set_input_shape(name, value.shape)
            cuda(rt.cudaMemcpyAsync(self.buffers[name], value.ctypes.data, value.nbytes, cuda.h2d, self.stream))
        self._launch(ctx, k, cache, tuple((n, np.shape(v)) for n, v in feeds.items()))
        out = {}
        for name in fetch:
            shape = self.allocator.shapes[name] if name not in self.buffers else tuple(ctx.get_tensor_shape(name))
            host = np.empty(shape, self._host_type(name))
            device = self.buffers.get(name) or self.allocator.buffers[name]
            cuda(rt.cudaMemcpyAsync(host.ctypes.data, device, host.nbytes, cuda.d2h, self.stream))
            out[name] = host
        cuda(rt.cudaStreamSynchronize(self.stream))
        self.calls, self.seconds = self.calls + 1, self.seconds + time.perf_counter() - start
        if "accept_len" in fetch:
            out["accept_rows"] = trim_accepted(out["accept_rows"], out["accept_len"])
        return {n: _from_bf16(v) if n in self.bf16 else v for n, v in out.items() if n in want}

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        raise UserError("a TensorRT engine runs steps against its KV cache only (forward), not plain calls")

    def _bind_cache(self, k: int, cache: DeviceCache) -> None:
        """Point context k's past and present tensors of every layer at `cache` (the same address for both)."""
        if self.bound[k] == cache.base:
            return
        for (past, present), address in zip(self.cache_names, cache.addresses):
            self.contexts[k].set_tensor_address(past, address)
            self.contexts[k].set_tensor_address(present, address)
        self.bound[k] = cache.base

    def _launch(self, ctx, k: int, cache: DeviceCache, shapes: tuple) -> None:
        """Run the step: eagerly, or through the CUDA graph of its shapes (captured after one eager run)."""
        rt, cuda = self.cuda.rt, self.cuda
        key = (k, cache.base, shapes)
        graph = self.graphs.get(key) if self.use_graphs else None
        if graph is not None:
            cuda(rt.cudaGraphLaunch(graph, self.stream))
            return
        if not ctx.execute_async_v3(self.handle):
            raise RuntimeError("TensorRT execute_async_v3 failed (see the TensorRT log above)")
        if self.use_graphs:  # capture after the eager run: initialization stays out of the graph
            cuda(rt.cudaStreamBeginCapture(self.stream, rt.cudaStreamCaptureMode.cudaStreamCaptureModeThreadLocal))
            captured = ctx.execute_async_v3(self.handle)
            err, recorded = rt.cudaStreamEndCapture(self.stream)
            if captured and err == cuda.ok:
                self.graphs[key] = cuda(rt.cudaGraphInstantiate(recorded, 0))
            else:  # the engine holds work CUDA graphs cannot capture: run eagerly from now on
                self.use_graphs = False
