"""Model in, bundle out: resolve, load, build the target graph, validate it, write the bundle."""

from __future__ import annotations

import platform
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from specexport.errors import UserError
from specexport.exporter.graph import GraphOptions
from specexport.exporter.methods import MethodOptions

# Real prompts for the quantized graphs' top-1 agreement (teacher-forced on the fp32 model's
# own greedy continuation, so the positions look like generation).
AGREEMENT_PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Summarise the plot of Romeo and Juliet.",
    "What are three tips for staying focused while studying?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Give me a recipe for a simple tomato pasta.",
    "def is_prime(n):\n    \"\"\"Return True if n is a prime number.\"\"\"\n",
    "List the planets of the solar system in order from the sun.",
    "Rewrite this sentence to be more formal: hey, can u send me the report asap?",
    "What is the difference between a list and a tuple in Python?",
]
AGREEMENT_NEW_TOKENS = 48


@dataclass
class ExportOptions:
    graph: GraphOptions = field(default_factory=GraphOptions)
    max_context: int | None = None  # default: the model's own limit
    optimize: bool = False  # save ORT's optimized graph (what `build` does for onnxruntime)
    validate: bool = True
    method: MethodOptions = field(default_factory=MethodOptions)
    profile: dict | None = None  # the resolved hardware profile, saved in the manifest


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
                  quiet: bool = False) -> dict:
    """Export `model_spec` into a bundle folder at `output`; returns the manifest."""
    from specexport.exporter import arch, methods, sources
    from specexport.runtime.bundle import staged_output, write_manifest

    options.method.check()
    _check_runnable(options)
    has_draft = options.method.name == "draft"
    has_medusa = options.method.name == "medusa"
    has_eagle = options.method.name in methods.EAGLE_METHODS
    # load, build, tokenizer (+ draft or heads build) (+ optimize) (+ validate)
    step = Steps(3 + has_draft + has_medusa + has_eagle + options.optimize + options.validate, quiet)
    source = sources.resolve(model_spec)
    config = sources.load_config(source)
    arch.spec_for(config.model_type)  # an unsupported architecture fails here, before any loading
    dims = arch.dims_from_config(config)
    options.graph.check(dims)
    max_context = _max_context(options.max_context, dims)
    if options.profile is not None and options.max_context is None:
        max_context = min(max_context, options.profile["limits"]["max_context"])
    if has_draft and methods.parse_self_draft(options.method.draft_model, dims.layers) is None:
        try:  # fail early on a draft that is not a model or has another vocabulary size
            draft_vocab = sources.load_config(sources.resolve(options.method.draft_model)).vocab_size
        except UserError as e:
            raise UserError(f"--draft-model: {e}") from None
        if draft_vocab != dims.vocab:
            raise UserError(f"draft model {options.method.draft_model} has a different vocabulary than the target "
                            f"({draft_vocab} vs {dims.vocab} tokens); a draft must share the target's tokenizer")
    method_manifest = options.method.manifest()
    graph_options, heads = options.graph, None
    if has_medusa:  # fail early on bad heads or a bad tree
        heads, where, medusa_tree = methods.load_medusa(options.method, source.name, dims.hidden, dims.vocab)
        graph_options = replace(graph_options, fused_accept=True, medusa_top_k=methods.MEDUSA_TOP_K)
        method_manifest.update(heads=str(Path(where).resolve()), heads_count=heads.count, heads_layers=heads.layers,
                               head_style=heads.style, top_k=methods.MEDUSA_TOP_K, tree=medusa_tree.as_lists(),
                               accuracy=heads.meta.get("accuracy"))

    eagle = None
    if has_eagle:  # fail early on a bad draft
        eagle, where = methods.load_eagle(options.method, source.name, dims)
        aux = tuple(sorted(set(graph_options.aux_layers) | set(eagle.config.aux_layers)))
        graph_options = replace(graph_options, fused_accept=True, aux_layers=aux)
        method_manifest.update(draft=str(Path(where).resolve()), version=eagle.config.version,
                               draft_vocab=eagle.config.draft_vocab, aux_layers=list(eagle.config.aux_layers),
                               accuracy=eagle.meta.get("accuracy"))

    with staged_output(Path(output), overwrite=overwrite) as tmp:
        step(f"loading {source.name} ({source.kind}: {source.path})")
        model, tokenizer = sources.load_model(source)
        models = {"target": model}
        step(f"building the {options.graph.precision} target graph ({options.graph.flavour} ops, {dims.layers} layers)")
        graphs = {"target": _write_graph(model, "target", graph_options, max_context, tmp, quiet, heads, eagle=eagle)}
        if has_eagle:
            version = "EAGLE-3" if eagle.config.version == 3 else "EAGLE-1/2"
            step(f"building the {version} draft graph (draft vocabulary {eagle.config.draft_vocab})")
            graphs["draft"] = _write_eagle_graph(model, eagle, options.graph, max_context, tmp)
        if has_medusa:
            step(f"building the Medusa heads graph ({heads.count} {heads.style}-LM-head heads, for sampling)")
            graphs["medusa_heads"] = _write_graph(model, "medusa_heads", graph_options, max_context, tmp, quiet, heads,
                                                  heads_only=True)
        if has_draft:
            draft, draft_name = methods.load_draft(options.method, model, tokenizer, dims.layers)
            models["draft"] = draft
            step(f"building the draft graph ({draft_name}, {draft.config.num_hidden_layers} layers)")
            draft_graph = GraphOptions(precision=options.graph.precision, flavour=options.graph.flavour)  # plain outputs
            graphs["draft"] = _write_graph(draft, "draft", draft_graph, max_context, tmp, quiet)
        step("saving the tokenizer")
        tokenizer_files = sources.save_tokenizer(tokenizer, tmp) + sources.save_generation_config(model, tmp)
        if options.optimize:
            step("optimizing the graphs for onnxruntime")
            for info in graphs.values():
                _optimize(tmp, info)
        numerics = {}
        if options.validate:
            step("validating against transformers")
            precision = options.graph.precision
            numerics = _validate(model, tokenizer, tmp, graphs["target"], precision, agreement=precision != "fp32")
            if has_medusa:
                numerics["medusa"] = _validate_medusa(model, tmp, graphs, heads)
            if has_eagle:
                numerics["eagle"] = _validate_eagle(model, tmp, graphs, eagle)
            if has_draft:
                # the draft's quality shows in the accept length; its numerics are checked case by case
                numerics["draft"] = _validate(models["draft"], tokenizer, tmp, graphs["draft"], precision, agreement=False)
        step.done()
        manifest = {
            "model": {"name": source.name, "source": str(source.path), "kind": source.kind, **dims.as_dict()},
            "method": method_manifest,
            "precision": options.graph.precision,
            "flavour": options.graph.flavour,
            "max_context": max_context,
            "graphs": graphs,
            "tokenizer": {"files": sorted(tokenizer_files)},
            "runtime": {"prefill_first_token_alone": options.graph.precision == "int8"},
            "numerics": numerics,
            "profile": options.profile,
            "tools": _tool_versions(),
        }
        return write_manifest(tmp, manifest)


def _max_context(requested: int | None, dims) -> int:
    if requested is None:
        return dims.max_positions
    if not 1 <= requested <= dims.max_positions:
        raise UserError(f"--max-context must be in 1..{dims.max_positions} for this model, got {requested}")
    return requested


def _write_graph(model, name: str, graph: GraphOptions, max_context: int, folder: Path, quiet: bool, medusa=None,
                 heads_only: bool = False, eagle=None) -> dict:
    """Build `name`.onnx from a transformers model (with Medusa heads; or the heads alone); returns its
    manifest entry."""
    from tqdm import tqdm

    from specexport.exporter.arch import dims_from_config, extract_weights, rope_tables, spec_for
    from specexport.exporter.graph import TargetGraphBuilder

    spec, dims = spec_for(model.config.model_type), dims_from_config(model.config)
    weights = extract_weights(spec, dims, model.state_dict())
    rotary = model.model.rotary_emb
    rope = rope_tables(rotary.inv_freq.detach().float().numpy(), float(rotary.attention_scaling), max_context)
    builder = TargetGraphBuilder(spec, dims, weights, graph, rope, medusa, eagle)
    if heads_only:
        from specexport.exporter.medusa_graph import build_heads_graph

        proto = build_heads_graph(builder)
    else:
        with tqdm(total=dims.layers, desc=name, unit="layer", disable=quiet, leave=False) as bar:
            proto = builder.build(on_layer=lambda i: bar.update(1))
    del weights
    return _save_graph(proto, name, graph, dims, folder)


def _write_eagle_graph(model, draft, graph: GraphOptions, max_context: int, folder: Path) -> dict:
    """draft.onnx: the EAGLE draft decoder with its own KV cache (exporter/eagle_graph.py)."""
    from specexport.exporter.arch import ARCHS, dims_from_config, extract_weights, spec_for
    from specexport.exporter.eagle_graph import build_draft_graph, draft_dims, draft_weights, rope_for
    from specexport.exporter.graph import TargetGraphBuilder

    spec, dims = spec_for(model.config.model_type), dims_from_config(model.config)
    target = extract_weights(spec, dims, model.state_dict())
    ddims = draft_dims(draft, dims)
    plain = GraphOptions(precision=graph.precision, flavour=graph.flavour)
    builder = TargetGraphBuilder(ARCHS["llama"], ddims, draft_weights(draft, target), plain, rope_for(draft, max_context + 64))
    return _save_graph(build_draft_graph(builder, draft), "draft", plain, ddims, folder)


def _save_graph(proto, name: str, graph: GraphOptions, dims, folder: Path) -> dict:
    import onnx

    onnx.save(proto, folder / f"{name}.onnx", save_as_external_data=True, location=f"{name}.onnx.data",
              size_threshold=1024)
    return {
        "file": f"{name}.onnx",
        "flavour": graph.flavour,
        "layers": dims.layers,
        "kv_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "kv_dtype": graph.precision if graph.precision in ("fp16", "bf16") else "fp32",
        "bias_width": "total" if graph.flavour == "ort" else "capacity",
        "aux_layers": list(graph.aux_layers),
        "fused_accept": graph.fused_accept,
        "medusa_top_k": graph.medusa_top_k,
        "inputs": _io(proto.graph.input),
        "outputs": _io(proto.graph.output),
    }


def _io(values) -> list[dict]:
    from onnx import TensorProto

    return [
        {
            "name": v.name,
            "dtype": TensorProto.DataType.Name(v.type.tensor_type.elem_type).lower(),
            "shape": [dim.dim_param or dim.dim_value for dim in v.type.tensor_type.shape.dim],
        }
        for v in values
    ]


def _check_runnable(options: ExportOptions) -> None:
    """bf16 graphs do not run on ONNX Runtime's CPU provider (no bf16 MatMul): say so before any work, when this
    export would have to run one (the build's optimization always runs on the CPU; validation runs on CUDA where
    this onnxruntime has it)."""
    if options.graph.precision != "bf16" or not (options.optimize or options.validate):
        return
    import onnxruntime as ort

    if options.optimize or "CUDAExecutionProvider" not in ort.get_available_providers():
        raise UserError("bf16 graphs do not run on ONNX Runtime's CPU provider: use fp16 for GPUs, or write the bf16 "
                        "graph with `specexport export --precision bf16 --no-validate` (for TensorRT)")


def _optimize(folder: Path, graph_info: dict) -> None:
    """Let ORT fuse and constant-fold once, at build time; the bundle keeps the optimized graph."""
    import onnxruntime as ort

    from specexport.runtime.backend import session_options

    raw = folder / graph_info["file"]
    optimized = raw.with_suffix(".opt.onnx")
    ort.InferenceSession(str(raw), session_options(optimized_path=optimized), providers=["CPUExecutionProvider"])
    raw.unlink()
    raw.with_suffix(".onnx.data").unlink()
    graph_info["file"] = optimized.name
    graph_info["optimized"] = f"onnxruntime {ort.__version__}, ORT_ENABLE_EXTENDED"


def _validate(model, tokenizer, folder: Path, graph_info: dict, precision: str, agreement: bool) -> dict:
    """Logits vs transformers on every shape class; with `agreement`, top-1 agreement on real prompts."""
    from specexport.exporter import validate
    from specexport.runtime.backend import TargetSession

    model.config._attn_implementation = "eager"  # the literal reference: the bias is added to the scores
    session = TargetSession(folder / graph_info["file"], graph_info)
    report = {"cases": validate.compare(model, session)}
    worst = max(case["max_abs_diff"] for case in report["cases"].values())
    report["max_abs_diff"] = worst
    if agreement:
        sequences = validate.reference_sequences(model, tokenizer, AGREEMENT_PROMPTS, AGREEMENT_NEW_TOKENS)
        report["agreement"] = validate.agreement_on_prompts(model, session, sequences, precision == "int8")
    return report


def _validate_medusa(model, folder: Path, graphs: dict, heads) -> dict:
    """The fused step (accept + heads) and the heads graph against the PyTorch reference, on three trees."""
    import onnxruntime as ort

    from specexport.exporter import validate
    from specexport.runtime.backend import TargetSession, session_options

    session = TargetSession(folder / graphs["target"]["file"], graphs["target"])
    alone = ort.InferenceSession(str(folder / graphs["medusa_heads"]["file"]), session_options(),
                                 providers=["CPUExecutionProvider"])
    runs = [validate.medusa_step(model, session, alone, heads, seed) for seed in range(3)]
    return {"runs": runs, "path_match": all(r["path_match"] for r in runs),
            "bonus_match": all(r["bonus_match"] for r in runs)}


def _validate_eagle(model, folder: Path, graphs: dict, draft) -> dict:
    from specexport.exporter import validate
    from specexport.runtime.backend import TargetSession

    session = TargetSession(folder / graphs["target"]["file"], graphs["target"])
    draft_session = TargetSession(folder / graphs["draft"]["file"], graphs["draft"])
    return validate.eagle(model, session, draft_session, draft)


def _tool_versions() -> dict:
    import importlib.metadata as md

    versions = {"python": platform.python_version()}
    for name in ("specexport", "torch", "transformers", "onnx", "onnxruntime", "numpy"):
        try:
            versions[name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    return versions


def numerics_lines(manifest: dict) -> list[str]:
    """Human summary of a manifest's numerics (printed by export/build and `info`)."""
    n = manifest.get("numerics") or {}
    lines = []
    for name, case in (n.get("cases") or {}).items():
        lines.append(f"  {name:<20} max |logit diff| {case['max_abs_diff']:.2e}   top-1 agreement {case['top1_agreement']:.1%}")
    for run in (n.get("medusa") or {}).get("runs", []):
        k = next(key for key in run if key.startswith("fused_top"))
        lines.append(f"  medusa step          accepted {run['accepted']}: path {'=' if run['path_match'] else '!='} "
                     f"reference, bonus {'=' if run['bonus_match'] else '!='}, candidates {run[k]:.0%} equal "
                     f"(worst gap {run['fused_max_gap']:.1e}; heads graph {run[k.replace('fused', 'heads_graph')]:.0%})")
    if "eagle" in n:
        e = n["eagle"]
        lines.append(f"  eagle features       max |diff| {e['feature_max_abs_diff']:.2e}; draft graph max |diff| "
                     f"{e['draft_max_abs_diff']:.2e}, top-k tokens {e['draft_topk_match']:.0%} equal")
    if "top1_agreement_t1" in n.get("agreement", {}):
        a = n["agreement"]
        lines.append(f"  generated positions  top-1 agreement with fp32: {a['top1_agreement_t1']:.1%} decoding one token per step, "
                     f"{a['top1_agreement_t8']:.1%} in steps of 8 ({a['positions']} positions, teacher-forced)")
    return lines

