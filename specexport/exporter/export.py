"""Model in, bundle out: resolve, load, build the target graph (with the method's additions) and the method's
graphs, optimize, validate against transformers, write the bundle."""

from __future__ import annotations

import importlib.metadata as md
import platform
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import onnxruntime as ort

from specexport.bundle import staged_bundle, write_manifest
from specexport.errors import UserError
from specexport.exporter import arch, budget, methods, sources, validate
from specexport.exporter.graph import GraphOptions
from specexport.exporter.methods.plan import Target
from specexport.exporter.save import Checkpoint, ExportContext, write_graph
from specexport.exporter.tensorrt import build as tensorrt
from specexport.options import with_given
from specexport.runtime.backends.host import session_options
from specexport.runtime.backends.layout import LANES


@dataclass
class ExportOptions:
    graph: GraphOptions = field(default_factory=GraphOptions)
    max_context: int | None = None  # default: the model's own limit
    optimize: bool = False  # save ORT's optimized graph (what `build` does for onnxruntime)
    validate: bool = True
    method: str = "none"
    settings: dict = field(default_factory=dict)  # the method's run-time settings given (its Settings fields)
    method_options: dict = field(default_factory=dict)  # its build-only options given (its Options fields)
    profile: dict | None = None  # the resolved hardware profile, saved in the manifest
    engines: tensorrt.EngineOptions | None = None  # build TensorRT engines for the step graphs (trt flavour)


class Steps:
    """Numbered progress lines on stderr, with the time each step took."""

    def __init__(self, total: int, quiet: bool = False):
        self.total, self.n, self.quiet, self.t0 = total, 0, quiet, None

    def __call__(self, text: str) -> None:
        self.done()
        self.n += 1
        self.t0 = time.perf_counter()
        if not self.quiet:
            print(f"[{self.n}/{self.total}] {text} ...", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self.t0 is not None and not self.quiet:
            print(f"      done in {time.perf_counter() - self.t0:.1f} s", file=sys.stderr, flush=True)
        self.t0 = None


def export_bundle(model_spec: str, output: Path, options: ExportOptions, overwrite: bool = False,
                  quiet: bool = False, loaded: tuple | None = None) -> dict:
    """Export `model_spec` into a bundle folder at `output`; returns the manifest. `loaded`: its (model, tokenizer)
    as sources.load_model gave them (a caller building several bundles of one model loads it once)."""
    method = methods.get(options.method)
    settings = method.runtime.settings({}, options.settings)
    method_options = with_given(method.Options(), options.method_options, f"--method {options.method}")
    if options.graph.flavour == "trt":  # ORT's optimizer would put com.microsoft ops into the standard graph
        options = replace(options, optimize=False)
    if options.profile is not None:  # a tree over the profile's token budget fails before any work
        limit, tokens = options.profile["limits"]["max_tree_tokens"], method.runtime.tokens_per_step(settings)
        if tokens > limit:
            raise UserError(f"the {options.method} tree has {tokens} tokens per step (root included), over the "
                            f"max_tree_tokens = {limit} of profile {options.profile['name']}")
    _check_runnable(options)
    if options.engines is not None:  # TensorRT and a GPU are here, or one line before any work
        tensorrt.check_build(options.graph, options.engines)
    source = sources.resolve(model_spec)
    config = sources.load_config(source)
    arch.spec_for(config.model_type)  # an unsupported architecture fails here, before any loading
    dims = arch.dims_from_config(config)
    max_context = bundle_context(options.max_context, dims, options.profile)
    options.graph.check(dims.within(max_context))  # (a window no wider than the context is no window)
    plan = method.plan(method_options, settings, Target(source.name, dims, source, config))  # bad heads, drafts or trees fail here
    weights = sources.stream_source(source, config) if loaded is None else None
    streamed = weights is not None
    need = budget.estimate(dims.within(max_context), options.graph, options.optimize, options.validate,
                           budget.whole_reference(streamed, dims))
    free = budget.check_disk(Path(output), need)  # refused here, before any work, when the disk cannot hold it
    # load, build, tokenizer (+ the method's graphs) (+ optimize) (+ validate)
    step = Steps(3 + plan.extra_graphs + options.optimize + options.validate + (options.engines is not None), quiet)
    with staged_bundle(Path(output), overwrite=overwrite) as tmp:
        if not quiet:
            print(f"{source.name}: {need.line(free)}", file=sys.stderr, flush=True)
        if streamed:
            step(f"loading {source.name} ({source.kind}: {source.path}; the weights a layer at a time)")
            model, tokenizer = None, sources.load_tokenizer(source)
            checkpoint = Checkpoint.of_source(weights, config)
        else:
            step(f"loading {source.name} ({source.kind}: {source.path})")
            model, tokenizer = loaded or sources.load_model(source)
            checkpoint = Checkpoint.of_model(model)
        step(f"building the {options.graph.precision} target graph ({options.graph.flavour} ops, {dims.layers} layers)")
        target_options = plan.graph_options(options.graph)
        graphs = {"target": write_graph(checkpoint, "target", target_options, max_context, tmp, quiet,
                                        plan.extensions())}
        if graphs["target"]["flavour"] == "ort" and not target_options.attention_rows:  # GQA: trees in lanes
            # (runtime/backends/layout.py); AttentionRows sums a row's keys in one order wherever they are
            graphs["target"]["tree_lanes"] = LANES
        ctx = ExportContext(source, dims, checkpoint, tokenizer, tmp, options.graph, max_context, quiet, step, model)
        graphs.update(plan.write_graphs(ctx))
        step("saving the tokenizer")
        generation = model.generation_config if model is not None else sources.load_generation_config(source, config)
        tokenizer_files = sources.save_tokenizer(tokenizer, tmp) + sources.save_generation_config(config, generation,
                                                                                                  tmp)
        if options.optimize:
            step("optimizing the graphs for onnxruntime")
            for info in graphs.values():
                optimize_graph(tmp, info)
        numerics = {}
        if options.validate:
            step("validating against transformers")
            precision = options.graph.precision
            numerics = validate.check_graph(ctx.reference, tokenizer, tmp, graphs["target"], precision,
                                            agreement=precision != "fp32", max_context=max_context)
            numerics.update(plan.validate(ctx, graphs))
        engines = None
        if options.engines is not None:
            step("building the TensorRT engines")
            engines = tensorrt.build_engines(tmp, graphs, options.engines, quiet)
        step.done()
        manifest = {
            "model": {"name": source.name, "source": str(source.path), "kind": source.kind, **dims.as_dict()},
            "method": {"name": options.method, **plan.manifest()},
            "precision": options.graph.precision,
            "flavour": options.graph.flavour,
            "max_context": max_context,
            "graphs": graphs,
            "tokenizer": {"files": sorted(tokenizer_files)},
            "runtime": _runtime_notes(options.graph),
            "numerics": numerics,
            "profile": options.profile,
            "tools": _tool_versions(),
        }
        if engines is not None:
            manifest["tensorrt"] = engines
        return write_manifest(tmp, manifest)


def _runtime_notes(graph: GraphOptions) -> dict:
    """What the runtime must know about how the graphs were quantized."""
    if graph.precision != "int8":
        return {"prefill_first_token_alone": False}
    # a call's activation scale: the first token's huge activations would set the whole chunk's (not per row)
    notes = {"prefill_first_token_alone": not (graph.int8_rows and graph.flavour == "ort")}
    if graph.flavour == "ort":
        notes["int8_weight_bits"] = graph.int8_bits
        notes["int8_activations"] = "row" if graph.int8_rows else "call"
        if graph.int8_rows:
            notes["int8_kernel"] = graph.int8_rows
    return notes


def bundle_context(requested: int | None, dims, profile: dict | None = None) -> int:
    """A bundle's context: the one asked for (within the model's positions), else the model's, capped by the
    profile's `max_context` limit."""
    if requested is None:
        return min(dims.max_positions, profile["limits"]["max_context"]) if profile else dims.max_positions
    if not 1 <= requested <= dims.max_positions:
        raise UserError(f"--max-context must be in 1..{dims.max_positions} for this model, got {requested}")
    return requested


def _check_runnable(options: ExportOptions) -> None:
    """bf16 graphs do not run on ONNX Runtime's CPU provider (no bf16 MatMul): say so before any work, when this
    export would have to run one (the build's optimization always runs on the CPU; validation runs on CUDA where
    this onnxruntime has it)."""
    if options.graph.precision != "bf16" or not (options.optimize or options.validate):
        return
    if options.optimize or "CUDAExecutionProvider" not in ort.get_available_providers():
        raise UserError("bf16 graphs do not run on ONNX Runtime's CPU provider: use fp16 for GPUs, or write the bf16 "
                        "graph with `--flavour trt --precision bf16 --no-validate` (for TensorRT)")


def optimize_graph(folder: Path, graph_info: dict) -> None:
    """Let ORT fuse and constant-fold once, at build time; the bundle keeps the optimized graph."""
    raw = folder / graph_info["file"]
    optimized = raw.with_suffix(".opt.onnx")
    ort.InferenceSession(str(raw), session_options(optimized_path=optimized, graph_info=graph_info),
                         providers=["CPUExecutionProvider"])
    raw.unlink()
    raw.with_suffix(".onnx.data").unlink()
    graph_info["file"] = optimized.name
    graph_info["optimized"] = f"onnxruntime {ort.__version__}, ORT_ENABLE_EXTENDED"


def _tool_versions() -> dict:
    versions = {"python": platform.python_version()}
    for name in ("specexport", "torch", "transformers", "onnx", "onnxruntime", "numpy"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return versions
