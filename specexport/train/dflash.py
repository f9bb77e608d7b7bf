"""Train a DFlash block draft (arXiv 2602.06036) on a frozen target, on a CPU.

Two phases, both resumable, the first shared with the EAGLE-3 trainer (train/eagle_data.py): the target's
features of ShareGPT text and of its own continuations, cached in OUTPUT/features (here the inputs of the context
layers, concatenated, with the target's argmax and top tokens per position); then the draft. A training step
takes `batch` sequences and `anchors` random positions of each: a block is [the token at the anchor, mask x
(B - 1)] at the anchor's positions, seeing the context rows before the anchor (what the target had verified when
that token was committed) and its own rows; block row k learns the target's token k places after the anchor,
with the loss weight exp(-(k - 1) / gamma) (later rows matter less: a chain stops at its first miss), half
cross-entropy against the target's argmax and half against its top tokens (soft labels). All the blocks of a
sequence run in one call under a block-diagonal mask. The draft's layers start as the target's last layers (with
q/k norms added), fc picks the last context layer; the target's embeddings and LM head are used frozen and not
saved (z-lab's layout leaves them out).

The output is in z-lab's layout (config.json with `dflash_config`, bf16 model.safetensors): use it with
`build --method dflash --draft OUTPUT`. Example: `specexport train --method dflash --model smollm2-135m --output d`.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import ClassVar

import numpy as np

from specexport.exporter.arch import dims_from_config
from specexport.exporter.dflash import DFlashConfig, DFlashDraft, DFlashModule, save_dflash
from specexport.exporter.eagle import LAYER, default_aux_layers
from specexport.exporter.sources import load_config, resolve
from specexport.options import setting
from specexport.train import loop
from specexport.train.data import sharegpt_split
from specexport.train.eagle import bf16_matmuls
from specexport.train.eagle_data import SOFT_LABELS, cached_features
from specexport.train.output import checkpoint_dir, feature_folder, load_checkpoint, run_record, write_record

SOFT_WEIGHT = 0.5  # the loss: this much cross-entropy against the soft labels, the rest against the argmax
EVAL_STRIDE = 3  # held-out anchors: every third position of the generated text
EVAL_BLOCKS = 24  # blocks per evaluation call
CURVE_SAMPLES = 16  # held-out sequences scored at each checkpoint
RESUME_KEYS = ("model", "version", "self_share", "soft_labels", "new_tokens", "prompt_tokens", "seed",
               "aux_layers")  # the cached features depend on these (more samples only add chunks)


@dataclasses.dataclass(frozen=True)
class Config(loop.FeatureBudget):
    """How to train a DFlash draft: the options of `specexport train --method dflash`."""

    version: ClassVar[int] = 3  # the features are EAGLE-3's: the inputs of chosen layers, concatenated
    minutes: float = loop.minutes(35.0)
    batch: int = loop.batch(8)
    lr: float = loop.lr(6e-4)
    samples: int = loop.samples(2048)
    self_share: float = loop.self_share(0.25)
    block: int = setting(16, "dflash: the block's rows (the last committed token and block - 1 mask tokens: each "
                             "draft call proposes block - 1 tokens).")
    draft_layers: int = setting(1, "dflash: decoder layers of the draft (they start as the target's last layers).")
    context_layers: tuple[int, ...] | None = setting(None, "dflash: the target layers whose OUTPUTS make the "
                                                           "context, as z-lab's target_layer_ids (default: the "
                                                           "outputs of 1, L//2-1 and L-4).")
    anchors: int = setting(8, "dflash: blocks per sequence per step, at random positions of the generated text.")
    gamma: float = setting(7.0, "dflash: block row k's loss weight is exp(-(k-1)/gamma).")
    mask_token: int | None = setting(None, "dflash: the token id the block's mask rows carry (default: the "
                                           "tokenizer's mask token, else the last id of the vocabulary).")

    def inputs(self, layers: int) -> tuple[int, ...]:
        """The context layers in our meaning (layer inputs: z-lab's output ids + 1)."""
        if self.context_layers:
            return tuple(i + 1 for i in self.context_layers)
        return tuple(sorted({i for i in default_aux_layers(layers) if 0 < i < layers})) or (max(1, layers // 2),)

    def check(self, dims) -> None:
        outputs = [i - 1 for i in self.inputs(dims.layers)]
        loop.check_settings(self, [
            (2 <= self.block <= 64, f"--block must be in 2..64, got {self.block}"),
            (1 <= self.draft_layers <= dims.layers, f"--draft-layers must be in 1..{dims.layers}, got "
                                                    f"{self.draft_layers}"),
            (all(0 <= i < dims.layers - 1 for i in outputs) and len(set(outputs)) == len(outputs),
             f"--context-layers {outputs} must be distinct layers in 0..{dims.layers - 2} (the last layer's output "
             f"is not a feature)"),
            (1 <= self.anchors <= 256, f"--anchors must be in 1..256, got {self.anchors}"),
            (0 < self.gamma < math.inf, f"--gamma must be a finite number > 0, got {self.gamma}"),
            (self.mask_token is None or 0 <= self.mask_token < dims.vocab,
             f"--mask-token must be a token id in 0..{dims.vocab - 1}, got {self.mask_token}"),
            (0 <= self.self_share <= 1, f"--self-share must be in 0..1, got {self.self_share}"),
        ] + loop.feature_checks(self))


# ----------------------------------------------------------------------------------------------------- model


def init_draft(target, c: Config, inputs: tuple[int, ...], mask: int) -> DFlashDraft:
    """The draft's layers copied from the target's last `draft_layers` layers (q/k norms of ones where the target
    has none), fc reading the last context layer, norm = the target's final norm."""
    cfg = target.config
    dims = dims_from_config(cfg)
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    state = {k: v.detach().float().numpy() for k, v in target.state_dict().items()}
    first = dims.layers - c.draft_layers
    config = DFlashConfig(hidden=dims.hidden, intermediate=cfg.intermediate_size, heads=dims.heads,
                          kv_heads=dims.kv_heads, head_dim=dims.head_dim, rms_eps=dims.rms_eps, rope_theta=float(theta),
                          vocab=dims.vocab, layers=c.draft_layers, block=c.block, mask_token=mask,
                          target_layers=inputs, qkv_bias=f"model.layers.{first}.self_attn.q_proj.bias" in state)
    weights = {}
    for i in range(c.draft_layers):
        for part, key in LAYER.items():
            found = state.get(f"model.layers.{first + i}.{key}")
            if found is not None:
                weights[f"layers.{i}.{part}"] = found.copy()
            elif part in ("q_norm", "k_norm"):
                weights[f"layers.{i}.{part}"] = np.ones(dims.head_dim, np.float32)
    h = dims.hidden
    fc = np.zeros((h, h * len(inputs)), np.float32)
    fc[:, -h:] = np.eye(h, dtype=np.float32)
    weights.update(fc=fc, hidden_norm=np.ones(h, np.float32), norm=state["model.norm.weight"].copy())
    return DFlashDraft(config, weights)


def make_blocks(data: dict, rows: np.ndarray, c: DFlashConfig, anchors, max_len: int, mask: int):
    """Padded tensors for sequences `rows` with blocks at `anchors(row, lo, hi)` (positions in lo..hi): features
    [N, T, F], block ids [N, A, B], anchors [N, A], per block row 1..B-1 the label (the target's argmax, -100 where
    not counted) [N, A, B-1] and the soft labels (top ids and probabilities [N, A, B-1, K])."""
    import torch

    lengths = np.minimum(data["lengths"][rows], max_len)
    t, b = int(lengths.max()), c.block
    feats = np.zeros((len(rows), t, data["features"].shape[1]), np.float32)
    picked = [anchors(r, max(1, int(data["prompt_lens"][r])), int(n) - 2) for r, n in zip(rows, lengths)]
    a = max(1, max(len(p) for p in picked))
    k = data["top_ids"].shape[1]
    ids = np.full((len(rows), a, b), mask, np.int64)
    at = np.zeros((len(rows), a), np.int64)
    labels = np.full((len(rows), a, b - 1), -100, np.int64)
    soft_ids, soft_p = np.zeros((len(rows), a, b - 1, k), np.int64), np.zeros((len(rows), a, b - 1, k), np.float32)
    for i, (r, n, chosen) in enumerate(zip(rows, lengths, picked)):
        s, counted_from = data["starts"][r], max(0, int(data["prompt_lens"][r]) - 1)
        feats[i, :n] = data["features"][s:s + n]
        for j, anchor in enumerate(chosen):
            at[i, j] = anchor
            ids[i, j, 0] = data["tokens"][s + anchor]
            where = np.arange(anchor, min(anchor + b - 1, n))  # row k predicts the token after anchor + k - 1
            where = where[where >= counted_from]
            slots = where - anchor
            labels[i, j, slots] = data["argmax"][s + where]
            soft_ids[i, j, slots] = data["top_ids"][s + where]
            soft_p[i, j, slots] = np.exp(data["top_logp"][s + where].astype(np.float32))
    soft_p /= np.maximum(soft_p.sum(-1, keepdims=True), 1e-12)
    return tuple(map(torch.from_numpy, (feats, ids, at, labels, soft_ids, soft_p)))


def block_loss(module: DFlashModule, batch, gamma: float):
    """sum_k w_k (loss of row k) / sum_k w_k over the counted rows, w_k = exp(-(k-1)/gamma); also the argmax
    cross-entropy of rows 1..3, for the progress bar."""
    import torch

    feats, ids, at, labels, soft_ids, soft_p = batch
    hidden = module.blocks(module.context(feats), ids, at)[:, :, 1:]  # [N, A, B-1, h]
    counted = labels >= 0
    weight = torch.exp(-torch.arange(labels.shape[-1]).float() / gamma).expand(labels.shape)[counted]
    logp = (hidden[counted] @ module.lm_head.T).float().log_softmax(-1)
    hard = -logp.gather(-1, labels[counted][:, None])[:, 0]
    soft = -(soft_p[counted] * logp.gather(-1, soft_ids[counted])).sum(-1)
    loss = ((SOFT_WEIGHT * soft + (1 - SOFT_WEIGHT) * hard) * weight).sum() / weight.sum()
    rows = counted.nonzero()[:, -1]
    shown = [float(hard.detach()[rows == k].mean()) if bool((rows == k).any()) else float("nan") for k in range(3)]
    return loss, shown


def accuracy(module: DFlashModule, data: dict, max_len: int, mask: int, count: int | None = None) -> dict:
    """On (the first `count`) held-out sequences, blocks at every EVAL_STRIDE-th generated position: per block row
    the top-1 and top-5 against the target's argmax, and the mean accepted length of a chain (rows right in a row
    from the first; tau = 1 + that). Row k predicts t+k+1 in EAGLE's numbering (t: the last context row, t+1: the
    anchor, the token the target gave last)."""
    import torch

    c = module.c
    hits1, hits5, counts = np.zeros(c.block - 1), np.zeros(c.block - 1), np.zeros(c.block - 1)
    runs = []
    total = min(count or len(data["lengths"]), len(data["lengths"]))
    with torch.no_grad():
        for r in range(total):
            lo, hi = max(1, int(data["prompt_lens"][r])), int(min(data["lengths"][r], max_len)) - 2
            for part in range(lo, hi + 1, EVAL_STRIDE * EVAL_BLOCKS):
                chosen = np.arange(part, min(hi + 1, part + EVAL_STRIDE * EVAL_BLOCKS), EVAL_STRIDE)
                feats, ids, at, labels, _, _ = make_blocks(data, np.array([r]), c, lambda *_: chosen, max_len, mask)
                hidden = module.blocks(module.context(feats), ids, at)[0, :, 1:]
                top = (hidden @ module.lm_head.T).topk(5, -1).indices  # [A, B-1, 5]
                want = labels[0]
                valid = want >= 0
                ok = (top[..., 0] == want) & valid
                hits1 += ok.sum(0).numpy()
                hits5 += ((top == want[..., None]).any(-1) & valid).sum(0).numpy()
                counts += valid.sum(0).numpy()
                runs += ok.int().cumprod(-1).sum(-1).tolist()
    rows = [{"row": k + 1, "top1": round(float(hits1[k] / max(counts[k], 1)), 4),
             "top5": round(float(hits5[k] / max(counts[k], 1)), 4), "positions": int(counts[k])}
            for k in range(c.block - 1)]
    return {"rows": rows, "chain_tau": round(1 + float(np.mean(runs)) if runs else 1.0, 4), "blocks": len(runs)}


# ------------------------------------------------------------------------------------------------------ main


def train(model_spec: str, output: Path, config: Config = Config(), *, resume: bool = False,
          overwrite: bool = False, quiet: bool = False) -> dict:
    """A DFlash draft for `model_spec` into `output`; returns what it writes to training.json."""
    import torch

    output, c = Path(output), config
    source = resolve(model_spec)
    dims = dims_from_config(load_config(source))
    c.check(dims)
    inputs = c.inputs(dims.layers)
    train_set, heldout, data_name = sharegpt_split(c.data)
    max_len = c.prompt_tokens + c.new_tokens
    settings = {"model": model_spec, "version": Config.version, "self_share": c.self_share, "soft_labels": SOFT_LABELS,
                "data": "self", "samples": c.samples, "new_tokens": c.new_tokens, "prompt_tokens": c.prompt_tokens,
                "batch": c.batch, "lr": c.lr, "seed": c.seed, "aux_layers": list(inputs), "block": c.block,
                "draft_layers": c.draft_layers, "anchors": c.anchors, "gamma": c.gamma,
                "feature_batch": c.feature_batch, "data_file": data_name, "conversations": len(train_set)}
    features = feature_folder(output, settings, RESUME_KEYS, resume, overwrite)

    log = loop.logger(quiet)
    with loop.torch_threads(c.threads):
        target, tokenizer = loop.load_frozen_target(source, log)
        mask = c.mask_token if c.mask_token is not None else _mask_token(tokenizer, dims.vocab)
        settings["mask_token"] = mask
        data, held, feature_seconds = cached_features(target, tokenizer, train_set, heldout, features, settings, log,
                                                      quiet)
        log(f"{len(data['lengths'])} training sequences ({len(data['tokens'])} tokens), {len(held['lengths'])} held "
            f"out; context layers (outputs) {[i - 1 for i in inputs]}, mask token {mask}")
        embed = target.get_input_embeddings().weight.detach().float()
        head = target.get_output_embeddings().weight.detach().float()
        module = DFlashModule(init_draft(target, c, inputs, mask), embed, head, trainable=True)
        del target
        optimizer = torch.optim.AdamW(module.p.values(), lr=c.lr, betas=(0.9, 0.95), weight_decay=0.0)
        state = None
        if resume and checkpoint_dir(output) is not None:
            state = load_checkpoint(checkpoint_dir(output), module.p, optimizer)
            log(f"resuming at step {state['step']} ({state['seconds'] / 60:.1f} min of training)")
        if state is None:
            state = {"step": 0, "seconds": 0.0, "losses": [], "token_passes": 0, "curve": []}
        state["settings"] = settings

        def score(state):  # at every checkpoint: a point of the held-out curve
            table = accuracy(module, held, max_len, mask, CURVE_SAMPLES)
            state["curve"].append({"token_passes": state["token_passes"], "seconds": round(state["seconds"], 1),
                                   "chain_tau": table["chain_tau"], "top1": [r["top1"] for r in table["rows"][:4]]})

        _train_loop(module, optimizer, data, state, output, c, max_len=max_len, mask=mask, quiet=quiet, on_save=score)
        table = accuracy(module, held, max_len, mask)
        record = {
            "method": "dflash",
            "target": {"model": model_spec, "name": source.name, "vocab_size": dims.vocab, "hidden_size": dims.hidden,
                       "layers": dims.layers},
            "settings": {**settings, "minutes": c.minutes, "steps": c.steps, "threads": torch.get_num_threads(),
                         "bf16_autocast": bf16_matmuls()},
            "data": {"train_sequences": int(len(data["lengths"])), "train_tokens": int(len(data["tokens"])),
                     "heldout_sequences": int(len(held["lengths"]))},
            **run_record(state, feature_seconds, table["rows"], last=20),
            "chain_tau": table["chain_tau"], "curve": state["curve"], "token_passes": state["token_passes"],
        }
        save_dflash(module.to_draft(), output, {"base_model": model_spec, "accuracy": table["rows"][:4],
                                                "chain_tau": table["chain_tau"], "seconds": round(state["seconds"], 1),
                                                "token_passes": state["token_passes"]})
        write_record(output, record, log, "held-out accuracy against the target's greedy tokens:",
                     [f"row {r['row']} (t+{r['row'] + 1}): top-1 {r['top1']:.1%}  top-5 {r['top5']:.1%}  "
                      f"({r['positions']} positions)" for r in table["rows"]]
                     + [f"a chain of the block's top-1 tokens: tau {table['chain_tau']:.3f} over {table['blocks']} "
                        f"blocks"])
        return record


def _mask_token(tokenizer, vocab: int) -> int:
    found = getattr(tokenizer, "mask_token_id", None)
    return int(found) if isinstance(found, int) and 0 <= found < vocab else vocab - 1


def summary(result: dict, output: Path) -> list[str]:
    """What the command prints after training."""
    d = result["data"]
    return [(f"dflash draft written to {output} ({result['steps']} steps, {d['train_sequences']} sequences, "
             f"{d['train_tokens']} tokens, {result['seconds'] / 60:.1f} min of training)"),
            "held-out top-1 per block row: " + "; ".join(f"t+{r['row'] + 1} {r['top1']:.1%}"
                                                          for r in result["accuracy"][:6])
            + f"; a chain of top-1 tokens: tau {result['chain_tau']:.3f}"]


def _train_loop(module, optimizer, data, state, output, config: Config, *, max_len, mask, quiet, on_save) -> None:
    import torch

    bf16 = bf16_matmuls()
    count = len(data["lengths"])

    def step(number: int):
        rng = np.random.default_rng([config.seed, number])
        rows = rng.choice(count, min(config.batch, count), replace=False)

        def anchors(_, lo, hi):
            if hi < lo:
                return np.zeros(0, np.int64)
            return np.sort(rng.choice(np.arange(lo, hi + 1), config.anchors, replace=hi + 1 - lo < config.anchors))

        batch = make_blocks(data, rows, module.c, anchors, max_len, mask)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss, shown = block_loss(module, batch, config.gamma)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(module.p.values()), loop.CLIP_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        passes = state.get("token_passes", 0) + int((batch[3] >= 0).sum())
        return loss.item(), {"ce": " ".join(f"{v:.2f}" for v in shown)}, {"token_passes": passes}

    loop.run_steps(step, module.p, optimizer, state, output, config, warmup=loop.WARMUP_STEPS * 5, desc="dflash",
                   quiet=quiet, on_save=on_save)
