"""TensorRT engines for a bundle's step graphs (`specexport build --backend tensorrt`).

Each step graph of the trt flavour (the target's, a draft's) is parsed with TensorRT's ONNX parser into a strongly
typed network (the precision is the graph's dtypes), given optimization profiles for the tokens of one step (1 up
to the hardware profile's max_tree_tokens) and for prefill chunks (up to the runtime's chunk, within the context),
and built into a serialized plan with a workspace limit, a timing cache shared by the graphs (seeded from and saved
back to --timing-cache, and kept in the bundle), and optional hardware/version compatibility. The plan files lie in
the bundle under its checksums; each graph's manifest entry gains an `engine` section (file, sha256, the TensorRT
version, the GPU and its compute capability, the profiles) that the runtime checks before deserializing
(runtime/backends/tensorrt.py).

Sampling acceptance (`--sampling-accept`): the trt flavour's target graph accepts greedily in the graph (ArgMax; a
top-p over the whole vocabulary would need TopK with k = vocab, which TensorRT caps below 3840), so by default
(`host`) the runtime accepts sampled steps from the logits (`runtime.verify.accept`). With `plugin` the target's
engine accepts every step itself, greedy and sampled, with the Triton tree acceptance kernel as a TensorRT plugin
(exporter/tensorrt/plugin.py) in place of the graph's greedy acceptance: its outputs `accept_rows` (padded with -1),
`accept_len` and `bonus_token` are the engine's, the graph's own `accept_rows` and `bonus_token` are unmarked (and
pruned with the nodes only they read), and what read the graph's accepted row (Medusa's heads) reads the plugin's.
The engine entry records `sampling_accept = "plugin"`; the runtime then feeds the uniforms and draft distributions
on every step and cuts `accept_rows` to `accept_len`. Host is the default: the plugin has never run on a GPU, needs
triton at build time, and ties the plan to the build GPU's architecture.

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
from specexport.exporter.fused import ACCEPTED_ROW
from specexport.runtime.backends import tensorrt as trt_runtime
from specexport.runtime.generate import PREFILL_CHUNK

TIMING_CACHE = "tensorrt.timing.cache"
TOKEN_DIMS = ("seq", "rows", "mask_cols")  # symbolic dims that count a step's tokens (exporter/graph.py step_io)
PRECISIONS = ("fp16", "bf16", "int4")  # TensorRT 11 is strongly typed: an fp32 graph would build an fp32 engine
SAMPLING_ACCEPT = ("host", "plugin")  # where sampled steps are accepted (see the module docstring)
GRAPH_ACCEPT = ("accept_rows", "bonus_token")  # the graph's greedy acceptance outputs, which the plugin replaces


@dataclass(frozen=True)
class EngineOptions:
    max_tree_tokens: int  # the most tokens one step verifies (the tokens-per-step profile's max)
    workspace_gb: float = 4.0  # TensorRT's workspace memory pool limit
    timing_cache: str | None = None  # a timing cache file read before the build and updated after it
    hardware_compatible: bool = False  # any Ampere or newer GPU (no cuDNN/cuBLAS tactics: may be slower)
    version_compatible: bool = False  # later TensorRT releases of the same major version may run the plan
    sampling_accept: str = "host"  # host: the runtime accepts sampled steps; plugin: the target's engine does


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise UserError(f"--backend tensorrt takes --precision {', '.join(PRECISIONS)}, not {precision}: TensorRT "
                        "is strongly typed, so an fp32 graph would build an fp32 engine (run fp32 on onnxruntime)")


def check_build(graph, options: EngineOptions) -> None:
    """Before any work: a precision TensorRT builds, the trt flavour, a timing cache that can be written, what the
    acceptance plugin needs, and TensorRT with a GPU here (one line each)."""
    check_precision(graph.precision)
    if graph.flavour != "trt":
        raise UserError(f"--backend tensorrt builds the trt flavour of the graphs, not --flavour {graph.flavour}")
    if options.timing_cache:
        folder = Path(options.timing_cache).resolve().parent
        if not folder.is_dir() or not os.access(folder, os.W_OK):
            raise UserError(f"cannot write the timing cache {options.timing_cache}: {folder} is not a writable folder")
    if options.sampling_accept == "plugin":
        check_plugin(graph, options)
    trt_runtime.require()


def check_plugin(graph, options: EngineOptions) -> None:
    """--sampling-accept plugin: the graph's fused acceptance to replace, a plan for this GPU's architecture only,
    triton to compile the kernel, and trees within the kernel's rows (one line each)."""
    if not graph.fused_accept:
        raise UserError("--sampling-accept plugin replaces the target graph's fused acceptance: not with "
                        "--no-fused-accept")
    if options.hardware_compatible:
        raise UserError("--sampling-accept plugin bakes PTX for this GPU's architecture into the plan: not with "
                        "--hardware-compatible (use --sampling-accept host)")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise UserError("--sampling-accept plugin compiles its kernel with triton at build time: pip install "
                        "'specexport[triton]'") from None
    from specexport.exporter.tensorrt.accept import MAX_ROWS

    if options.max_tree_tokens > MAX_ROWS:
        raise UserError(f"--sampling-accept plugin accepts trees of at most {MAX_ROWS} tokens and this build verifies "
                        f"up to {options.max_tree_tokens} per step: use a smaller tree or --sampling-accept host")


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


def plugin_shapes(tokens: tuple[int, int, int], step: int, vocab: int) -> dict[str, tuple[tuple, tuple, tuple]]:
    """(min, opt, max) shapes of the acceptance plugin's inputs for a profile of `tokens` rows: the plugin's own
    (trt_plugin.input_shapes), with the draft distributions' rows within a step's (`step`: the tokens-per-step
    profile's max). Sampled drafts come only with steps; prefill calls feed none, so a prefill profile needs no
    [512, vocab] buffer for them."""
    from specexport.exporter.tensorrt import plugin as trt_plugin

    shapes = trt_plugin.input_shapes(tokens, vocab)
    shapes["sample_q"] = tuple((1, min(rows, step), vocab) for _, rows, _ in shapes["sample_q"])
    return shapes


def engine_entry(plan_file: str, plan: bytes, platform, options: EngineOptions, profiles: list, plugin: bool) -> dict:
    """A step graph's `engine` section in the manifest; `plugin`: the plan accepts sampled steps itself."""
    entry = {
        "file": plan_file,
        "sha256": hashlib.sha256(plan).hexdigest(),
        "tensorrt": platform.version,
        "gpu": platform.gpu,
        "compute_capability": platform.compute_capability,
        "hardware_compatible": options.hardware_compatible,
        "version_compatible": options.version_compatible,
        "profiles": [list(p) for p in profiles],
    }
    if plugin:
        entry["sampling_accept"] = "plugin"  # runtime/backends/tensorrt.py sampling_in_engine
    return entry


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
    cache, plugins = None, 0
    for name in step_graphs(graphs):
        info = graphs[name]
        if not quiet:
            print(f"      TensorRT {platform.version}: building {info['file']} on {platform.gpu}", file=sys.stderr)
        config = builder.create_builder_config()
        if cache is None:  # one timing cache for every graph of the build
            cache = config.create_timing_cache(seed)
        profiles = token_profiles(options.max_tree_tokens, info["kv_capacity"])
        plan, plugged = _build(trt, builder, logger, config, cache, folder / info["file"], info, profiles, options)
        plan_file = f"{name}.plan"
        (folder / plan_file).write_bytes(plan)
        info["engine"] = engine_entry(plan_file, plan, platform, options, profiles, plugged)
        plugins += plugged
    if cache is None:
        raise UserError("this bundle has no step graph to build a TensorRT engine for")
    if options.sampling_accept == "plugin" and not plugins:
        raise UserError("--sampling-accept plugin: no step graph of this bundle has the fused acceptance to replace")
    serialized = bytes(cache.serialize())
    (folder / TIMING_CACHE).write_bytes(serialized)
    if options.timing_cache:  # whole or not at all
        temp = Path(options.timing_cache).with_name(Path(options.timing_cache).name + ".tmp")
        temp.write_bytes(serialized)
        os.replace(temp, options.timing_cache)
    return {"version": platform.version, "gpu": platform.gpu, "compute_capability": platform.compute_capability,
            "timing_cache": TIMING_CACHE, **asdict(options)}


def _build(trt, builder, logger, config, cache, onnx_path: Path, info: dict, profiles, options) -> tuple[bytes, bool]:
    """One serialized plan: parse, (add the acceptance plugin), configure, build. Returns the plan and whether it
    holds the plugin."""
    flag = getattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED", None)  # TensorRT 11: always strongly typed
    network = builder.create_network(0 if flag is None else 1 << int(flag))
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise UserError(parse_error(onnx_path.name, [parser.get_error(i) for i in range(parser.num_errors)]))
    shape_inputs = [network.get_input(i).name for i in range(network.num_inputs) if network.get_input(i).is_shape_tensor]
    if shape_inputs:
        raise UserError(f"TensorRT takes {', '.join(shape_inputs)} of {onnx_path.name} as shape tensors; the runtime "
                        "feeds data only (re-export the graph with this specexport)")
    outputs = {network.get_output(i).name for i in range(network.num_outputs)}
    plugged = options.sampling_accept == "plugin" and set(GRAPH_ACCEPT) <= outputs
    vocab = _add_plugin(trt, network) if plugged else 0
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(options.workspace_gb * (1 << 30)))
    config.set_timing_cache(cache, ignore_mismatch=False)
    if options.hardware_compatible:
        config.hardware_compatibility_level = trt.HardwareCompatibilityLevel.AMPERE_PLUS
    if options.version_compatible:
        config.set_flag(trt.BuilderFlag.VERSION_COMPATIBLE)
    for tokens in profiles:
        profile = builder.create_optimization_profile()
        shapes = input_shapes(info["inputs"], tokens)
        if plugged:
            shapes |= plugin_shapes(tokens, profiles[0][2], vocab)
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise UserError(f"TensorRT could not build an engine for {onnx_path.name} (its log above says why)")
    return bytes(plan), plugged


def _add_plugin(trt, network) -> int:
    """Replace the parsed graph's greedy acceptance with the tree acceptance plugin (see the module docstring);
    returns the vocabulary (the logits' last dim)."""
    from specexport.exporter.tensorrt import plugin as trt_plugin

    given = {network.get_output(i).name: network.get_output(i) for i in range(network.num_outputs)}
    for name in GRAPH_ACCEPT:  # out of the way of the plugin's outputs of the same names
        network.unmark_output(given[name])
        given[name].name = f"graph.{name}"
    rows, _, _ = trt_plugin.add_tree_accept(network, "logits")
    readers = [(layer, k) for layer in (network.get_layer(i) for i in range(network.num_layers))
               for k in range(layer.num_inputs) if layer.get_input(k) is not None
               and layer.get_input(k).name == ACCEPTED_ROW]
    if readers:
        row = _last_accepted_row(trt, network, rows, given["logits"], readers[0][0].get_input(readers[0][1]).dtype)
        for layer, k in readers:
            layer.set_input(k, row)
    return given["logits"].shape[-1]


def _last_accepted_row(trt, network, rows, logits, dtype):
    """The step row of the plugin's last accepted node, as the graph's ACCEPTED_ROW [1]: the tree is the step's last
    `logits` rows, so (tokens - tree rows) + the largest accepted row (a path's rows ascend; the padding is -1)."""
    def dim(tensor, axis: int):  # [1] int64
        return network.add_slice(network.add_shape(tensor).get_output(0), (axis,), (1,), (1,)).get_output(0)

    tokens = next(network.get_input(i) for i in range(network.num_inputs) if network.get_input(i).name == "input_ids")
    offset = network.add_elementwise(dim(tokens, 1), dim(logits, 0), trt.ElementWiseOperation.SUB).get_output(0)
    last = network.add_reduce(rows, trt.ReduceOperation.MAX, 1 << 1, False).get_output(0)  # [1] int32
    row = network.add_elementwise(network.add_cast(last, offset.dtype).get_output(0), offset,
                                  trt.ElementWiseOperation.SUM).get_output(0)
    return row if row.dtype == dtype else network.add_cast(row, dtype).get_output(0)


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
