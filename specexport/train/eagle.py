"""Train an EAGLE draft (EAGLE-3 by default, or EAGLE-1/2) on a frozen target, on a CPU.

Two phases, both resumable:

1. Features. A mix (`self_share`) of the target's own greedy continuations of ShareGPT prompts (what the draft
   meets at run time, but decoding is slow) and ShareGPT conversation windows read teacher-forced (a prefill:
   many times cheaper per token). One teacher-forced pass over each sequence records, per position, the draft's
   input feature (EAGLE-3: the inputs of the three aux layers, concatenated; EAGLE-1: the last hidden state after
   the final norm), the target's argmax and its top SOFT_LABELS tokens with their log-probs. The held-out set is
   always the target's own continuations. Chunks land in OUTPUT/features/.
2. Draft. The EAGLE-3 training-time test: `ttt_steps` unrolled steps, step i feeding the draft its own output
   hidden from step i-1 and attending to the true prefix plus its own earlier steps at the same position, each
   predicting the target's next token i tokens further on; loss sum_i 0.8^i of the cross-entropy against the
   target's top-k distribution (soft labels, over the draft vocabulary) and against its argmax, half each
   (positions whose target argmax is outside the draft vocabulary do not count); EAGLE-1 adds the feature
   regression, SmoothL1, as in its paper. Only positions that predict
   a generated token (or any token of a text window) count. `init` starts from an earlier draft's weights (a
   warm restart: a long training carried across sessions through the committed fp16 weights).

EAGLE-3's reduced draft vocabulary (`draft_vocab` most frequent target tokens, the d2t map) keeps the draft's
LM head small. The result is saved in the published layout (model.safetensors + config.json).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import ClassVar

import numpy as np

from specexport.errors import UserError
from specexport.exporter.arch import dims_from_config
from specexport.exporter.drafts import load_draft
from specexport.exporter.eagle import DraftConfig, DraftModule, EagleDraft, default_aux_layers, save_draft
from specexport.exporter.sources import load_config, resolve
from specexport.options import setting
from specexport.train import loop
from specexport.train.data import sharegpt_split
from specexport.train.eagle_data import SOFT_LABELS, cached_features, draft_vocabulary, make_batch
from specexport.train.output import checkpoint_dir, feature_folder, load_checkpoint, run_record, write_record

DECAY = 0.8  # loss weight of unrolled step i: DECAY ** i
SOFT_WEIGHT = 0.5  # the loss: this much cross-entropy against the soft labels, the rest against the argmax
CURVE_SAMPLES = 16  # held-out sequences scored at each checkpoint (the accuracy curve)
LATEST = "latest"  # OUTPUT/latest/: the fp16 draft at the last checkpoint, what a long training carries on from
EAGLE1_FEATURE_WEIGHT, EAGLE1_TOKEN_WEIGHT = 1.0, 0.1  # EAGLE-1: SmoothL1 on features + CE on tokens
CLIP = 0.5
RESUME_KEYS = ("model", "version", "self_share", "soft_labels", "samples", "new_tokens", "prompt_tokens", "batch",
               "lr", "seed", "draft_vocab", "ttt_steps", "aux_layers", "init")


@dataclasses.dataclass(frozen=True)
class Config(loop.FeatureBudget):
    """How to train an EAGLE-1/2 draft: the options of `specexport train --method eagle`."""

    version: ClassVar[int] = 1
    minutes: float = loop.minutes(35.0)
    batch: int = loop.batch(16)
    lr: float = loop.lr(8e-4)
    samples: int = loop.samples(4096)
    ttt_steps: int = setting(4, "eagle, eagle3: unrolled training-time-test steps (each step drafts one token "
                                "further).")
    self_share: float = loop.self_share(0.25)
    init: Path | None = setting(None, "eagle, eagle3: start from this draft's weights (a warm restart, e.g. of the "
                                      "shipped draft); its draft vocabulary is kept.")

    def vocabulary(self, vocab: int) -> int:
        """The draft's vocabulary for a target of `vocab` tokens: EAGLE-1 drafts over all of them."""
        return vocab

    def aux(self, layers: int) -> tuple[int, ...]:
        """The target layers whose inputs make the draft's feature: none for EAGLE-1 (its last hidden state)."""
        return ()

    def check(self, vocab: int) -> None:
        draft_vocab = self.vocabulary(vocab)
        loop.check_settings(self, [
            (1 <= draft_vocab <= vocab, f"--draft-vocab must be in 1..{vocab}, got {draft_vocab}"),
            (1 <= self.ttt_steps <= 16, f"--ttt-steps must be in 1..16, got {self.ttt_steps}"),
            (0 <= self.self_share <= 1, f"--self-share must be in 0..1, got {self.self_share}"),
        ] + loop.feature_checks(self))


@dataclasses.dataclass(frozen=True)
class Config3(Config):
    """How to train an EAGLE-3 draft: the options of `specexport train --method eagle3`."""

    version: ClassVar[int] = 3
    draft_vocab: int = setting(8192, "eagle3: the draft's vocabulary, the most frequent target tokens (the d2t "
                                     "map).")
    aux_layers: tuple[int, ...] | None = setting(None, "eagle3: the target layers whose INPUTS make the feature, "
                                                       "e.g. 2,15,27 (default: 2, L//2, L-3).")

    def vocabulary(self, vocab: int) -> int:
        return self.draft_vocab

    def aux(self, layers: int) -> tuple[int, ...]:
        return tuple(self.aux_layers) if self.aux_layers else default_aux_layers(layers)


# ------------------------------------------------------------------------------------------------ features


def init_draft(target, version: int, aux: tuple[int, ...], hot: np.ndarray):
    """A fresh draft shaped like one target layer. EAGLE-3 starts from the target's own pieces where they fit:
    fc picks the highest feature, the LM head is the target's rows of the draft vocabulary, the final norm the
    target's; the layer itself starts small."""
    cfg = target.config
    h, vocab = cfg.hidden_size, cfg.vocab_size
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    hd = getattr(cfg, "head_dim", None) or h // heads
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    config = DraftConfig(version=version, hidden=h, intermediate=cfg.intermediate_size, heads=heads, kv_heads=kv,
                         head_dim=hd, rms_eps=dims_from_config(cfg).rms_eps, rope_theta=float(theta), vocab=vocab,
                         draft_vocab=len(hot) if version == 3 else vocab, target_hidden=h,
                         aux_layers=aux if version == 3 else (), fc_bias=version == 1)
    rng = np.random.default_rng(0)
    width = 2 * h if version == 3 else h

    def normal(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    layer = {"q": normal(heads * hd, width), "k": normal(kv * hd, width), "v": normal(kv * hd, width),
             "o": normal(h, heads * hd), "post_norm": np.ones(h, np.float32), "gate": normal(cfg.intermediate_size, h),
             "up": normal(cfg.intermediate_size, h), "down": normal(h, cfg.intermediate_size)}
    w = {f"layers.0.{k}": v for k, v in layer.items()}
    if version == 3:
        fc = normal(h, h * len(aux))
        fc[:, -h:] += np.eye(h, dtype=np.float32)
        head = target.get_output_embeddings().weight.detach().float().numpy()
        w.update(fc=fc, in_norm=np.ones(h, np.float32), hidden_norm=np.ones(h, np.float32),
                 norm=target.model.norm.weight.detach().float().numpy().copy(), lm_head=head[hot].copy())
        if len(hot) != vocab:
            w["d2t"] = hot - np.arange(len(hot))
    else:
        fc = normal(h, 2 * h)
        fc[:, h:] += np.eye(h, dtype=np.float32)
        w.update(fc=fc, fc_bias=np.zeros(h, np.float32))
    return EagleDraft(config, w)


def ttt_forward(module, feats, ids, positions, steps: int):
    """The unrolled training-time test: per step i, (output hidden [B, T, h], logits [B, T, Vd]). Step i at
    index t takes token ids[:, t + 1 + i] and attends to step 0's keys at positions <= t plus its own
    position's keys from steps 1..i."""
    import torch

    b, t = ids.shape
    hidden = module.start(feats)
    causal = torch.full((t, t), float("-inf")).triu(1)
    keys, values, outs = [], [], []
    scale = 1.0 / math.sqrt(module.c.head_dim)
    for i in range(steps):
        tokens = torch.nn.functional.pad(ids[:, 1 + i:], (0, 1 + i))[:, :t]
        residual, q, k, v = module.qkv(tokens, hidden, positions + i)
        k, v = module.expand_kv(k), module.expand_kv(v)
        keys.append(k)
        values.append(v)
        scores = [q @ keys[0].transpose(-1, -2) * scale + causal]
        scores += [((q * keys[j]).sum(-1, keepdim=True) * scale) for j in range(1, i + 1)]
        weights = torch.cat(scores, -1).softmax(-1)
        attn = weights[..., :t] @ values[0]
        for j in range(1, i + 1):
            attn = attn + weights[..., t + j - 1:t + j] * values[j]
        hidden = module.finish(residual, attn)
        outs.append((hidden, module.logits(hidden)))
    return outs


def draft_loss(module, batch, steps: int):
    """sum_i DECAY^i of step i's cross-entropy against the target's soft labels and its argmax (SOFT_WEIGHT; EAGLE-1
    adds its feature regression); also each step's cross-entropy against the argmax, for the progress bar."""
    import torch.nn.functional as F

    feats, ids, positions, labels, soft, _ = batch
    outs = ttt_forward(module, feats, ids, positions, steps)
    total, parts = 0.0, []
    for i, ((hidden, logits), lab, (soft_ids, soft_p)) in enumerate(zip(outs, labels, soft)):
        counted = lab >= 0
        if not bool(counted.any()):
            parts.append(float("nan"))
            continue
        logp = logits.float().log_softmax(-1)[counted]  # [N, Vd]
        hard = -logp.gather(-1, lab[counted][:, None]).mean()  # what greedy acceptance rewards: the argmax
        soft = -(soft_p[counted] * logp.gather(-1, soft_ids[counted])).sum(-1).mean()  # more signal per token
        loss = SOFT_WEIGHT * soft + (1 - SOFT_WEIGHT) * hard
        if module.c.version == 1:
            j = 1 + i
            valid = counted[:, :-j] if j < lab.shape[1] else None
            if valid is not None and bool(valid.any()):
                reg = F.smooth_l1_loss(hidden[:, :-j][valid], feats[:, j:][valid])
                loss = EAGLE1_FEATURE_WEIGHT * reg + EAGLE1_TOKEN_WEIGHT * loss
        total = total + DECAY ** i * loss
        parts.append(hard.item())
    return total, parts


def accuracy(module, data: dict, t2d: np.ndarray, steps: int, max_len: int, hot: np.ndarray,
             count: int | None = None) -> list[dict]:
    """Per unrolled step, on (the first `count`) held-out sequences: top-1 / top-5 of the draft against the
    target's argmax (a label outside the draft vocabulary counts as a miss), and the chance a whole chain of i+1
    drafts is right."""
    import torch

    hits1, hits5, counts, chain = np.zeros(steps), np.zeros(steps), np.zeros(steps), np.zeros(steps)
    total = min(count or len(data["lengths"]), len(data["lengths"]))
    with torch.no_grad():
        for start in range(0, total, 8):
            rows = np.arange(start, min(start + 8, total))
            batch = make_batch(data, rows, t2d, steps, max_len)
            feats, ids, positions, _, _, lengths = batch
            outs = ttt_forward(module, feats, ids, positions, steps)
            all_ok = None
            for i, (_, logits) in enumerate(outs):
                j = 1 + i
                top = torch.from_numpy(hot)[logits.topk(5, -1).indices]  # target ids
                want = np.full(ids.shape, -1, np.int64)
                for b, r in enumerate(rows):
                    s, n, p = data["starts"][r], int(lengths[b]), data["prompt_lens"][r]
                    seg = data["argmax"][s:s + n]
                    lo = max(0, p - 1)
                    idx = np.arange(n - j)
                    keep = idx + j >= lo
                    want[b, idx[keep]] = seg[idx[keep] + j]
                want = torch.from_numpy(want)
                valid = want >= 0
                ok1 = (top[..., 0] == want) & valid
                hits1[i] += int(ok1.sum())
                hits5[i] += int(((top == want[..., None]).any(-1) & valid).sum())
                counts[i] += int(valid.sum())
                all_ok = ok1 if all_ok is None else all_ok & ok1
                chain[i] += int(all_ok.sum())
    return [{"step": i, "predicts": f"t+{i + 2}", "top1": round(float(hits1[i] / max(counts[i], 1)), 4),
             "top5": round(float(hits5[i] / max(counts[i], 1)), 4),
             "chain": round(float(chain[i] / max(counts[0], 1)), 4), "positions": int(counts[i])}
            for i in range(steps)]


# ------------------------------------------------------------------------------------------------------ main


def train(model_spec: str, output: Path, config: Config = Config3(), *, resume: bool = False,
          overwrite: bool = False, quiet: bool = False) -> dict:
    """An EAGLE draft for `model_spec` into `output` (EAGLE-3 for a Config3, else EAGLE-1/2); returns what it writes
    to training.json."""
    import torch

    output, c, version = Path(output), config, config.version
    source = resolve(model_spec)
    dims = dims_from_config(load_config(source))
    c.check(dims.vocab)
    draft_vocab, aux = c.vocabulary(dims.vocab), c.aux(dims.layers)
    bad = [i for i in aux if not 0 <= i < dims.layers]
    if bad:
        raise UserError(f"--aux-layers {bad} out of range: the target has {dims.layers} layers")
    train_set, heldout, data_name = sharegpt_split(c.data)
    max_len = c.prompt_tokens + c.new_tokens
    settings = {"model": model_spec, "version": version, "self_share": c.self_share, "soft_labels": SOFT_LABELS,
                "data": "self", "init": str(c.init) if c.init else None, "samples": c.samples, "new_tokens": c.new_tokens, "prompt_tokens": c.prompt_tokens, "batch": c.batch,
                "lr": c.lr, "seed": c.seed, "draft_vocab": draft_vocab, "ttt_steps": c.ttt_steps,
                "aux_layers": list(aux), "feature_batch": c.feature_batch, "data_file": data_name,
                "conversations": len(train_set)}
    start = _initial_draft(c, version, dims, aux)
    if start is not None:
        aux, settings["aux_layers"], settings["draft_vocab"] = start.config.aux_layers, list(start.config.aux_layers), \
            start.config.draft_vocab
    # the features depend on these; more samples only add chunks after the cached ones
    features = feature_folder(output, settings, [k for k in RESUME_KEYS if k not in
                                                 ("batch", "lr", "ttt_steps", "draft_vocab", "samples", "init")],
                              resume, overwrite)

    log = loop.logger(quiet)
    with loop.torch_threads(c.threads):
        target, tokenizer = loop.load_frozen_target(source, log)
        train, held, feature_seconds = cached_features(target, tokenizer, train_set, heldout, features, settings, log,
                                                       quiet)
        counted = np.concatenate([train["argmax"][s + max(0, p - 1):s + n] for s, n, p in
                                  zip(train["starts"], train["lengths"], train["prompt_lens"])])
        hot = start.hot_ids if start is not None else draft_vocabulary(counted, draft_vocab, dims.vocab)
        t2d = np.full(dims.vocab, -1, np.int64)
        t2d[hot] = np.arange(len(hot))
        coverage = float(np.isin(counted, hot).mean())
        log(f"{len(train['lengths'])} training sequences ({len(train['tokens'])} tokens), {len(held['lengths'])} held out; "
            f"draft vocabulary {len(hot)} covers {coverage:.1%} of the target's tokens")

        embed = target.get_input_embeddings().weight.detach().float()
        head = target.get_output_embeddings().weight.detach().float()
        draft = start if start is not None else init_draft(target, version, aux, hot)
        module = DraftModule.from_draft(draft, embed, head, trainable=True)
        del target
        params = {k: v for k, v in module.p.items() if k != "d2t"}
        optimizer = torch.optim.AdamW(params.values(), lr=c.lr, betas=(0.9, 0.95), weight_decay=0.0)
        state = None
        if resume and checkpoint_dir(output) is not None:
            state = load_checkpoint(checkpoint_dir(output), params, optimizer)
            log(f"resuming at step {state['step']} ({state['seconds'] / 60:.1f} min of training)")
        if state is None:
            before = start.meta.get("training", {}) if start is not None else {}  # a warm restart carries these on
            state = {"step": 0, "seconds": 0.0, "losses": [], "token_passes": 0,
                     "earlier": {"token_passes": before.get("token_passes", 0), "seconds": before.get("seconds", 0.0)},
                     "curve": list(before.get("curve", []))}
        state["settings"] = settings

        def score(state):  # at every checkpoint: a point of the held-out accuracy curve, and the fp16 draft so far
            table = accuracy(module, held, t2d, c.ttt_steps, max_len, hot, CURVE_SAMPLES)
            state["curve"].append({"token_passes": state["earlier"]["token_passes"] + state["token_passes"],
                                   "seconds": round(state["earlier"]["seconds"] + state["seconds"], 1),
                                   "top1": [row["top1"] for row in table]})
            save_draft(module.to_draft(), output / LATEST, {"base_model": model_spec, "training": _totals(state)},
                       half=True)

        _train_loop(module, params, optimizer, train, t2d, state, output, c, max_len=max_len, quiet=quiet,
                    on_save=score)
        table = accuracy(module, held, t2d, c.ttt_steps, max_len, hot)
        record = {
            "method": f"eagle{version}" if version == 3 else "eagle",
            "target": {"model": model_spec, "name": source.name, "vocab_size": dims.vocab, "hidden_size": dims.hidden,
                       "layers": dims.layers},
            "settings": {**settings, "minutes": c.minutes, "steps": c.steps, "threads": torch.get_num_threads(),
                         "bf16_autocast": bf16_matmuls()},
            "data": {"train_sequences": int(len(train["lengths"])), "train_tokens": int(len(train["tokens"])),
                     "heldout_sequences": int(len(held["lengths"])), "draft_vocab_coverage": round(coverage, 4)},
            **run_record(state, feature_seconds, table, last=20),
            "training": _totals(state),
        }
        save_draft(module.to_draft(), output, {"accuracy": table, "base_model": model_spec,
                                               "draft_vocab_coverage": round(coverage, 4), "training": _totals(state)})
        write_record(output, record, log, "held-out accuracy against the target's greedy tokens:",
                     (f"step {row['step']} ({row['predicts']}): top-1 {row['top1']:.1%}  top-5 {row['top5']:.1%}  "
                      f"whole chain right {row['chain']:.1%}  ({row['positions']} positions)" for row in table))
        return record


def _initial_draft(c: Config, version: int, dims, aux: tuple[int, ...]) -> EagleDraft | None:
    """The draft a warm restart starts from (`c.init`), checked against the target and the settings."""
    if c.init is None:
        return None
    draft = load_draft(c.init, dims.layers)
    if draft.config.version != version:
        raise UserError(f"--init {c.init} is an EAGLE-{draft.config.version} draft, not EAGLE-{version}")
    d = draft.config
    if d.layers != 1 or d.norm_output or d.norm_before_residual or d.feature_norm or not d.hidden_norm \
            or not d.final_norm:
        raise UserError(f"--init {c.init}: training carries on one-layer drafts of the EAGLE reference's shape; this "
                        f"{d.producer} draft has {d.layers} layer(s) or EAGLE 3.1 norms")
    draft.check(dims, str(c.init))
    given = getattr(c, "aux_layers", None)
    if given and tuple(given) != tuple(draft.config.aux_layers):
        raise UserError(f"--aux-layers {list(given)} differ from --init's {list(draft.config.aux_layers)}")
    return draft


def _totals(state: dict) -> dict:
    """What a warm restart carries on: token-passes and seconds of training in all, and the accuracy curve."""
    return {"token_passes": state["earlier"]["token_passes"] + state["token_passes"],
            "seconds": round(state["earlier"]["seconds"] + state["seconds"], 1), "curve": state["curve"]}


def summary(result: dict, output: Path) -> list[str]:
    """What the command prints after training."""
    d = result["data"]
    return [(f"{result['method']} draft written to {output} ({result['steps']} steps, {d['train_sequences']} "
             f"sequences, {d['train_tokens']} tokens, {result['seconds'] / 60:.1f} min of training; draft vocabulary "
             f"covers {d['draft_vocab_coverage']:.1%})"),
            "held-out top-1 per drafted token: " + "; ".join(f"t+{r['step'] + 2} {r['top1']:.1%}"
                                                             for r in result["accuracy"])]


def bf16_matmuls() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX): then training autocasts to bf16, ~1.8x faster
    on the matmuls (weights, optimizer state and the loss stay fp32)."""
    import torch

    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except AttributeError:
        return False


def _train_loop(module, params, optimizer, data, t2d, state, output, config: Config, *, max_len, quiet,
                on_save=None) -> None:
    import torch

    bf16 = bf16_matmuls()
    trainable = list(params.values())
    count = len(data["lengths"])

    def step(number: int):
        rows = np.random.default_rng([config.seed, number]).choice(count, min(config.batch, count), replace=False)
        batch = make_batch(data, rows, t2d, config.ttt_steps, max_len)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, parts = draft_loss(module, batch, config.ttt_steps)
        loss.backward()
        torch.nn.utils.clip_grad_value_(trainable, CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        passes = state.get("token_passes", 0) + int(batch[-1].sum())  # tokens through one training step each
        return loss.item(), {"ce": " ".join(f"{c:.2f}" for c in parts)}, {"token_passes": passes}

    loop.run_steps(step, params, optimizer, state, output, config, warmup=loop.WARMUP_STEPS * 5, desc="draft",
                   quiet=quiet, on_save=on_save)
