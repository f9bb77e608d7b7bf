"""Train Medusa heads on a frozen target (the Medusa-1 recipe), on a CPU.

Two phases, both resumable:

1. Features. The target runs once over the data and its final hidden states (after the final norm) are
   cached with each position's labels: head k (0-based) at position t learns token t + k + 2. Data is either
   `self` (`self_distill`, the default: the target's own greedy continuations of ShareGPT prompts, so the
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

import dataclasses
import time
from pathlib import Path

import numpy as np

from specexport.errors import UserError
from specexport.exporter.medusa import MedusaHeads, save_heads
from specexport.exporter.sources import load_config, resolve
from specexport.options import setting
from specexport.train import loop
from specexport.train.data import HELDOUT, eos_and_pad, feature_groups, greedy_continuations, sharegpt_split
from specexport.train.loop import (
    CLIP_NORM,
    WARMUP_STEPS,
    check_settings,
    feature_checks,
    load_frozen_target,
    logger,
    run_steps,
    torch_threads,
)
from specexport.train.output import (
    ChunkFolder,
    checkpoint_dir,
    feature_folder,
    load_checkpoint,
    run_record,
    same_settings,
    write_record,
)

DECAY = 0.8  # loss weight of head k: DECAY ** k
STYLES = ("shared", "own")
EVAL_SAMPLES = 64
RESUME_KEYS = ("model", "heads", "style", "data", "samples", "new_tokens", "prompt_tokens", "batch", "lr", "seed",
               "vocab_subset")


@dataclasses.dataclass(frozen=True)
class Config(loop.FeatureBudget):
    """How to train Medusa heads: the options of `specexport train --method medusa`."""

    minutes: float = loop.minutes(20.0)
    batch: int = loop.batch(2048)
    samples: int = loop.samples(1536)
    self_distill: bool = loop.self_distill()
    heads: int = setting(4, "medusa: number of heads.")
    head_style: str = setting("shared", "medusa: project through the target's LM head (shared, small files) or each "
                                        "head's own (own).")
    vocab_subset: int = setting(8192, "medusa: the most frequent tokens, scored per step besides the batch's "
                                      "labels, and the vocabulary the heads propose from.")

    def check(self) -> None:
        check_settings(self, [
            (1 <= self.heads <= 16, f"--heads must be 1..16, got {self.heads}"),
            (self.head_style in STYLES, f"--head-style must be one of {', '.join(STYLES)}, got {self.head_style!r}"),
            (self.vocab_subset >= 1, f"--vocab-subset must be >= 1, got {self.vocab_subset}"),
        ] + feature_checks(self))


# ------------------------------------------------------------------------------------------------ features


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

    def run(kind, group):
        if kind == "self":
            return greedy_continuations(model, group, new_tokens, eos, pad)
        return teacher_forced(model, group)

    def write(name, groups):
        return cache.write(name, [s for kind, group in groups for s in run(kind, group)], heads)

    cache.fill(feature_groups(tokenizer, heldout, EVAL_SAMPLES, settings["seed"] + 1, settings),
               feature_groups(tokenizer, train_set, settings["samples"], settings["seed"], settings),
               settings["samples"], write, log, quiet)


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


def train(model_spec: str, output: Path, config: Config = Config(), *, resume: bool = False, overwrite: bool = False,
          quiet: bool = False) -> dict:
    """Medusa heads for `model_spec` into `output`; returns what it writes to training.json.

    `config.samples` sequences of features (each a prompt's greedy continuation of up to `new_tokens` tokens when
    self-distilling, else a window of prompt_tokens + new_tokens tokens of ShareGPT text), then `config.minutes` of
    head training (and at most `config.steps` steps when given; the schedule follows the steps when given, else the
    clock).
    """
    import torch

    output, c = Path(output), config
    c.check()
    source = resolve(model_spec)
    load_config(source)  # a clear error for a folder that is not a model, before reading the data
    train_set, heldout, data_name = sharegpt_split(c.data)
    settings = {"model": model_spec, "heads": c.heads, "style": c.head_style,
                "data": "self" if c.self_distill else "sharegpt", "samples": c.samples, "new_tokens": c.new_tokens,
                "prompt_tokens": c.prompt_tokens, "batch": c.batch, "lr": c.lr, "seed": c.seed,
                "vocab_subset": c.vocab_subset, "feature_batch": c.feature_batch, "data_file": data_name,
                "conversations": len(train_set), "heldout": HELDOUT}
    features = feature_folder(output, settings, RESUME_KEYS, resume, overwrite)

    log = logger(quiet)
    with torch_threads(c.threads):
        log(f"{data_name}: {len(train_set) + len(heldout)} conversations, training on the first {len(train_set)}, "
            f"the last {HELDOUT} held out")
        target, tokenizer = load_frozen_target(source, log)
        lm_head = target.get_output_embeddings().weight.detach().float()
        vocab, hidden_size = lm_head.shape
        params = make_heads(c.heads, hidden_size, lm_head, c.head_style)
        optimizer = torch.optim.AdamW(params.values(), lr=c.lr, betas=(0.9, 0.95), weight_decay=0.0)
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
        subset = vocab_subset(labels.numpy(), c.vocab_subset, vocab)
        _train_loop(params, lm_head, optimizer, hidden, labels, subset, state, output, c, quiet=quiet)

        table = accuracy(params, lm_head, held_hidden, held_labels, subset)
        base = base_accuracy(lm_head, held_hidden, held_next)
        result = MedusaHeads(
            [[(params[f"{k}.0.linear.weight"].detach().numpy(), params[f"{k}.0.linear.bias"].detach().numpy())]
             for k in range(c.heads)],
            [params[f"{k}.1.weight"].detach().numpy() for k in range(c.heads)] if c.head_style == "own" else None,
            vocab_subset=subset.numpy())
        record = {
            "method": "medusa",
            "target": {"model": model_spec, "name": source.name, "vocab_size": vocab, "hidden_size": hidden_size},
            "settings": {**settings, "minutes": c.minutes, "steps": c.steps, "threads": torch.get_num_threads(),
                         "save_every": c.save_every},
            "rows": {"train": len(labels), "heldout": len(held_labels)},
            **run_record(state, feature_seconds, table, last=10),
        }
        record["base_lm_head_top1_on_heldout"] = base  # 1.0 (up to near-ties) for self-distilled data
        save_heads(result, output, {"vocab_size": vocab, "base_model": model_spec, "accuracy": table,
                                    "training": {k: record["settings"][k] for k in ("data", "samples", "style", "heads")}})
        write_record(output, record, log, "held-out accuracy (full vocabulary):",
                     (f"head {row['head']} ({row['predicts']}): top-1 {row['top1']:.1%}  top-5 {row['top5']:.1%}  "
                      f"({row['rows']} rows)" for row in table))
        return record


def summary(result: dict, output: Path) -> list[str]:
    """What the command prints after training."""
    return [(f"Medusa heads written to {output} ({len(result['accuracy'])} heads, {result['steps']} steps, "
             f"{result['rows']['train']} training rows, {result['seconds'] / 60:.1f} min of head training)"),
            "held-out accuracy: " + "; ".join(f"head {r['head']} top-1 {r['top1']:.1%} top-5 {r['top5']:.1%}"
                                              for r in result["accuracy"])]


def _train_loop(params, lm_head, optimizer, hidden, labels, subset, state, output, config: Config, *,
                quiet) -> None:
    import torch

    trainable = list(params.values())

    def step(number: int):
        rng = np.random.default_rng([config.seed, number])
        pick = torch.from_numpy(rng.integers(0, len(labels), min(config.batch, len(labels))))
        h, y = hidden[pick].float(), labels[pick]
        loss, parts = medusa_loss(params, lm_head, h, y, torch.unique(torch.cat([subset, y[y >= 0]])))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, CLIP_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item(), {"ce": " ".join(f"{c:.2f}" for c in parts)}, {"rows": state["rows"] + len(pick)}

    run_steps(step, params, optimizer, state, output, config, warmup=WARMUP_STEPS, desc="heads", quiet=quiet)
