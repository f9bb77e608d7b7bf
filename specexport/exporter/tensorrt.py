"""TensorRT engines for a bundle's step graphs (`specexport build --backend tensorrt`).

Each step graph of the trt flavour (the target's, a draft's) is parsed with TensorRT's ONNX parser into a strongly
typed network (the precision is the graph's dtypes), given optimization profiles for the tokens of one step (1 up
to the hardware profile's max_tree_tokens) and for prefill chunks (up to the runtime's chunk, within the context),
and built into a serialized plan with a workspace limit, a timing cache shared by the graphs (seeded from and saved
back to --timing-cache, and kept in the bundle), and optional hardware/version compatibility. The plan files lie in
the bundle under its checksums; each graph's manifest entry gains an `engine` section (file, sha256, the TensorRT
version, the GPU and its compute capability, the profiles) that the runtime checks before deserializing
(runtime/tensorrt.py).

Written to the documented TensorRT >= 10.15 Python API; imported lazily (nothing here loads TensorRT until an
engine is built).
"""

from __future__ import annotations

import hashlib
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from specexport.errors import UserError
from specexport.runtime import tensorrt as trt_runtime
from specexport.runtime.generate import PREFILL_CHUNK

TIMING_CACHE = "tensorrt.timing.cache"
TOKEN_DIMS = ("seq", "rows", "mask_cols")  # symbolic dims that count a step's tokens (exporter/graph.py step_io)
PRECISIONS = ("fp16", "bf16", "int4")  # TensorRT 11 is strongly typed: an fp32 graph would build an fp32 engine


@dataclass(frozen=True)
class EngineOptions:
    max_tree_tokens: int  # the most tokens one step verifies (the tokens-per-step profile's max)
    workspace_gb: float = 4.0  # TensorRT's workspace memory pool limit
    timing_cache: str | None = None  # a timing cache file read before the build and updated after it
    hardware_compatible: bool = False  # any Ampere or newer GPU (no cuDNN/cuBLAS tactics: may be slower)
    version_compatible: bool = False  # later TensorRT releases of the same major version may run the plan


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise UserError(f"--backend tensorrt takes --precision {', '.join(PRECISIONS)}, not {precision}: TensorRT "
                        "is strongly typed, so an fp32 graph would build an fp32 engine (run fp32 on onnxruntime)")


def check_build(graph, options: EngineOptions) -> None:
    """Before any work: a precision TensorRT builds, the trt flavour, a timing cache that can be written, and
    TensorRT with a GPU here (one line each)."""
    check_precision(graph.precision)
    if graph.flavour != "trt":
        raise UserError(f"--backend tensorrt builds the trt flavour of the graphs, not --flavour {graph.flavour}")
    if options.timing_cache:
        folder = Path(options.timing_cache).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise UserError(f"cannot write the timing cache {options.timing_cache}: {folder} is not a writable folder")
    trt_runtime.require()


def token_profiles(max_tree_tokens: int, s_max: int, chunk: int = PREFILL_CHUNK) -> list[tuple[int, int, int]]:
    """(min, opt, max) tokens per call for each optimization profile: steps (1..max_tree_tokens, tuned for the full
    tree), then prefill chunks (1..chunk, tuned for a full chunk) when a chunk is longer; both within S_max."""
    if max_tree_tokens < 1:
        raise UserError(f"max_tree_tokens must be >= 1, got {max_tree_tokens}")
    step = min(max_tree_tokens, s_max)
    prefill = min(chunk, s_max)
    return [(1, step, step)] + ([(1, prefill, prefill)] if prefill > step else [])


def input_shapes(inputs: list[dict], tokens: tuple[int, int, int]) -> dict[str, tuple[tuple, tuple, tuple]]:
    """(min, opt, max) shape of each graph input (its manifest entry) for one profile: batch 1, the token dims
    (`TOKEN_DIMS`) over `tokens`, numbers as they are. Any other named dim has no bound: one line."""
    shapes = {}
    for value in inputs:
        picked = []
        for dim in value["shape"]:
            if isinstance(dim, int) and dim > 0:
                picked.append((dim,) * 3)
            elif dim == "batch":
                picked.append((1, 1, 1))
            elif dim in TOKEN_DIMS:
                picked.append(tokens)
            else:
                raise UserError(f"graph input {value['name']} has a dimension '{dim}' with no TensorRT profile "
                                f"bound (known: batch, {', '.join(TOKEN_DIMS)})")
        shapes[value["name"]] = tuple(tuple(d[k] for d in picked) for k in range(3))
    return shapes


def step_graphs(graphs: dict) -> list[str]:
    """The graphs that run steps against a KV cache (they get engines; others stay ONNX)."""
    return [name for name, info in graphs.items()
            if any(i["name"].startswith("past_key_values.") for i in info.get("inputs", []))]


def build_engines(folder: Path, graphs: dict, options: EngineOptions, quiet: bool = False) -> dict:
    """Build a plan per step graph in the staged bundle `folder` (adding `engine` to their entries in `graphs`) and
    save the timing cache; returns the manifest's `tensorrt` section."""
    platform = trt_runtime.require()
    trt = platform.trt
    logger = trt.Logger(trt.Logger.WARNING if not quiet else trt.Logger.ERROR)
    builder = trt.Builder(logger)
    seed = _read_timing_cache(options.timing_cache)
    cache = None
    for name in step_graphs(graphs):
        info = graphs[name]
        if not quiet:
            print(f"      TensorRT {platform.version}: building {info['file']} on {platform.gpu}", file=sys.stderr)
        config = builder.create_builder_config()
        if cache is None:  # one timing cache for every graph of the build
            cache = config.create_timing_cache(seed)
        profiles = token_profiles(options.max_tree_tokens, info["kv_capacity"])
        plan = _build(trt, builder, logger, config, cache, folder / info["file"], info, profiles, options)
        plan_file = f"{name}.plan"
        (folder / plan_file).write_bytes(plan)
        info["engine"] = {
            "file": plan_file,
            "sha256": hashlib.sha256(plan).hexdigest(),
            "tensorrt": platform.version,
            "gpu": platform.gpu,
            "compute_capability": platform.compute_capability,
            "hardware_compatible": options.hardware_compatible,
            "version_compatible": options.version_compatible,
            "profiles": [list(p) for p in profiles],
        }
    if cache is None:
        raise UserError("this bundle has no step graph to build a TensorRT engine for")
    serialized = bytes(cache.serialize())
    (folder / TIMING_CACHE).write_bytes(serialized)
    if options.timing_cache:  # whole or not at all
        temp = Path(options.timing_cache).with_name(Path(options.timing_cache).name + ".tmp")
        temp.write_bytes(serialized)
        os.replace(temp, options.timing_cache)
    return {"version": platform.version, "gpu": platform.gpu, "compute_capability": platform.compute_capability,
            "timing_cache": TIMING_CACHE, **asdict(options)}


def _build(trt, builder, logger, config, cache, onnx_path: Path, info: dict, profiles, options) -> bytes:
    """One serialized plan: parse, configure, build."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)  # TensorRT 11: always strongly typed
    network = builder.create_network(0 if flag is None else 1 << int(flag))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise UserError(parse_error(onnx_path.name, [parser.get_error(i) for i in range(parser.num_errors)]))
    shape_inputs = [network.get_input(i).name for i in range(network.num_inputs) if network.get_input(i).is_shape_tensor]
    if shape_inputs:
        raise UserError(f"TensorRT takes {', '.join(shape_inputs)} of {onnx_path.name} as shape tensors; the runtime "
                        "feeds data only (re-export the graph with this specexport)")
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gb * (1 << 30)))
    config.set_timing_cache(cache, ignore_mismatch=False)
    if options.hardware_compatible:
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    if options.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    for tokens in profiles:
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in input_shapes(info["inputs"], tokens).items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise UserError(f"TensorRT could not build an engine for {onnx_path.name} (its log above says why)")
    return bytes(plan)


def parse_error(file: str, errors: list) -> str:
    """TensorRT's ONNX parser errors in one line, naming the first failing node (TensorRT's IParserError)."""
    if not errors:
        return f"TensorRT's ONNX parser rejected {file} (no error reported)"
    first = errors[0]
    where = ""
    if first.node() >= 0:
        where = f" at node {first.node_name() or first.node()} ({first.node_operator()})"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    desc = " ".join(str(first.desc()).split())
    return f"TensorRT cannot parse {file}{where}: {desc}{more}"


def _read_timing_cache(path: str | None) -> bytes:
    if not path or not Path(path).is_file():
        return b""
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise UserError(f"cannot read timing cache {path}: {e.strerror or e}") from None
