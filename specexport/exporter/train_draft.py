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
import os
import shutil
import sys
import time
from pathlib import Path

from specexport.errors import UserError
from specexport.exporter.training import (CLIP_NORM, check_settings, HELDOUT, WARMUP_STEPS, TokenStream, checkpoint_dir,
                                          eval_sequences, load_checkpoint, load_frozen_target, logger, prepare_output,
                                          run_steps, same_settings, sharegpt_split, torch_threads, write_json)

EVAL_SEQUENCES = 100  # held-out sequences for the before/after agreement
MICRO_ELEMENTS = 2**25  # logits elements per micro-batch: one [tokens, vocab] fp32 tensor of 128 MB
RESUME_KEYS = ("model", "layers", "batch", "seq_len", "lr", "seed", "top_k", "data", "conversations")


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
    from tqdm import tqdm

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
    from specexport.exporter.sources import save_generation_config, save_tokenizer

    temp = output / "model.tmp"
    shutil.rmtree(temp, ignore_errors=True)
    draft.save_pretrained(temp)
    save_tokenizer(tokenizer, temp)
    save_generation_config(target, temp)
    for file in temp.iterdir():
        os.replace(file, output / file.name)
    temp.rmdir()


# ------------------------------------------------------------------------------------------------------ main


def _check_args(layers, minutes, steps, batch, seq_len, lr, top_k, save_every):
    check_settings([
        (layers >= 1, f"--layers must be >= 1, got {layers}"),
        (seq_len >= 2, f"--seq-len must be >= 2, got {seq_len}"),
        (top_k is None or top_k >= 1, f"--top-k must be >= 1, got {top_k}"),
    ], minutes=minutes, steps=steps, batch=batch, lr=lr, save_every=save_every)


def train_draft(model_spec: str, output: Path, *, layers: int = 4, minutes: float = 30.0, steps: int | None = None,
                batch: int = 8, seq_len: int = 256, lr: float = 1e-3, seed: int = 0, top_k: int | None = None,
                save_every: int | None = None, resume: bool = False, overwrite: bool = False,
                data_path: Path | None = None, threads: int | None = None, quiet: bool = False) -> dict:
    """Distil a `layers`-layer draft of `model_spec` into `output`; returns what it writes to training.json.

    The budget is `minutes` of training steps (loading and the two evaluations come on top) and, if given,
    `steps`; the learning-rate schedule follows `steps` when given, else the clock. `save_every`: checkpoint
    every that many steps (default: every 5 minutes, and at the end). `threads`: torch threads (default: all
    cores; on a busy machine 1 is often several times faster, as every parallel region waits for a preempted
    thread).
    """
    import torch

    from specexport.exporter.sources import load_config, resolve

    output = Path(output)
    _check_args(layers, minutes, steps, batch, seq_len, lr, top_k, save_every)
    source = resolve(model_spec)
    config = load_config(source)
    if layers >= config.num_hidden_layers:
        raise UserError(f"--layers must be below the target's {config.num_hidden_layers} layers, got {layers}")
    if top_k and top_k > config.vocab_size:
        raise UserError(f"--top-k must be at most the vocabulary size {config.vocab_size}, got {top_k}")
    train_set, heldout, data_name = sharegpt_split(data_path)
    prepare_output(output, resume, overwrite)
    settings = {"model": model_spec, "layers": layers, "batch": batch, "seq_len": seq_len, "lr": lr, "seed": seed,
                "top_k": top_k, "data": data_name, "conversations": len(train_set), "heldout": HELDOUT}

    log = logger(quiet)
    with torch_threads(threads):
        log(f"{data_name}: {len(train_set) + len(heldout)} conversations, training on the first {len(train_set)}, "
            f"the last {HELDOUT} held out")
        target, tokenizer = load_frozen_target(source, log)
        draft = make_draft(target, layers)
        params = trainable(draft)
        optimizer = torch.optim.AdamW(params.values(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        vocab = target.config.vocab_size
        micro = max(d for d in range(1, batch + 1) if batch % d == 0 and (d == 1 or d * seq_len * vocab <= MICRO_ELEMENTS))
        held = eval_sequences(tokenizer, heldout, seq_len, EVAL_SEQUENCES)

        if resume:
            folder = checkpoint_dir(output)
            state = load_checkpoint(folder, trainable(draft), optimizer)
            same_settings(state["settings"], settings, RESUME_KEYS, folder)
            log(f"resuming at step {state['step']} ({state['tokens']} tokens, {state['seconds'] / 60:.1f} min)")
        else:
            state = {"settings": settings, "step": 0, "tokens": 0, "seconds": 0.0,
                     "data": {"epoch": 0, "index": 0, "offset": 0}, "losses": [],
                     "eval_before": evaluate(draft, target, held, quiet, "held-out eval (before)")}
        log(f"self:{layers} draft on {state['eval_before']['tokens']} held-out tokens: top-1 agreement "
            f"{state['eval_before']['agreement']:.1%}, KL {state['eval_before']['kl']:.3f}")
        state["settings"] = settings  # the same resume keys; minutes / steps may change between runs
        stream = TokenStream(tokenizer, train_set, seq_len, seed, state["data"])
        _train_loop(draft, target, optimizer, stream, state, output, minutes=minutes, steps=steps, batch=batch,
                    lr=lr, micro=micro, top_k=top_k, save_every=save_every, quiet=quiet)

        after = evaluate(draft, target, held, quiet, "held-out eval (after)")
        write_model(output, draft, target, tokenizer)
        losses = state["losses"]
        summary = {
            "method": "draft",
            "target": {"model": model_spec, "name": source.name, "layers": config.num_hidden_layers},
            "draft": {"layers": layers, "trained": f"layers 0-{layers - 1} and the final norm",
                      "frozen": "embeddings and LM head (the target's)"},
            "settings": {**settings, "minutes": minutes, "steps": steps, "micro_batch": micro,
                         "threads": torch.get_num_threads(), "save_every": save_every},
            "steps": state["step"],
            "tokens": state["tokens"],
            "seconds": round(state["seconds"], 1),
            "tokens_per_s": round(state["tokens"] / state["seconds"], 1) if state["seconds"] else None,
            "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4) if losses else None,
            "losses": losses,
            "data_position": state["data"],
            "eval": {"before": state["eval_before"], "after": after},
        }
        write_json(output / "training.json", summary)
        log(f"after {state['step']} steps: top-1 agreement {after['agreement']:.1%}, KL {after['kl']:.3f}")
        return summary


def _train_loop(draft, target, optimizer, stream, state, output, *, minutes, steps, batch, lr, micro, top_k,
                save_every, quiet) -> None:
    def step(number: int):
        start = time.monotonic()
        ids = stream.batch(batch)
        loss = train_step(draft, target, optimizer, ids, micro, top_k)
        shown = {"tok_s": f"{ids.numel() / (time.monotonic() - start):.0f}"}
        return loss, shown, {"tokens": state["tokens"] + ids.numel(), "data": stream.position}

    draft.train()
    run_steps(step, trainable(draft), optimizer, state, output, minutes=minutes, steps=steps, lr=lr,
              warmup=WARMUP_STEPS, save_every=save_every, desc="training", quiet=quiet)
    draft.eval()
