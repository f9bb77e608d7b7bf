"""run, bench, info: the runtime's commands (numpy, onnxruntime, tokenizers; no torch)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from specexport.bundle import load_bundle
from specexport.bundle.describe import describe
from specexport.cli import needs_extra
from specexport.cli.common import PARAM, SettingOptions, path_option
from specexport.errors import UserError
from specexport.fsutil import write_json
from specexport.runtime import cpu, methods
from specexport.runtime.backends import DEVICES
from specexport.runtime.bench import encode_prompts, read_prompts, run_bench, summary_lines
from specexport.runtime.generate import Engine
from specexport.runtime.grammar import Constraint
from specexport.runtime.sampling import SamplingParams

# run-time overrides of a bundle's settings: every method's, as one set of options (--top-k is run's sampling)
OVERRIDES = SettingOptions({name: m.Settings for name, m in methods.METHODS.items()}, taken=("--top-k",))


DEVICE = click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True,
                      help="auto: CUDA when this onnxruntime has it, else the CPU. cuda: the KV cache and step buffers "
                           "on the GPU (I/O binding). cpu-iobinding: that device path run on the CPU.")


def _engine(bundle: Path, threads: int | None, device: str, kwargs: dict) -> Engine:
    engine = Engine.load(bundle, threads=threads, device=device)
    engine.configure(**{name: kwargs[PARAM + name] for name in OVERRIDES.field})
    for warning in engine.warnings:
        click.echo(f"warning: {warning}", err=True)
    return engine


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@click.option("--prompt", default=None, help="Prompt text (the chat template is applied when the model has one).")
@click.option("--prompt-ids", default=None, help="The prompt as comma-separated token ids instead of text.")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy.")
@click.option("--top-k", type=int, default=0, show_default=True, help="0 = off.")
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--min-p", type=float, default=0.0, show_default=True,
              help="Keep the tokens at least this times as likely as the most likely one (sampling). 0 = off.")
@click.option("--logit-bias", multiple=True, metavar="ID=BIAS",
              help="Add BIAS (-100..100) to token ID's logit, greedy or sampled (repeatable).")
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
              help="Divide the logits of tokens in the prompt or output so far by this (multiply negative ones). 1 = off.")
@click.option("--frequency-penalty", type=float, default=0.0, show_default=True,
              help="Subtract this times each token's count in the output so far from its logit.")
@click.option("--presence-penalty", type=float, default=0.0, show_default=True,
              help="Subtract this from the logit of each token in the output so far.")
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--stop-id", type=int, multiple=True, help="Stop token id, besides the model's end-of-sequence ids (repeatable).")
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--threads", type=int, default=None, help="ORT intra-op threads (default: all cores).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming text.")
@click.option("--logprobs", type=int, default=None, metavar="N",
              help="With --json: each new token's log-probability under the model, and the N most likely tokens'.")
@path_option("--json-schema", "json_schema", default=None, help="Structured output: the answer follows this JSON "
             "schema (a .json file).")
@click.option("--regex", default=None, help="Structured output: the answer matches this regular expression.")
@path_option("--grammar", default=None, help="Structured output: the answer follows this grammar (a Lark or GBNF "
             "file).")
@DEVICE
@OVERRIDES
def run(bundle, prompt, prompt_ids, max_new_tokens, temperature, top_k, top_p, min_p, logit_bias, repetition_penalty,
        frequency_penalty, presence_penalty, seed, stop, stop_id, raw, threads, as_json, logprobs, json_schema, regex,
        grammar, device, **overrides):
    """Generate from a prompt with a bundle, streaming the text, then print stats.

    The method's settings (tree, draft length, ...) default to the bundle's; the options below override them.

    \b
    Examples:
      specexport run smollm2-plain --prompt "Write a haiku about the sea."
      specexport run smol-fp32 --prompt "Tell me a story" --temperature 0.7 --top-p 0.9 --seed 1
      specexport run smol-fp32 --prompt "List three colours" --json
      specexport run smol-fp32 --prompt-ids 1,504,3300 --max-new-tokens 16
      specexport run smol-fp32 --prompt "Name a fruit" --temperature 1 --min-p 0.1 --logit-bias 28=-100
      specexport run smol-fp32 --prompt "Name a fruit" --json --logprobs 3
      specexport run smol-fp32 --prompt "Describe a cat in JSON" --json-schema cat.schema.json
    """
    if (prompt is None) == (prompt_ids is None):
        raise UserError("give exactly one of --prompt and --prompt-ids")
    if prompt_ids is not None:
        try:
            prompt = [int(t) for t in prompt_ids.split(",")]
        except ValueError:
            raise UserError(f"--prompt-ids must be comma-separated integers, got '{prompt_ids}'") from None
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if logprobs is not None and not as_json:
        raise UserError("--logprobs goes with --json (the logprobs are a list in its object)")
    params = SamplingParams(temperature=temperature or 0.0, top_k=top_k, top_p=top_p, seed=seed, min_p=min_p,
                            logit_bias=_logit_bias(logit_bias), repetition_penalty=repetition_penalty,
                            frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
                            logprobs=logprobs, constraint=_constraint(json_schema, regex, grammar))
    engine = _engine(bundle, threads, device, overrides)
    vocab = engine.bundle.manifest["model"]["vocab"]
    if any(t >= vocab for t, _ in params.logit_bias):
        raise UserError(f"--logit-bias: token ids must be in 0..{vocab - 1}")
    if any(not 0 <= t < vocab for t in stop_id):
        raise UserError(f"--stop-id must be a token id in 0..{vocab - 1}")
    stop_ids = tuple(sorted(engine.tokenizer.eos_token_ids | set(stop_id)))
    stream = None if as_json else (lambda text: click.echo(text, nl=False))
    result = engine.generate(prompt, max_new_tokens=max_new_tokens, sampling=params, stop=tuple(stop),
                             stop_ids=stop_ids, chat=not raw, on_text=stream)
    s = result.stats
    if as_json:
        scores = {} if result.logprobs is None else {"logprobs": [
            {"token": x.token, "logprob": x.logprob, "top": [list(t) for t in x.top]} for x in result.logprobs]}
        click.echo(json.dumps({"text": result.text, "tokens": result.tokens, "stop_reason": result.stop_reason,
                               "method": engine.bundle.method, **s.as_dict(), **scores}))
        return
    click.echo()
    click.echo(f"[{s.new_tokens} tokens in {s.seconds:.2f} s: {s.tokens_per_s:.1f} tokens/s, "
               f"time to first token {s.ttft_s * 1000:.0f} ms, {s.steps} steps, method {engine.describe()}, "
               f"tau {s.tau:.2f}, accepted {s.accepted}/{s.drafted} drafts, "
               f"profile {(engine.bundle.manifest.get('profile') or {}).get('name', 'none')}, "
               f"stop: {result.stop_reason}]", err=True)


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@path_option("--prompts", "prompts_file", required=True, help="JSON lines with a 'prompt' field (and optional 'id').")
@click.option("--max-new-tokens", type=int, default=128, show_default=True)
@path_option("--json", "json_out", default=None, help="Write the results here.")
@click.option("--compare-hf", is_flag=True,
              help="Also time transformers generate on the same model (needs the export extra).")
@click.option("--threads", type=int, default=None)
@click.option("--baseline", type=click.Path(path_type=Path), default=None,
              help="Time plain decoding on this bundle instead (the same model, e.g. its fastest plain bundle).")
@DEVICE
@OVERRIDES
def bench(bundle, prompts_file, max_new_tokens, json_out, compare_hf, threads, baseline, device, **overrides):
    """Benchmark a bundle's method against plain decoding on the same engine (greedy, batch 1).

    \b
    Examples:
      specexport bench smollm2-plain --prompts prompts.jsonl
      specexport bench smol-fp32 --prompts prompts.jsonl --compare-hf --json results.json
      specexport bench smollm2-135m-hybrid-onnxruntime-int8 --prompts p.jsonl --baseline smollm2-135m-none-onnxruntime-int4
    """
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if json_out is not None and (json_out.is_dir() or not json_out.parent.is_dir()):
        raise UserError(f"--json {json_out}: " + ("is a folder" if json_out.is_dir() else "its folder does not exist"))
    hf_speed, hf = None, {"hf_tokens_per_s": None, "hf_speedup": None}
    if compare_hf:
        try:
            from specexport.exporter.reference import hf_speed  # torch and transformers, only for this option
        except ModuleNotFoundError as e:
            needs_extra("bench --compare-hf", "export", e)
    prompts = read_prompts(prompts_file)
    engine = _engine(bundle, threads, device, overrides)
    base = None if baseline is None else Engine.load(baseline, threads=threads, device=device)
    progress = lambda text: click.echo(text, err=True)  # noqa: E731
    result = run_bench(engine, prompts, max_new_tokens=max_new_tokens, progress=progress, baseline=base)
    if hf_speed is not None:
        rate = hf_speed(engine.bundle.manifest["model"]["source"], encode_prompts(engine, prompts),
                        sorted(engine.tokenizer.eos_token_ids), max_new_tokens, progress)
        hf = {"hf_tokens_per_s": rate, "hf_speedup": round(result["tokens_per_s"] / rate, 3) if rate else None}
    result.update(hf)
    click.echo("\n".join(summary_lines(result)))
    if json_out:
        write_json(json_out, result)
        click.echo(f"results written to {json_out}")


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
def info(bundle):
    """Show a bundle's manifest: model, method, precision, graphs and numerics (checksums are verified).

    \b
    Examples:
      specexport info smollm2-plain
    """
    loaded = load_bundle(bundle)
    click.echo("\n".join(describe(loaded)))
    hardware = (loaded.manifest.get("profile") or {}).get("hardware") or {}
    if isinstance(hardware, dict) and hardware.get("kind") == "cpu":
        same = set(hardware.get("features") or ()) == set(cpu.kernel_features())
        click.echo(f"this CPU     {cpu.describe()}: " + (
            "its profile was measured on these features" if same else
            "its profile was not measured on these features (the tree budget measures this CPU when it starts)"))


def _constraint(json_schema: Path | None, regex: str | None, grammar: Path | None) -> Constraint | None:
    """--json-schema, --regex or --grammar (one of them) as the structured output's constraint."""
    given = [name for name, v in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar)) if v]
    if len(given) > 1:
        raise UserError(f"give one of --json-schema, --regex and --grammar, got {' and '.join(given)}")
    if regex is not None:
        return Constraint("regex", regex)
    path = json_schema or grammar
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{given[0]} {path}: cannot read it ({type(e).__name__})") from None
    if grammar is not None:
        return Constraint("grammar", text)
    try:
        return Constraint.json_schema(json.loads(text))
    except json.JSONDecodeError as e:
        raise UserError(f"--json-schema {path}: not JSON ({e.msg} at line {e.lineno})") from None


def _logit_bias(given: tuple[str, ...]) -> tuple[tuple[int, float], ...]:
    """--logit-bias ID=BIAS options as SamplingParams takes them (it checks the ranges)."""
    out = []
    for item in given:
        token, _, bias = item.partition("=")
        try:
            out.append((int(token), float(bias)))
        except ValueError:
            raise UserError(f"--logit-bias takes ID=BIAS (e.g. 28=-100), got '{item}'") from None
    return tuple(out)
