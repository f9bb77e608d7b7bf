"""The EAGLE trainer's data: the target's features of ShareGPT text and of its own continuations (cached in chunks),
and the padded training batches made of them, with hard and soft labels per unrolled step."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import load_file

from specexport.train.data import eos_and_pad, feature_groups, greedy_continuations
from specexport.train.output import ChunkFolder

SOFT_LABELS = 8  # the target's top tokens kept per position as soft labels
EVAL_SAMPLES = 48  # held-out sequences (the target's own continuations)


def sequence_features(model, sequences: list[list[int]], prompt_lens: list[int], aux: tuple[int, ...], version: int):
    """Teacher-forced features of whole sequences: per sequence (features [n, F] fp16, target argmax [n], its top
    SOFT_LABELS ids [n, K] int32 and log-probs [n, K] fp16)."""
    import torch

    longest = max(len(s) for s in sequences)
    ids = torch.tensor([s + [0] * (longest - len(s)) for s in sequences])
    mask = torch.tensor([[1] * len(s) + [0] * (longest - len(s)) for s in sequences])
    head = model.get_output_embeddings()
    with torch.no_grad():
        out = model.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        states = out.hidden_states
        feats = torch.cat([states[i] for i in aux], -1) if version == 3 else states[-1]
        result = []
        for b, s in enumerate(sequences):
            n = len(s)
            logp = head(states[-1][b, :n]).float().log_softmax(-1)
            top = logp.topk(SOFT_LABELS, -1)
            result.append((feats[b, :n].to(torch.float16).numpy(), top.indices[:, 0].numpy().astype(np.int64),
                           top.indices.numpy().astype(np.int32), top.values.to(torch.float16).numpy()))
    return result


class FeatureChunks(ChunkFolder):
    """Chunks of sequences: tokens, starts, lengths, prompt_lens, features (fp16), argmax, top_ids, top_logp."""

    def write(self, name: str, sequences, prompt_lens, feats) -> int:
        lengths = [len(s) for s in sequences]
        self.save(name, {"tokens": np.concatenate([np.asarray(s, np.int64) for s in sequences]),
                         "starts": np.cumsum([0] + lengths[:-1]).astype(np.int64),
                         "lengths": np.asarray(lengths, np.int64), "prompt_lens": np.asarray(prompt_lens, np.int64),
                         "features": np.ascontiguousarray(np.concatenate([f[0] for f in feats])),
                         "argmax": np.concatenate([f[1] for f in feats]),
                         "top_ids": np.concatenate([f[2] for f in feats]),
                         "top_logp": np.concatenate([f[3] for f in feats])})
        return int(sum(lengths))

    @staticmethod
    def read(files: list[Path]) -> dict:
        parts = [load_file(str(f)) for f in files]
        parts = [p for p in parts if len(p["lengths"])]
        if not parts:
            return {}
        offset, starts = 0, []
        for p in parts:
            starts.append(p["starts"] + offset)
            offset += len(p["tokens"])
        keys = ("tokens", "lengths", "prompt_lens", "features", "argmax", "top_ids", "top_logp")
        data = {k: np.concatenate([p[k] for p in parts]) for k in keys}
        data["starts"] = np.concatenate(starts)
        return data


def build_features(model, tokenizer, train_set, heldout, cache: FeatureChunks, settings: dict, log, quiet: bool) -> None:
    """Fill the cache up to `samples` training sequences and the held-out set (resuming after existing chunks)."""
    new_tokens = settings["new_tokens"]
    aux, version = tuple(settings["aux_layers"]), settings["version"]
    eos, pad = eos_and_pad(model, tokenizer)

    def write(name, groups):
        sequences, prompt_lens = [], []
        for kind, group in groups:
            if kind == "self":  # the target's continuation; only the generated tokens are labels
                made = greedy_continuations(model, group, new_tokens, eos, pad)
                sequences += [p + t.tolist() for p, (t, _) in zip(group, made)]
                prompt_lens += [len(p) for p in group]
            else:  # a window of text: every token is a label
                sequences, prompt_lens = sequences + group, prompt_lens + [1] * len(group)
        return cache.write(name, sequences, prompt_lens, sequence_features(model, sequences, prompt_lens, aux, version))

    share = settings["self_share"]
    cache.fill(feature_groups(tokenizer, heldout, EVAL_SAMPLES, settings["seed"] + 1, settings, share=1.0),
               feature_groups(tokenizer, train_set, settings["samples"], settings["seed"], settings, share=share),
               settings["samples"], write, log, quiet)


def cached_features(model, tokenizer, train_set, heldout, features: Path, settings: dict, log,
                    quiet: bool) -> tuple[dict, dict, float]:
    """(training data, held-out data, seconds spent making features): the cache in `features` filled as
    `build_features` says, then read; one line where the data gave no training sequence."""
    import time

    from specexport.errors import UserError

    cache = FeatureChunks(features)
    started = time.monotonic()
    build_features(model, tokenizer, train_set, heldout, cache, settings, log, quiet)
    seconds = time.monotonic() - started
    train = FeatureChunks.read(cache.chunks())
    if not train:
        raise UserError("the data gave no training sequences (all prompts too long or empty?)")
    return train, FeatureChunks.read([features / "heldout.safetensors"]), seconds


# --------------------------------------------------------------------------------------------------- model


def draft_vocabulary(argmax: np.ndarray, size: int, vocab: int) -> np.ndarray:
    """The `size` most frequent target tokens (ties by id), sorted ascending: draft id -> target id."""
    counts = np.bincount(argmax, minlength=vocab)
    return np.sort(np.argsort(-counts, kind="stable")[: min(size, vocab)]).astype(np.int64)


def make_batch(data: dict, rows: np.ndarray, t2d: np.ndarray, steps: int, max_len: int):
    """Padded tensors for sequences `rows`: features, ids, positions, per step the labels (draft ids of the target's
    argmax, -100 where not counted or outside the draft vocabulary) and the soft labels (the target's top tokens as
    draft ids, -1 outside it, and their probabilities renormalised over those inside), and the lengths."""
    import torch

    lengths = np.minimum(data["lengths"][rows], max_len)
    t, k = int(lengths.max()), data["top_ids"].shape[1]
    feats = np.zeros((len(rows), t, data["features"].shape[1]), np.float32)
    ids = np.zeros((len(rows), t), np.int64)
    top_ids = np.zeros((len(rows), t, k), np.int64)
    top_logp = np.full((len(rows), t, k), -np.inf, np.float32)
    counted = np.zeros((len(rows), t), bool)
    for b, (r, n) in enumerate(zip(rows, lengths)):
        s = data["starts"][r]
        feats[b, :n] = data["features"][s:s + n]
        ids[b, :n] = data["tokens"][s:s + n]
        top_ids[b, :n] = data["top_ids"][s:s + n]
        top_logp[b, :n] = data["top_logp"][s:s + n]
        counted[b, max(0, data["prompt_lens"][r] - 1):n] = True  # labels that predict a generated token
    draft_ids = t2d[top_ids]  # [B, T, K]: -1 outside the draft vocabulary
    probs = np.where(draft_ids >= 0, np.exp(top_logp), 0.0)
    probs = probs / np.maximum(probs.sum(-1, keepdims=True), 1e-12)
    labels, soft = [], []
    for i in range(steps):
        j = 1 + i  # step i at index t predicts the target's token after t + j
        first = draft_ids[:, j:, 0]  # the target's argmax, as a draft id
        lab = np.full((len(rows), t), -100, np.int64)
        lab[:, :t - j] = np.where(counted[:, j:] & (first >= 0), first, -100)
        soft_ids, soft_p = np.zeros((len(rows), t, k), np.int64), np.zeros((len(rows), t, k), np.float32)
        soft_ids[:, :t - j], soft_p[:, :t - j] = np.maximum(draft_ids[:, j:], 0), probs[:, j:]
        labels.append(torch.from_numpy(lab))
        soft.append((torch.from_numpy(soft_ids), torch.from_numpy(soft_p)))
    return (torch.from_numpy(feats), torch.from_numpy(ids), torch.arange(t)[None].expand(len(rows), t), labels, soft,
            torch.from_numpy(lengths))
