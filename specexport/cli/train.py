"""train: a proposer for a target model, trained here (the train extra)."""

from __future__ import annotations

import click

import specexport.train as trainers
from specexport.cli.build import offline_option
from specexport.cli.common import SettingOptions, path_option
from specexport.options import with_given

# every trainer's options (its Config's fields), one click option each; the help says whose default is what
OPTIONS = SettingOptions({name: t.Config for name, t in trainers.TRAINERS.items()})


@click.command()
@click.option("--method", type=click.Choice(list(trainers.TRAINERS)), default="draft", show_default=True,
              help="What to train: " + "; ".join(f"{name} = {t.about}" for name, t in trainers.TRAINERS.items()) + ".")
@click.option("--model", "model_spec", required=True,
              help="The target: HF folder, .gguf file, Hugging Face id (downloaded when not cached) or alias.")
@offline_option
@path_option("--output", required=True,
             help="Folder to write (the draft model or the heads, training.json, checkpoint/).")
@click.option("--resume", is_flag=True, help="Continue from OUTPUT exactly where it stopped.")
@click.option("--overwrite", is_flag=True, help="Replace the output folder if it exists.")
@OPTIONS
def train(method, model_spec, output, resume, overwrite, **options):
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
    --method dflash: a DFlash block draft on cached target features (the target's layers' outputs as context), each
    block [token, mask x (B-1)] learning the next B-1 tokens at once (loss sum_k exp(-(k-1)/gamma) CE); OUTPUT is in
    z-lab's layout: use it with build --method dflash --draft OUTPUT.
    The last 2000 ShareGPT conversations are held out for evaluation in all.

    \b
    Examples:
      specexport train --method draft --model smollm2-135m --output drafts/smollm2-135m-draft4
      specexport train --method draft --model smollm2-135m --output drafts/smollm2-135m-draft4 --resume
      specexport train --method medusa --model smollm2-135m --output heads/smollm2-135m
      specexport build --model smollm2-135m --method medusa --heads heads/smollm2-135m
      specexport train --method eagle3 --model smollm2-135m --output drafts/eagle3-smollm2
      specexport build --model smollm2-135m --method eagle3 --draft drafts/eagle3-smollm2
      specexport train --method dflash --model smollm2-135m --output drafts/dflash-smollm2
    """
    trainer = trainers.get(method)
    config = with_given(trainer.Config(), OPTIONS.given(options, method), f"--method {method}")
    result = trainer.train(model_spec, output, config, resume=resume, overwrite=overwrite)
    for line in trainer.summary(result, output):
        click.echo(line)
