"""Distil a small draft model for speculative decoding of a target, on ShareGPT, on a CPU.

The draft is the target's first N layers plus its final norm and its embeddings / LM head (tied like the
target's), initialised from the target's weights, so it starts as the `self:N` draft. It is then trained to
match the target's next-token distribution: loss = KL(target || draft) per token at temperature 1 (optionally
over the target's top-k tokens only), with the target frozen and its logits computed on the fly. The embeddings
and LM head stay frozen (the runtime can share them with the target); the N layers and the final norm train.

Data: ShareGPT conversations rendered with the target's chat template, each cut to `seq_len` tokens, packed
back to back into windows of `seq_len` tokens, in a seeded order. The LAST `HELDOUT` conversations of the file
are never trained on: they are where benchmark prompts and the held-out evaluation come from.

OUTPUT/ becomes a Hugging Face model folder (config.json, model.safetensors, tokenizer, generation_config.json)
plus training.json. OUTPUT/checkpoint/ holds what `resume` needs: the trained weights and the AdamW moments as
safetensors, and step, token count, time and data position as JSON (never a pickle). Training uses no random
numbers besides the data order, which follows from the seed, so a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import sys
import time
from pathlib import Path

from tqdm import tqdm

from specexport.errors import UserError
from specexport.exporter.sources import load_config, resolve, save_generation_config, save_tokenizer
from specexport.fsutil import write_json
from specexport.options import setting
from specexport.train import loop
from specexport.train.data import HELDOUT, TokenStream, eval_sequences, sharegpt_split
from specexport.train.loop import (
    CLIP_NORM,
    WARMUP_STEPS,
    check_settings,
    load_frozen_target,
    logger,
    run_steps,
    torch_threads,
)
from specexport.train.output import checkpoint_dir, load_checkpoint, prepare_output, same_settings

EVAL_SEQUENCES = 100  # held-out sequences for the before/after agreement
MICRO_ELEMENTS = 2**25  # logits elements per micro-batch: one [tokens, vocab] fp32 tensor of 128 MB
RESUME_KEYS = ("model", "layers", "batch", "seq_len", "lr", "seed", "top_k", "data", "conversations")


@dataclasses.dataclass(frozen=True)
class Config(loop.Budget):
    """How to distil a draft: the options of `specexport train --method draft`."""

    layers: int = setting(4, "draft: layers (the target's first N).")
    seq_len: int = setting(256, "draft: tokens per sequence.")
    top_k: int | None = setting(None, "draft: KL over the target's top K tokens only (default: all).")

    def check(self) -> None:
        check_settings(self, [
            (self.layers >= 1, f"--layers must be >= 1, got {self.layers}"),
            (self.seq_len >= 2, f"--seq-len must be >= 2, got {self.seq_len}"),
            (self.top_k is None or self.top_k >= 1, f"--top-k must be >= 1, got {self.top_k}"),
        ])


# --------------------------------------------------------------------------------------------------- model


def make_draft(target, layers: int):
    """A model of the target's type with its first `layers` layers, final norm and embeddings / LM head,
    initialised from the target's weights; the embeddings and LM head are frozen."""
    import torch
    import transformers

    config = copy.deepcopy(target.config)
    config.num_hidden_layers = layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:layers]
    if hasattr(config, "quantization_config"):  # a GGUF target: the draft is saved dequantized
        del config.quantization_config
    draft = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    source = target.state_dict()
    weights = {}
    for name, tensor in draft.state_dict().items():
        if name not in source or source[name].shape != tensor.shape:
            raise UserError(f"cannot build the draft: target weight {name} missing or misshapen")
        weights[name] = source[name]
    draft.load_state_dict(weights, strict=True)
    draft.get_input_embeddings().weight.requires_grad_(False)
    draft.get_output_embeddings().weight.requires_grad_(False)
    return draft


def trainable(draft) -> dict:
    return {name: p for name, p in draft.named_parameters() if p.requires_grad}


def distill_loss(draft_logits, target_logits, top_k: int | None = None):
    """Sum over positions of KL(target || draft), at temperature 1.

    With top_k, the target's distribution is renormalised over its top_k tokens (the draft keeps its full
    softmax): a cheaper, still non-negative stand-in that is zero only when the draft matches there.
    """
    import torch
    import torch.nn.functional as F

    draft_logits = draft_logits.flatten(0, -2).float()
    target_logits = target_logits.flatten(0, -2).float()
    with torch.no_grad():
        if top_k:
            values, index = target_logits.topk(top_k, dim=-1)
            log_p = F.log_softmax(values, dim=-1)
        else:
            log_p = F.log_softmax(target_logits, dim=-1)
        p = log_p.exp()
        neg_entropy = (p * log_p).sum()
    log_q = F.log_softmax(draft_logits, dim=-1)
    if top_k:
        log_q = log_q.gather(-1, index)
    return neg_entropy - (p * log_q).sum()


def train_step(draft, target, optimizer, ids, micro: int, top_k: int | None) -> float:
    """One optimizer step (at the rate already set) on a batch [B, T] in micro-batches of `micro` rows; returns
    the mean KL per token."""
    import torch

    total = 0.0
    for chunk in ids.split(micro):
        with torch.no_grad():
            target_logits = target(chunk).logits
        loss = distill_loss(draft(chunk).logits, target_logits, top_k) / ids.numel()
        loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_([p for group in optimizer.param_groups for p in group["params"]], CLIP_NORM)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def evaluate(draft, target, sequences: list[list[int]], quiet: bool = True, desc: str = "eval") -> dict:
    """Teacher-forced over the sequences: how often the draft's top token is the target's, and the KL."""
    import torch
    agree = kl = tokens = 0
    with torch.no_grad():
        for seq in tqdm(sequences, desc=desc, disable=quiet, leave=False, file=sys.stderr):
            ids = torch.tensor([seq])
            t, d = target(ids).logits[0], draft(ids).logits[0]
            agree += (t.argmax(-1) == d.argmax(-1)).sum().item()
            kl += distill_loss(d, t).item()
            tokens += len(seq)
    return {"agreement": round(agree / max(tokens, 1), 4), "kl": round(kl / max(tokens, 1), 4),
            "sequences": len(sequences), "tokens": tokens}


def write_model(output: Path, draft, target, tokenizer) -> None:
    """OUTPUT/ as a Hugging Face model folder, each file written to a temp folder first, then moved in."""
    temp = output / "model.tmp"
    shutil.rmtree(temp, ignore_errors=True)
    draft.save_pretrained(temp)
    save_tokenizer(tokenizer, temp)
    save_generation_config(target.config, target.generation_config, temp)
    for file in temp.iterdir():
        os.replace(file, output / file.name)
    temp.rmdir()


# ------------------------------------------------------------------------------------------------------ main


def train(model_spec: str, output: Path, config: Config = Config(), *, resume: bool = False, overwrite: bool = False,
          quiet: bool = False) -> dict:
    """Distil a `config.layers`-layer draft of `model_spec` into `output`; returns what it writes to training.json.

    The budget is `config.minutes` of training steps (loading and the two evaluations come on top) and, if given,
    `config.steps`; the learning-rate schedule follows the steps when given, else the clock.
    """
    import torch

    output, c = Path(output), config
    c.check()
    source = resolve(model_spec)
    target_config = load_config(source)
    if c.layers >= target_config.num_hidden_layers:
        raise UserError(f"--layers must be below the target's {target_config.num_hidden_layers} layers, got {c.layers}")
    if c.top_k and c.top_k > target_config.vocab_size:
        raise UserError(f"--top-k must be at most the vocabulary size {target_config.vocab_size}, got {c.top_k}")
    train_set, heldout, data_name = sharegpt_split(c.data)
    prepare_output(output, resume, overwrite)
    settings = {"model": model_spec, "layers": c.layers, "batch": c.batch, "seq_len": c.seq_len, "lr": c.lr,
                "seed": c.seed, "top_k": c.top_k, "data": data_name, "conversations": len(train_set),
                "heldout": HELDOUT}

    log = logger(quiet)
    with torch_threads(c.threads):
        log(f"{data_name}: {len(train_set) + len(heldout)} conversations, training on the first {len(train_set)}, "
            f"the last {HELDOUT} held out")
        target, tokenizer = load_frozen_target(source, log)
        draft = make_draft(target, c.layers)
        params = trainable(draft)
        optimizer = torch.optim.AdamW(params.values(), lr=c.lr, betas=(0.9, 0.95), weight_decay=0.0)
        vocab = target.config.vocab_size
        micro = max(d for d in range(1, c.batch + 1)
                    if c.batch % d == 0 and (d == 1 or d * c.seq_len * vocab <= MICRO_ELEMENTS))
        held = eval_sequences(tokenizer, heldout, c.seq_len, EVAL_SEQUENCES)

        if resume:
            folder = checkpoint_dir(output)
            state = load_checkpoint(folder, trainable(draft), optimizer)
            same_settings(state["settings"], settings, RESUME_KEYS, folder)
            log(f"resuming at step {state['step']} ({state['tokens']} tokens, {state['seconds'] / 60:.1f} min)")
        else:
            state = {"settings": settings, "step": 0, "tokens": 0, "seconds": 0.0,
                     "data": {"epoch": 0, "index": 0, "offset": 0}, "losses": [],
                     "eval_before": evaluate(draft, target, held, quiet, "held-out eval (before)")}
        log(f"self:{c.layers} draft on {state['eval_before']['tokens']} held-out tokens: top-1 agreement "
            f"{state['eval_before']['agreement']:.1%}, KL {state['eval_before']['kl']:.3f}")
        state["settings"] = settings  # the same resume keys; minutes / steps may change between runs
        stream = TokenStream(tokenizer, train_set, c.seq_len, c.seed, state["data"])
        _train_loop(draft, target, optimizer, stream, state, output, c, micro=micro, quiet=quiet)

        after = evaluate(draft, target, held, quiet, "held-out eval (after)")
        write_model(output, draft, target, tokenizer)
        losses = state["losses"]
        record = {
            "method": "draft",
            "target": {"model": model_spec, "name": source.name, "layers": target_config.num_hidden_layers},
            "draft": {"layers": c.layers, "trained": f"layers 0-{c.layers - 1} and the final norm",
                      "frozen": "embeddings and LM head (the target's)"},
            "settings": {**settings, "minutes": c.minutes, "steps": c.steps, "micro_batch": micro,
                         "threads": torch.get_num_threads(), "save_every": c.save_every},
            "steps": state["step"],
            "tokens": state["tokens"],
            "seconds": round(state["seconds"], 1),
            "tokens_per_s": round(state["tokens"] / state["seconds"], 1) if state["seconds"] else None,
            "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4) if losses else None,
            "losses": losses,
            "data_position": state["data"],
            "eval": {"before": state["eval_before"], "after": after},
        }
        write_json(output / "training.json", record)
        log(f"after {state['step']} steps: top-1 agreement {after['agreement']:.1%}, KL {after['kl']:.3f}")
        return record


def summary(result: dict, output: Path) -> list[str]:
    """What the command prints after training."""
    before, after = result["eval"]["before"], result["eval"]["after"]
    return [(f"draft written to {output} ({result['draft']['layers']} layers, {result['steps']} steps, "
             f"{result['tokens']} tokens, {result['seconds'] / 60:.1f} min)"),
            (f"held-out top-1 agreement with the target: {before['agreement']:.1%} -> {after['agreement']:.1%}; "
             f"KL {before['kl']:.3f} -> {after['kl']:.3f} ({after['tokens']} tokens)")]


def _train_loop(draft, target, optimizer, stream, state, output, config: Config, *, micro, quiet) -> None:
    def step(number: int):
        start = time.monotonic()
        ids = stream.batch(config.batch)
        loss = train_step(draft, target, optimizer, ids, micro, config.top_k)
        shown = {"tok_s": f"{ids.numel() / (time.monotonic() - start):.0f}"}
        return loss, shown, {"tokens": state["tokens"] + ids.numel(), "data": stream.position}

    draft.train()
    run_steps(step, trainable(draft), optimizer, state, output, config, warmup=WARMUP_STEPS, desc="training",
              quiet=quiet)
    draft.eval()
