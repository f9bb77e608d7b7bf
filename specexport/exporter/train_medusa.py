"""Train Medusa heads on a frozen target (the Medusa-1 recipe), on a CPU.

Two phases, both resumable:

1. Features. The target runs once over the data and its final hidden states (after the final norm) are
   cached with each position's labels: head k (0-based) at position t learns token t + k + 2. Data is either
   `self` (self-distillation, the default: the target's own greedy continuations of ShareGPT prompts, so the
   labels are exactly what greedy verification will accept) or `sharegpt` (the conversations themselves,
   teacher-forced, as in Medusa-1). Chunks land in OUTPUT/features/ one by one.
2. Heads. ResBlocks start at the identity (zero weight, zero bias); the loss is sum_k 0.8^k * CE(head k). Each
   step draws `batch` cached positions (seeded by step, so a resumed run repeats an uninterrupted one) and
   scores them over a vocabulary subset: the `vocab_subset` most frequent labels plus every label in the
   batch, which keeps the step cheap on a CPU. The heads then propose from the `vocab_subset` most frequent
   labels only (saved with them: a sixth of the LM head on SmolLM2), and held-out accuracy is measured so.

Styles: `shared` heads project through the target's LM head (a few MB per head); `own` heads get their own
LM head, initialised from the target's and trained too (Medusa v0.1 / Medusa-2 layout).

OUTPUT/ gets our format (medusa_lm_head.safetensors + config.json with the per-head top-1/top-5 table) and
training.json; OUTPUT/checkpoint/ holds the trained weights and AdamW moments (safetensors) and the state.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from specexport.errors import UserError
from specexport.exporter.training import (CLIP_NORM, HELDOUT, WARMUP_STEPS, ChunkFolder, TokenStream, check_settings,
                                          checkpoint_dir, feature_folder, load_checkpoint, load_frozen_target, logger,
                                          run_record, run_steps, same_settings, sharegpt_split, torch_threads,
                                          write_record)

DECAY = 0.8  # loss weight of head k: DECAY ** k
DATA_KINDS = ("self", "sharegpt")
STYLES = ("shared", "own")
EVAL_SAMPLES = 64
RESUME_KEYS = ("model", "heads", "style", "data", "samples", "new_tokens", "prompt_tokens", "batch", "lr", "seed",
               "vocab_subset")


# ------------------------------------------------------------------------------------------------ features


def first_prompts(tokenizer, conversations: list[dict], max_tokens: int, seed: int) -> list[list[int]]:
    """Each conversation's first user turn as a chat prompt (with the assistant's generation prompt), in a
    seeded order, keeping those of at most `max_tokens` tokens; lazily, as a generator."""
    from jinja2 import TemplateError

    order = np.random.default_rng(seed).permutation(len(conversations))
    for index in order:
        turns = conversations[int(index)].get("conversations", [])
        text = next((t.get("value") for t in turns if t.get("from") in ("human", "user")), None)
        if not isinstance(text, str) or not text.strip() or len(text) > max_tokens * 16:
            continue
        messages = [{"role": "user", "content": text}]
        try:
            if getattr(tokenizer, "chat_template", None):
                rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            else:
                rendered = text
        except (TemplateError, ValueError, TypeError):
            continue
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        if 0 < len(ids) <= max_tokens:
            yield ids


def greedy_continuations(model, prompts: list[list[int]], new_tokens: int, eos: set[int], pad: int):
    """Greedy continuations of a batch of prompts (left-padded, one KV cache) and the final hidden states
    that produced them: per prompt (tokens [n], hidden [n, h]) where hidden[i] predicted tokens[i]."""
    import torch

    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    body, head = model.model, model.get_output_embeddings()
    tokens, hidden = [], []
    done = torch.zeros(len(prompts), dtype=torch.bool)
    cache = None
    with torch.no_grad():
        for _ in range(new_tokens):
            out = body(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            h = out.last_hidden_state[:, -1]
            nxt = head(h).argmax(-1)
            tokens.append(torch.where(done, pad, nxt))
            hidden.append(h.to(torch.float16))
            done = done | torch.tensor([int(t) in eos for t in nxt])
            if bool(done.all()):
                break
            ids, positions = nxt[:, None], positions[:, -1:] + 1
            mask = torch.cat([mask, torch.ones(len(prompts), 1, dtype=mask.dtype)], dim=1)
    tokens, hidden = torch.stack(tokens, 1), torch.stack(hidden, 1)
    out = []
    for b in range(len(prompts)):
        row = tokens[b].tolist()
        n = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        out.append((np.array(row[:n], np.int64), hidden[b, :n].numpy()))
    return out


def teacher_forced(model, windows: list[list[int]]):
    """(tokens [n], hidden [n, h]) per window, hidden[i] being the state that predicts tokens[i] (i >= 1)."""
    import torch

    with torch.no_grad():
        h = model.model(input_ids=torch.tensor(windows)).last_hidden_state.to(torch.float16)
    return [(np.array(w[1:], np.int64), h[b, :-1].numpy()) for b, w in enumerate(windows)]


def label_rows(tokens: np.ndarray, hidden: np.ndarray, heads: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training rows from one sequence: hidden[i] with labels[i, k] = tokens[i + k + 1] (-1 past the end) and
    the token it predicts itself, tokens[i]; rows with no label at all are dropped."""
    n = len(tokens)
    rows = max(n - 1, 0)
    labels = np.full((rows, heads), -1, np.int64)
    for k in range(heads):
        span = max(n - (k + 1), 0)
        labels[:span, k] = tokens[k + 1 : k + 1 + span]
    return hidden[:rows], labels, tokens[:rows]


class FeatureCache(ChunkFolder):
    """Chunks of (hidden fp16, labels, next) rows: chunk_NNNNN.safetensors and heldout.safetensors."""

    def write(self, name: str, sequences: list[tuple[np.ndarray, np.ndarray]], heads: int) -> int:
        parts = [label_rows(t, h, heads) for t, h in sequences]
        hidden = np.concatenate([p[0] for p in parts]) if parts else np.zeros((0, 0), np.float16)
        labels = np.concatenate([p[1] for p in parts]) if parts else np.zeros((0, heads), np.int64)
        nxt = np.concatenate([p[2] for p in parts]) if parts else np.zeros((0,), np.int64)
        self.save(name, {"hidden": np.ascontiguousarray(hidden), "labels": labels, "next": nxt})
        return len(labels)

    @staticmethod
    def read(files: list[Path]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(hidden, labels, next) of the files, concatenated (empty files skipped)."""
        from safetensors.numpy import load_file

        loaded = [x for x in (load_file(str(f)) for f in files) if len(x["labels"])]
        if not loaded:
            return np.zeros((0, 1), np.float16), np.zeros((0, 1), np.int64), np.zeros((0,), np.int64)
        return tuple(np.concatenate([x[key] for x in loaded]) for key in ("hidden", "labels", "next"))


def build_features(model, tokenizer, train_set, heldout, cache: FeatureCache, settings: dict, log, quiet: bool) -> None:
    """Fill the feature cache up to `samples` training sequences and the held-out set (resuming after the
    chunks already there)."""
    heads, new_tokens = settings["heads"], settings["new_tokens"]
    eos, pad = eos_and_pad(model, tokenizer)

    def run(group):
        if settings["data"] == "self":
            return greedy_continuations(model, group, new_tokens, eos, pad)
        return teacher_forced(model, group)

    def write(name, groups):
        return cache.write(name, [s for group in groups for s in run(group)], heads)

    cache.fill(feature_groups(tokenizer, heldout, EVAL_SAMPLES, settings["seed"] + 1, settings),
               feature_groups(tokenizer, train_set, settings["samples"], settings["seed"], settings),
               settings["samples"], write, log, quiet)


def feature_groups(tokenizer, source, count: int, seed: int, settings: dict):
    """The inputs of each feature chunk, `feature_batch` at a time, `count` in all: prompts (data "self") or
    ShareGPT windows (data "sharegpt"). Cheap to make, so a resume can skip the chunks already cached."""
    if settings["data"] == "self":
        items = first_prompts(tokenizer, source, settings["prompt_tokens"], seed)
    else:
        stream = TokenStream(tokenizer, source, settings["prompt_tokens"] + settings["new_tokens"], seed)
        items = iter(stream.window, None)
    while count > 0:
        group = [x for _, x in zip(range(min(settings["feature_batch"], count)), items)]
        if not group:
            return
        count -= len(group)
        yield group


def eos_and_pad(model, tokenizer) -> tuple[set[int], int]:
    """The target's end-of-sequence ids and the id to pad a batch with."""
    eos = set(_eos_ids(model, tokenizer))
    return eos, tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)


def _eos_ids(model, tokenizer) -> list[int]:
    ids = model.generation_config.eos_token_id if model.generation_config is not None else None
    ids = ids if isinstance(ids, list) else [ids] if ids is not None else []
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    if not ids:
        raise UserError("the target declares no end-of-sequence token")
    return sorted(set(ids))
# --------------------------------------------------------------------------------------------------- heads


def make_heads(heads: int, hidden: int, lm_head, style: str) -> dict:
    """Trainable parameters: per head a ResBlock at the identity, and (own style) an LM head copy."""
    import torch

    params = {}
    for k in range(heads):
        params[f"{k}.0.linear.weight"] = torch.zeros(hidden, hidden, requires_grad=True)
        params[f"{k}.0.linear.bias"] = torch.zeros(hidden, requires_grad=True)
        if style == "own":
            params[f"{k}.1.weight"] = lm_head.detach().clone().requires_grad_(True)
    return params


def resblocks(params: dict, k: int, x):
    import torch.nn.functional as F

    return x + F.silu(F.linear(x, params[f"{k}.0.linear.weight"], params[f"{k}.0.linear.bias"]))


def head_lm(params: dict, k: int, lm_head):
    return params.get(f"{k}.1.weight", lm_head)


def medusa_loss(params: dict, lm_head, hidden, labels, vocab_rows):
    """sum_k DECAY^k * mean CE of head k over the rows where it has a label, scored over `vocab_rows`
    (sorted token ids that include every label); also the per-head CE values."""
    import torch
    import torch.nn.functional as F

    total, parts = 0.0, []
    for k in range(labels.shape[1]):
        valid = labels[:, k] >= 0
        if not bool(valid.any()):
            parts.append(float("nan"))
            continue
        x = resblocks(params, k, hidden[valid])
        logits = x @ head_lm(params, k, lm_head)[vocab_rows].T
        target = torch.searchsorted(vocab_rows, labels[valid, k])
        ce = F.cross_entropy(logits, target)
        total = total + DECAY**k * ce
        parts.append(ce.item())
    return total, parts


RANKS = 10  # per-rank accuracy kept for tree construction (Medusa trees use ranks 0..9)


def accuracy(params: dict, lm_head, hidden, labels, subset=None, chunk: int = 512) -> list[dict]:
    """Per head, over the vocabulary it proposes from (`subset`, sorted token ids; None = all): top-1 and
    top-5 accuracy over the rows where it has a label, and how often the rank-r candidate is the label
    (r < RANKS), which is what a tree is built from."""
    import torch

    heads = labels.shape[1]
    hits = np.zeros((heads, RANKS))
    counts = np.zeros(heads)
    with torch.no_grad():
        for start in range(0, len(labels), chunk):
            h, y = hidden[start : start + chunk].float(), labels[start : start + chunk]
            for k in range(heads):
                valid = y[:, k] >= 0
                if not bool(valid.any()):
                    continue
                weight = head_lm(params, k, lm_head)
                weight = weight if subset is None else weight[subset]
                top = (resblocks(params, k, h[valid]) @ weight.T).topk(RANKS, dim=-1).indices
                top = top if subset is None else subset[top]
                hits[k] += (top == y[valid, k, None]).sum(0).numpy()
                counts[k] += int(valid.sum())
    rate = hits / np.maximum(counts, 1)[:, None]
    return [{"head": k, "predicts": f"t+{k + 2}", "top1": round(float(rate[k, 0]), 4),
             "top5": round(float(rate[k, :5].sum()), 4), "ranks": [round(float(x), 4) for x in rate[k]],
             "rows": int(counts[k])} for k in range(heads)]


def base_accuracy(lm_head, hidden, tokens_next) -> float:
    """How often the target's own LM head picks the cached next token (1.0 for self-distilled data)."""
    import torch

    with torch.no_grad():
        return round(float((hidden.float() @ lm_head.T).argmax(-1).eq(tokens_next).float().mean()), 4)


def vocab_subset(labels: np.ndarray, size: int, vocab: int):
    """The `size` most frequent labels (ties by id), as a sorted int64 tensor."""
    import torch

    counts = np.bincount(labels[labels >= 0].ravel(), minlength=vocab)
    top = np.argsort(-counts, kind="stable")[: min(size, vocab)]
    return torch.from_numpy(np.sort(top).astype(np.int64))


# ------------------------------------------------------------------------------------------------------ main


def _check_args(heads, style, data, samples, new_tokens, prompt_tokens, minutes, steps, batch, lr, subset,
                save_every, feature_batch):
    check_settings([
        (1 <= heads <= 16, f"--heads must be 1..16, got {heads}"),
        (style in STYLES, f"--head-style must be one of {', '.join(STYLES)}, got {style!r}"),
        (data in DATA_KINDS, f"--data must be one of {', '.join(DATA_KINDS)}, got {data!r}"),
        (subset >= 1, f"--vocab-subset must be >= 1, got {subset}"),
    ], samples=samples, new_tokens=new_tokens, prompt_tokens=prompt_tokens, minutes=minutes, steps=steps, batch=batch,
        lr=lr, save_every=save_every, feature_batch=feature_batch)


def train_medusa(model_spec: str, output: Path, *, heads: int = 4, style: str = "shared", data: str = "self",
                 samples: int = 1536, new_tokens: int = 128, prompt_tokens: int = 128, minutes: float = 20.0,
                 steps: int | None = None, batch: int = 2048, lr: float = 1e-3, seed: int = 0,
                 vocab_subset_size: int = 8192, save_every: int | None = None, feature_batch: int = 32,
                 resume: bool = False, overwrite: bool = False, data_path: Path | None = None,
                 threads: int | None = None, quiet: bool = False) -> dict:
    """Medusa heads for `model_spec` into `output`; returns what it writes to training.json.

    `samples` sequences of features (each a prompt's greedy continuation of up to `new_tokens` tokens for
    data="self", or a window of prompt_tokens + new_tokens tokens for data="sharegpt"), then `minutes` of head
    training (and at most `steps` steps when given; the schedule follows `steps` when given, else the clock).
    """
    import torch
    from specexport.exporter.medusa import MedusaHeads, save_heads
    from specexport.exporter.sources import load_config, resolve

    output = Path(output)
    _check_args(heads, style, data, samples, new_tokens, prompt_tokens, minutes, steps, batch, lr, vocab_subset_size,
                save_every, feature_batch)
    source = resolve(model_spec)
    load_config(source)  # a clear error for a folder that is not a model, before reading the data
    train_set, heldout, data_name = sharegpt_split(data_path)
    settings = {"model": model_spec, "heads": heads, "style": style, "data": data, "samples": samples,
                "new_tokens": new_tokens, "prompt_tokens": prompt_tokens, "batch": batch, "lr": lr, "seed": seed,
                "vocab_subset": vocab_subset_size, "feature_batch": feature_batch, "data_file": data_name,
                "conversations": len(train_set), "heldout": HELDOUT}
    features = feature_folder(output, settings, RESUME_KEYS, resume, overwrite)

    log = logger(quiet)
    with torch_threads(threads):
        log(f"{data_name}: {len(train_set) + len(heldout)} conversations, training on the first {len(train_set)}, "
            f"the last {HELDOUT} held out")
        target, tokenizer = load_frozen_target(source, log)
        lm_head = target.get_output_embeddings().weight.detach().float()
        vocab, hidden_size = lm_head.shape
        params = make_heads(heads, hidden_size, lm_head, style)
        optimizer = torch.optim.AdamW(params.values(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        state = None
        if resume and checkpoint_dir(output) is not None:
            folder = checkpoint_dir(output)
            state = load_checkpoint(folder, params, optimizer)
            same_settings(state["settings"], settings, RESUME_KEYS, folder)
            log(f"resuming at step {state['step']} ({state['seconds'] / 60:.1f} min of head training)")
        cache = FeatureCache(features)
        started = time.monotonic()
        build_features(target, tokenizer, train_set, heldout, cache, settings, log, quiet)
        feature_seconds = time.monotonic() - started
        hidden, labels, _ = (torch.from_numpy(a) for a in FeatureCache.read(cache.chunks()))
        held_hidden, held_labels, held_next = (torch.from_numpy(a)
                                               for a in FeatureCache.read([cache.folder / "heldout.safetensors"]))
        del target
        log(f"{len(labels)} training rows, {len(held_labels)} held-out rows")
        if not len(labels):
            raise UserError("the data gave no training rows (all prompts too long or empty?)")
        if state is None:
            state = {"settings": settings, "step": 0, "rows": 0, "seconds": 0.0, "losses": []}
        state["settings"] = settings
        subset = vocab_subset(labels.numpy(), vocab_subset_size, vocab)
        _train_loop(params, lm_head, optimizer, hidden, labels, subset, state, output, minutes=minutes, steps=steps,
                    batch=batch, lr=lr, seed=seed, save_every=save_every, quiet=quiet)

        table = accuracy(params, lm_head, held_hidden, held_labels, subset)
        base = base_accuracy(lm_head, held_hidden, held_next)
        result = MedusaHeads(
            [[(params[f"{k}.0.linear.weight"].detach().numpy(), params[f"{k}.0.linear.bias"].detach().numpy())]
             for k in range(heads)],
            [params[f"{k}.1.weight"].detach().numpy() for k in range(heads)] if style == "own" else None,
            vocab_subset=subset.numpy())
        summary = {
            "method": "medusa",
            "target": {"model": model_spec, "name": source.name, "vocab_size": vocab, "hidden_size": hidden_size},
            "settings": {**settings, "minutes": minutes, "steps": steps, "threads": torch.get_num_threads(),
                         "save_every": save_every},
            "rows": {"train": len(labels), "heldout": len(held_labels)},
            **run_record(state, feature_seconds, table, last=10),
        }
        summary["base_lm_head_top1_on_heldout"] = base  # 1.0 (up to near-ties) for self-distilled data
        save_heads(result, output, {"vocab_size": vocab, "base_model": model_spec, "accuracy": table,
                                    "training": {k: summary["settings"][k] for k in ("data", "samples", "style", "heads")}})
        write_record(output, summary, log, "held-out accuracy (full vocabulary):",
                     (f"head {row['head']} ({row['predicts']}): top-1 {row['top1']:.1%}  top-5 {row['top5']:.1%}  "
                      f"({row['rows']} rows)" for row in table))
        return summary


def _train_loop(params, lm_head, optimizer, hidden, labels, subset, state, output, *, minutes, steps, batch, lr,
                seed, save_every, quiet) -> None:
    import torch

    trainable = list(params.values())

    def step(number: int):
        rng = np.random.default_rng([seed, number])
        pick = torch.from_numpy(rng.integers(0, len(labels), min(batch, len(labels))))
        h, y = hidden[pick].float(), labels[pick]
        loss, parts = medusa_loss(params, lm_head, h, y, torch.unique(torch.cat([subset, y[y >= 0]])))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), {"ce": " ".join(f"{c:.2f}" for c in parts)}, {"rows": state["rows"] + len(pick)}

    run_steps(step, params, optimizer, state, output, minutes=minutes, steps=steps, lr=lr, warmup=WARMUP_STEPS,
              save_every=save_every, desc="heads", quiet=quiet)
