"""export, build: a model (and a speculation method) in, a bundle out (the export extra: torch, onnx, ...)."""

from __future__ import annotations

from pathlib import Path

import click

from specexport import profiles
from specexport.bundle.describe import numerics_lines
from specexport.cli.common import IntList, SettingOptions, path_option
from specexport.errors import UserError
from specexport.exporter import arch, hub, methods, row_invariance, sources
from specexport.exporter.export import ExportOptions, bundle_context, export_bundle
from specexport.exporter.graph import FLAVOURS, INT8_ROWS, PRECISIONS, SERVING_INT8, GraphOptions
from specexport.exporter.tensorrt import build as tensorrt
from specexport.runtime import kernels
from specexport.runtime.methods import PLAIN_NAME
from specexport.tune import probe

BACKENDS = ["onnxruntime", "tensorrt"]
DEFAULT_CPU_PRECISION = "int8"  # AMX/VNNI DynamicQuantizeMatMul: cheap decode, and cheap wide verify
DEFAULT_TRT_PRECISION = "fp16"
BEST = "best"  # --method best: the fastest method measured on this hardware (the profile's, or a probe's)
NO_PROFILE = "off"  # --profile off: no profile (the methods' own defaults)
# each method's run-time settings (saved in the bundle) and its build-only options, as options
SETTINGS = SettingOptions({name: m.runtime.Settings for name, m in methods.METHODS.items()}, build=True)
OPTIONS = SettingOptions({name: m.Options for name, m in methods.METHODS.items()})


def offline_option(f):
    """--offline: the process never downloads (every model it resolves, the target's draft included)."""
    def never_download(ctx, param, value):
        if value:
            hub.set_offline(True)
        return value

    return click.option("--offline", is_flag=True, expose_value=False, callback=never_download, is_eager=True,
                        help="Never download: models must be local (also HF_HUB_OFFLINE=1).")(f)


def model_options(f):
    f = offline_option(f)
    return click.option("--model", "model_spec", required=True,
                        help="HF folder, .gguf file, Hugging Face id (org/name, downloaded when not cached) or alias "
                             f"({', '.join(sources.ALIASES)}).")(f)


def export_options(f):
    f = click.option("--max-context", type=int, default=None, help="Context limit (default: the model's).")(f)
    f = click.option("--flavour", type=click.Choice(FLAVOURS), default=None,
                     help="ort: ONNX Runtime fused ops (default). onnx: standard ONNX ops only. trt: the standard "
                          "ops TensorRT parses (static cache, fp16/bf16/int4; `specexport check-trt` lints it).")(f)
    f = click.option("--aux-layers", type=IntList(), default="",
                     help="Also output the inputs of these layers, e.g. 2,15,27.")(f)
    f = click.option("--no-validate", is_flag=True, help="Skip the numerics check against transformers.")(f)
    f = click.option("--int8-rows", type=click.Choice(INT8_ROWS), is_flag=False, flag_value="blocks", default=None,
                     help="int8 (ort flavour): activations quantized per row, so that a token's logits do not depend "
                          "on the other rows of its call: speculative and batched output exactly plain decoding's. "
                          "blocks (the value alone): 8-bit weights in blocks of 32 (MatMulNBits), quick for one row; "
                          "channel: per-channel weights (MatMulIntegerToFloat), cheap extra rows for trees and "
                          "batches (docs/precision.md).")(f)
    f = click.option("--int4-rows/--no-int4-rows", default=None,
                     help="int4 (ort flavour): specexport's own 4-bit kernel, each weight tile unpacked once for all "
                          "the rows of a call and each row quantized alone: trees and batches cost little more than "
                          "one row, and a row's logits never depend on its call. Compiled where the bundle is loaded, "
                          "at first use (a C compiler; docs/precision.md). [build's default, where it compiles here: "
                          "where the profile measured it faster, and where MatMulNBits' int4 rounds a row alone "
                          "otherwise than beside others on this CPU]")(f)
    f = click.option("--attention-rows/--no-attention-rows", default=None,
                     help="ort flavour, fp32 activations: attention in specexport's own kernel over the call's real "
                          "rows only, each sequence with its own rows and tree, the cache written in place: a batch "
                          "no longer pays every sequence's attention at the widest one's width, and a tree is "
                          "verified whole (no layout in lanes). Compiled where the bundle is loaded (a C compiler). "
                          "[build's default for a CPU profile, where it compiles and the model takes it]")(f)
    f = click.option("--fused-accept/--no-fused-accept", default=True, show_default=True,
                     help="Acceptance inside the target graph, greedy and sampling: a step returns the accepted rows "
                          "and the bonus token, not logits.")(f)
    return click.option("--overwrite", is_flag=True, help="Replace the output folder if it exists.")(f)


def _print_export(manifest: dict, output: Path) -> None:
    click.echo(f"bundle written to {output}")
    lines = numerics_lines(manifest)
    if lines:
        click.echo("numerics:")
        click.echo("\n".join(lines))


@click.command()
@model_options
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True)
@path_option("--output", required=True, help="Bundle folder to write.")
@export_options
def export(model_spec, precision, output, max_context, flavour, aux_layers, no_validate, int8_rows, int4_rows,
           attention_rows, fused_accept, overwrite):
    """Export a model's target graph and manifest into a bundle folder.

    \b
    Examples:
      specexport export --model smollm2-135m --output smol-fp32
      specexport export --model ./my-llama --precision int4 --output my-llama-int4
      specexport export --model smollm2-135m --flavour trt --precision fp16 --output smol-trt
    """
    graph = GraphOptions(precision=precision, flavour=flavour or "ort", aux_layers=aux_layers, fused_accept=fused_accept,
                         int8_rows=int8_rows or "", int4_rows=bool(int4_rows), attention_rows=bool(attention_rows))
    options = ExportOptions(graph=graph, max_context=max_context, validate=not no_validate)
    _print_export(export_bundle(model_spec, output, options, overwrite=overwrite), output)


@click.command()
@model_options
@click.option("--method", type=click.Choice([BEST, *methods.METHODS]), default="none", show_default=True,
              help=f"Speculation method ({BEST}: the fastest on this hardware, plain decoding included: the "
                   "profile's measurement where it was measured on this CPU's features, else a probe measures the "
                   "candidates here, once per machine and model).")
@click.option("--no-probe", is_flag=True,
              help=f"--method {BEST} or --serving: choose by the profile's speeds even where they were measured on "
                   "another CPU.")
@SETTINGS
@OPTIONS
@click.option("--backend", type=click.Choice(BACKENDS), default=None, help="[default: the profile's, else onnxruntime]")
@click.option("--precision", type=click.Choice(PRECISIONS), default=None,
              help=f"[default: the profile's, else {DEFAULT_CPU_PRECISION} (onnxruntime on CPU)]")
@click.option("--profile", "profile_spec", default="auto", show_default=True, envvar="SPECEXPORT_PROFILE",
              help="Hardware profile: auto (detect this machine), a bundled name (h100-sxm, cpu-2core, ...), a file, "
                   f"or {NO_PROFILE}. It sets precision (per method, from its measured speed), backend, flavour, "
                   "context limit and the method's settings unless given (also SPECEXPORT_PROFILE).")
@click.option("--serving", is_flag=True,
              help="Build for a server answering many requests at once: the precision (and with --method best the "
                   "method) that the profile measured fastest under load ([serve_speed]: 16 concurrent requests; "
                   "on a CPU no profile was measured on, a probe measures them here, once); int8 with each row "
                   "quantized alone (--int8-rows channel), so that batching never changes a request's tokens.")
@path_option("--output", default=None, help="Bundle folder (default: ./MODEL-METHOD-BACKEND-PRECISION).")
@export_options
@click.option("--workspace-gb", type=click.FloatRange(min=0, min_open=True), default=4.0, show_default=True,
              help="TensorRT: the builder's workspace memory limit.")
@click.option("--timing-cache", type=click.Path(dir_okay=False), default=None,
              help="TensorRT: a timing cache file to start from and update (the bundle keeps a copy either way).")
@click.option("--hardware-compatible", is_flag=True,
              help="TensorRT: a plan for any Ampere or newer GPU, not only this compute capability (may be slower).")
@click.option("--version-compatible", is_flag=True,
              help="TensorRT: a plan later TensorRT releases of the same major version can run.")
@click.option("--sampling-accept", type=click.Choice(tensorrt.SAMPLING_ACCEPT), default=None,
              help="TensorRT: where sampled steps are accepted. host (default): the runtime, from the logits. plugin: "
                   "the engine, with the Triton tree acceptance kernel as a TensorRT plugin (triton at build time; "
                   "not yet run on a GPU).")
def build(model_spec, method, no_probe, backend, precision, profile_spec, serving, output, max_context, flavour,
          aux_layers, no_validate, int8_rows, int4_rows, attention_rows, fused_accept, overwrite, workspace_gb,
          timing_cache, hardware_compatible, version_compatible, sampling_accept, **method_kwargs):
    """Export a model and compile it for a backend into a ready-to-run bundle.

    \b
    Examples:
      specexport build --model smollm2-135m --method none
      specexport build --model smollm2-135m --method ngram --draft-length 8
      specexport build --model smollm2-135m --method draft --draft-model self:6 --draft-tree 2,1,1
      specexport build --model smollm2-135m --method medusa --tree small_15
      specexport build --model llama3-8b --method medusa --heads ./medusa-heads --tree mc_sim_7b_63
      specexport build --model smollm2-135m --precision fp32 --output smol-fp32
      specexport build --model llama3-8b --method none --precision int4
      specexport build --model smollm2-135m --method medusa --profile auto
      specexport build --model smollm2-135m --method none --serving   # int8 rows on a CPU: cheap, exact
      specexport build --model smollm2-135m --method eagle3 --depth 3 --draft-top-k 2 --total-tokens 6
      specexport build --model llama3-8b --method eagle --draft ./EAGLE-LLaMA3-Instruct-8B
      specexport build --model smollm2-135m --method suffix
      specexport build --model llama3-8b --method suffix --datastore llama3-8b.npz --total-tokens 16
      specexport build --model smollm2-135m --method hybrid --total-tokens 6
      specexport build --model llama3-8b --method eagle3 --profile auto   # on an NVIDIA GPU: TensorRT engines
      specexport build --model smollm2-135m --method medusa --backend tensorrt --precision fp16
    """
    profile = chosen = None
    if serving and profile_spec == NO_PROFILE:
        raise UserError(f"--serving chooses by a profile's measured speed under load: not with --profile {NO_PROFILE}")
    if no_probe and method != BEST and not serving:
        raise UserError(f"--no-probe is for --method {BEST} and --serving")
    if profile_spec != NO_PROFILE:
        profile, chosen = profiles.resolve_profile(profile_spec)
        click.echo(f"profile {profile.name} ({profile.description}; chosen by {chosen['chosen']}: {chosen['why']})",
                   err=True)
        if profile_spec == "auto" and not chosen["measured_here"] and profile.hardware.kind == "cpu":
            profile, chosen = _probed(model_spec, profile, chosen, (method == BEST or serving) and not no_probe,
                                      serving)
    if method == BEST:
        if profile is None:
            raise UserError(f"--method {BEST} chooses by a profile's measured speed: not with --profile {NO_PROFILE}")
        method = profiles.best_method(profile, serving)
        plain = " (no method beat plain decoding here)" if method == PLAIN_NAME else ""
        click.echo(f"method {method}{plain}: the fastest that profile {profile.name} measured"
                   f"{' serving' if serving else ''}", err=True)
    settings = SETTINGS.given(method_kwargs, method)
    method_options = OPTIONS.given(method_kwargs, method)
    if profile is not None:
        backend = backend or profile.engine.backend
        if backend == profile.engine.backend:  # another --backend takes its own defaults, not this profile's
            if precision is None:
                alone = profiles.precision_for(profile, method)
                precision = profiles.precision_for(profile, method, serving)
                if precision != alone:
                    click.echo(f"precision {precision} (the fastest serving, as profile {profile.name} measured)",
                               err=True)
            flavour = flavour or profile.engine.flavour
        settings = profiles.merge(profile, methods.get(method).runtime, settings)
    backend = backend or "onnxruntime"
    if sampling_accept and backend != "tensorrt":
        raise UserError(f"--sampling-accept is for --backend tensorrt, and this build is for {backend}")
    engines = None
    if backend == "tensorrt":
        precision, flavour = precision or DEFAULT_TRT_PRECISION, flavour or "trt"
        runtime = methods.get(method).runtime
        tree_tokens = profile.limits.max_tree_tokens if profile else \
            runtime.tokens_per_step(runtime.settings({}, settings))
        engines = tensorrt.EngineOptions(tree_tokens, workspace_gb, timing_cache, hardware_compatible,
                                         version_compatible, sampling_accept or "host")
    precision = precision or DEFAULT_CPU_PRECISION
    if serving and precision == "int8" and (flavour or "ort") == "ort" and int8_rows is None:
        int8_rows = SERVING_INT8  # a server's batches never change a request's tokens, at DynamicQuantizeMatMul's cost
        click.echo("int8 activations quantized per row (--int8-rows channel): batching never changes a request's "
                   "tokens", err=True)
    nbits = precision == "int4" and (flavour or "ort") == "ort"  # int4 in MatMulNBits unless in our kernel
    if int4_rows is None:
        int4_rows = nbits and _rows4_default(profile, backend)
    if nbits and not int4_rows and row_invariance.rows_apart(4):
        click.echo("int4 in MatMulNBits: on this CPU its one-row calls round otherwise than its wider ones, "
                   "so speculation and batching can change a token at a near-tie; --int4-rows is exact", err=True)
    if attention_rows is None:
        attention_rows = _attention_rows_default(model_spec, profile, backend, GraphOptions(precision, flavour or "ort"),
                                                 max_context)
    if output is None:
        output = Path(f"{sources.resolve(model_spec).name}-{method}-{backend}-{precision}")
    graph = GraphOptions(precision=precision, flavour=flavour or "ort", aux_layers=aux_layers, fused_accept=fused_accept,
                         int8_rows=int8_rows or "", int4_rows=int4_rows, attention_rows=attention_rows)
    options = ExportOptions(graph=graph, max_context=max_context, optimize=True, validate=not no_validate,
                            method=method, settings=settings, method_options=method_options,
                            profile=None if profile is None else {**profile.as_dict(), **chosen}, engines=engines)
    _print_export(export_bundle(model_spec, output, options, overwrite=overwrite), output)


def _rows4_default(profile, backend: str) -> bool:
    """Whether an int4 build for a CPU profile takes specexport's own kernel (--int4-rows) by default, where it
    compiles here (else MatMulNBits, and why): where the profile measured it faster (its engine's int4_kernel), and
    where MatMulNBits' int4 is measured not row-invariant on this CPU (exporter/row_invariance.py)."""
    if profile is None or backend != profile.engine.backend or profile.hardware.kind != "cpu":
        return False
    measured = profile.engine.int4_kernel == kernels.ROWS4
    if not measured and not row_invariance.rows_apart(4):
        return False
    if why := kernels.unavailable():
        click.echo(f"int4 in ONNX Runtime's MatMulNBits: specexport's own kernel does not compile here ({why})", err=True)
        return False
    why = f"as profile {profile.name} measured it faster" if measured else \
        "exact on this CPU, where MatMulNBits' int4 is not"
    click.echo(f"int4 in specexport's own kernel (--int4-rows, {why}): extra rows cost little, and batching never "
               "changes a request's tokens", err=True)
    return True


def _attention_rows_default(model_spec: str, profile, backend: str, graph: GraphOptions, max_context) -> bool:
    """Whether a build for a CPU profile takes specexport's own attention kernel (--attention-rows) by default: where
    the graph and the model (at the bundle's context) take it and it compiles here (else GroupQueryAttention, and
    why)."""
    if profile is None or backend != profile.engine.backend or profile.hardware.kind != "cpu":
        return False
    dims = arch.dims_from_config(sources.load_config(sources.resolve(model_spec)))
    dims = dims.within(bundle_context(max_context, dims, profile.as_dict()))
    why = graph.attention_rows_unfit(dims) or kernels.unavailable()
    if why:
        click.echo(f"attention in ONNX Runtime's GroupQueryAttention: {why}", err=True)
        return False
    click.echo("attention in specexport's own kernel (--attention-rows): each call computes its real rows only, and "
               "trees are verified whole", err=True)
    return True


def _probed(model_spec: str, profile, chosen: dict, measure: bool, serving: bool):
    """The profile and how it was chosen where `auto`'s profile was measured on another CPU: the probe kept for this
    machine and model (with [serve_speed] for `serving`), else (`measure`: --method best or --serving) a probe run
    now (tune/probe.py), else the profile as found."""
    name = sources.resolve(model_spec).name
    kept = probe.cached(name)
    if measure and (kept is None or (serving and not kept.serve_speed)):
        kept = probe.probe(model_spec, profile, say=lambda text: click.echo(text, err=True), serving=serving)
        click.echo("\n".join(["probe (decode tokens/s, greedy):", *probe.describe(kept)]), err=True)
        if serving:
            click.echo("\n".join([f"probe ({probe.SERVE_CLIENTS} requests at once):",
                                  *probe.describe(kept, serving=True)]), err=True)
    if kept is None:
        click.echo(f"  its speeds were measured on another CPU: --method {BEST} or --serving probes this one",
                   err=True)
        return profile, chosen
    click.echo(f"profile {kept.name} (the probe kept for {name} on this machine: {kept.path})", err=True)
    return kept, {**chosen, "chosen": "probe", "measured_here": True, "why": kept.description}
