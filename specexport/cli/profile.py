"""profile: measure a bundle here and write a profile that picks its settings, with a report (the profile extra)."""

from __future__ import annotations

from pathlib import Path

import click

from specexport.cli import needs_extra
from specexport.cli.common import IntList, path_option
from specexport.runtime.bench import read_prompts
from specexport.tune import profile_bundle, summary


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@path_option("--prompts", "prompts_file", default=None,
             help="Calibration prompts, JSON lines with a 'prompt' field (default: 10 built-in chat prompts).")
@path_option("--output", default=None,
             help="Profile file to write (default: ./profile-BUNDLE.toml); the report goes to OUTPUT-report/.")
@click.option("--base", default="auto", show_default=True,
              help="The profile whose unmeasured settings carry over: auto, a bundled name or a file.")
@click.option("--new-tokens", type=int, default=64, show_default=True, help="Tokens per calibration prompt.")
@click.option("--max-tokens", type=int, default=64, show_default=True, help="Largest tree measured and considered.")
@click.option("--contexts", type=IntList(), default="256,1024", show_default=True,
              help="Context lengths for the latency curves.")
@click.option("--reps", type=int, default=10, show_default=True, help="Timed calls per latency point (median).")
@click.option("--rounds", type=int, default=1, show_default=True, help="Side-by-side passes over the prompts.")
@click.option("--max-batch", type=int, default=16, show_default=True,
              help="Most sequences of the batched call measured (sequences x width, for the batched engine's tree "
                   "budget); 0: none.")
@click.option("--threads", type=int, default=None)
def profile(bundle, prompts_file, output, base, new_tokens, max_tokens, contexts, reps, rounds, max_batch, threads):
    """Measure a bundle on this hardware and write a profile that picks its settings, with a report.

    \b
    Measures verification latency against tree tokens (1..64) and context, the batched call's latency by
    sequences and width (what the batched engine's tree budget reads), the proposer's cost, and the
    method's acceptance on calibration prompts; predicts the tokens/s of every setting the method has (Medusa:
    the tree for every node budget; EAGLE: depth, top-k and tokens; draft model and n-gram: the draft length),
    runs the best side by side with plain decoding and the presets that fit, and writes the profile (use it
    with build --profile FILE) and OUTPUT-report/report.md with plots.

    \b
    Examples:
      specexport profile smollm2-135m-medusa-onnxruntime-int8 --output profiles-local/this-cpu.toml
      specexport profile BUNDLE --prompts benchmarks/prompts/sharegpt40.jsonl --rounds 2
    """
    prompts = [p["prompt"] for p in read_prompts(prompts_file)] if prompts_file else None
    output = output or Path(f"profile-{bundle.name}.toml")
    report = output.with_name(output.stem + "-report")
    try:
        result = profile_bundle(bundle, prompts, output, report, base, new_tokens, max_tokens, contexts, reps, rounds,
                                threads, max_batch=max_batch)
    except ModuleNotFoundError as e:  # the report's plots: the profile extra
        needs_extra("profile", "profile", e)
    click.echo(f"profile written to {output} (based on {base})")
    click.echo("\n".join(summary(result)))
