"""DFlash block drafters (arXiv 2602.06036; z-lab/dflash, dflash/model.py): one draft call proposes a whole block.

The target's hidden states at a few layers (`target_layer_ids`, layer OUTPUTS in z-lab's files: our layer inputs
+ 1) are concatenated and fused, ctx = hidden_norm(fc(cat(...))), one row per committed token. The block is
[the last committed token, mask token x (B - 1)] at the positions after the context; through `layers` Qwen3
decoder layers whose attention takes its queries from the block and its keys and values from the context rows
(each layer's own k_proj / v_proj over ctx, k_norm, RoPE at their positions) and from the block itself, with no
mask (every block row sees the whole context and the whole block); the final norm and the target's LM head score
block rows 1..B-1, the draft tokens for the B - 1 positions after the last committed one.

Published layout (config.json: `architectures ["DFlashDraftModel"]`, Qwen3 keys, `block_size` at the top or in
`dflash_config`, `dflash_config: {mask_token_id, target_layer_ids}`; model.safetensors: `fc.weight [h, n h]`,
`hidden_norm.weight`, `norm.weight`, `layers.{i}.*` of a Qwen3 decoder layer with `self_attn.{q,k}_norm`; no
embeddings or LM head: the target's). Weights here use eagle.py's per-layer names plus `fc`, `hidden_norm`, `norm`.

Example: `load_dflash("Qwen3-8B-DFlash-b16", target_layers=36).config.block == 16`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specexport.errors import UserError
from specexport.exporter.drafts.common import decoder_fields, number, read_tensors
from specexport.exporter.eagle import LAYER, draft_rope

PRODUCER = "z-lab"


@dataclass
class DFlashConfig:
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    vocab: int
    layers: int
    block: int  # B: the block's rows, the last committed token and B - 1 mask tokens
    mask_token: int
    target_layers: tuple[int, ...]  # the target layers whose INPUTS make the context (z-lab's ids + 1)
    rope_scaling: dict | None = None
    qkv_bias: bool = False
    producer: str = PRODUCER


def shapes(c: DFlashConfig) -> dict[str, tuple[int, ...]]:
    q, kv, h = c.heads * c.head_dim, c.kv_heads * c.head_dim, c.hidden
    out = {"fc": (h, h * len(c.target_layers)), "hidden_norm": (h,), "norm": (h,)}
    for i in range(c.layers):
        p = f"layers.{i}."
        out.update({p + "q": (q, h), p + "k": (kv, h), p + "v": (kv, h), p + "o": (h, q), p + "q_norm": (c.head_dim,),
                    p + "k_norm": (c.head_dim,), p + "attn_norm": (h,), p + "post_norm": (h,),
                    p + "gate": (c.intermediate, h), p + "up": (c.intermediate, h), p + "down": (h, c.intermediate)})
        if c.qkv_bias:
            out.update({p + "q_bias": (q,), p + "k_bias": (kv,), p + "v_bias": (kv,)})
    return out


def checkpoint_key(name: str) -> str:
    if name.startswith("layers."):
        _, i, part = name.split(".", 2)
        return f"layers.{i}." + LAYER[part]
    return name + ".weight"


@dataclass
class DFlashDraft:
    config: DFlashConfig
    weights: dict[str, np.ndarray]
    meta: dict = field(default_factory=dict)

    def check(self, target_dims, where: str) -> None:
        c = self.config
        if c.hidden != target_dims.hidden:
            raise UserError(f"{where}: the DFlash draft's hidden size {c.hidden} is not the target's {target_dims.hidden}")
        if c.vocab != target_dims.vocab:
            raise UserError(f"{where}: the draft was made for a vocabulary of {c.vocab}; the target has {target_dims.vocab}")
        if not 0 <= c.mask_token < c.vocab:
            raise UserError(f"{where}: mask_token_id {c.mask_token} is not a token of the vocabulary (0..{c.vocab - 1})")
        bad = [i - 1 for i in c.target_layers if not 0 < i < target_dims.layers]
        if bad:
            raise UserError(f"{where}: target_layer_ids {bad} (layer outputs) are out of range for a target of "
                            f"{target_dims.layers} layers (the last layer's output is not exported as a feature)")


def load_dflash(path: str | Path, target_layers: int | None = None) -> DFlashDraft:
    """A DFlash draft from a folder in z-lab's layout, strictly (every tensor mapped, every shape checked)."""
    folder = Path(path)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise UserError(f"DFlash draft {path}: give the draft's folder (config.json and model.safetensors)")
    where = str(folder / "config.json")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{where}: cannot read the draft's config ({e})") from None
    dflash = config.get("dflash_config") if isinstance(config, dict) else None
    if not isinstance(dflash, dict):
        raise UserError(f"{where}: not a DFlash draft (no dflash_config)")
    ids = dflash.get("target_layer_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise UserError(f"{where}: dflash_config.target_layer_ids must be a list of layer numbers, got {ids!r:.60}")
    fields = decoder_fields(config, where)
    tensors = read_tensors(folder / "model.safetensors")
    layers = len({k.split(".")[1] for k in tensors if k.startswith("layers.")})
    c = DFlashConfig(**{k: v for k, v in fields.items()}, layers=layers,
                     block=int(number({**config, **dflash}, "block_size", where)),
                     mask_token=int(number(dflash, "mask_token_id", where)),
                     target_layers=tuple(i + 1 for i in ids), qkv_bias=f"layers.0.{LAYER['q_bias']}" in tensors)
    if c.block < 2:
        raise UserError(f"{where}: block_size {c.block}: a block drafts block_size - 1 tokens")
    table = shapes(c)
    unexpected = sorted(set(tensors) - {checkpoint_key(n) for n in table} - {"embed_tokens.weight", "lm_head.weight"})
    if unexpected:
        raise UserError(f"{folder}: unexpected tensors in the DFlash draft: {', '.join(unexpected[:5])}")
    weights = {}
    for name, shape in table.items():
        key = checkpoint_key(name)
        if key not in tensors:
            raise UserError(f"{folder}: the DFlash draft lacks '{key}'")
        if tuple(tensors[key].shape) != shape:
            raise UserError(f"{folder}: '{key}' has shape {tuple(tensors[key].shape)}, expected {shape}")
        weights[name] = tensors[key].astype(np.float32)
    return DFlashDraft(c, weights)


class DFlashModule:
    """The draft on torch tensors, as z-lab's model.py computes it: `context` (target features -> ctx rows) and
    `block` (the block's logits over the target vocabulary at rows 1..B-1)."""

    def __init__(self, draft: DFlashDraft, embed, lm_head):
        import torch

        self.c, self.embed, self.lm_head = draft.config, embed, lm_head
        self.p = {k: torch.from_numpy(v.copy()) for k, v in draft.weights.items()}
        self.inv_freq, self.rope_scale = draft_rope(draft.config)

    def norm(self, x, weight):
        import torch

        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c.rms_eps) * weight

    def context(self, features):
        """ctx [S, h] of the target's hidden states at target_layers, concatenated [S, n h]."""
        return self.norm(features @ self.p["fc"].T, self.p["hidden_norm"])

    def _rope(self, x, positions):
        from specexport.exporter.eagle import rope

        return rope(x, positions, self.inv_freq, self.rope_scale)

    def block(self, ctx, ids, start: int):
        """Log-probabilities [B - 1, vocab] of block `ids` [B] at positions start.. after context rows ctx
        [start, h] (positions 0..start-1)."""
        import torch
        import torch.nn.functional as F

        c, p = self.c, self.p
        b, s = len(ids), ctx.shape[0]
        h = F.embedding(torch.as_tensor(ids), self.embed).float()
        ctx_pos, blk_pos = torch.arange(s), torch.arange(start, start + b)
        for i in range(c.layers):
            pre = f"layers.{i}."
            x = self.norm(h, p[pre + "attn_norm"])

            def heads(t, n):
                return t.view(t.shape[0], n, c.head_dim).transpose(0, 1)  # [n, rows, d]

            q = self.norm(heads(F.linear(x, p[pre + "q"], p.get(pre + "q_bias")), c.heads), p[pre + "q_norm"])
            src = torch.cat([ctx, x])
            k = self.norm(heads(F.linear(src, p[pre + "k"], p.get(pre + "k_bias")), c.kv_heads), p[pre + "k_norm"])
            v = heads(F.linear(src, p[pre + "v"], p.get(pre + "v_bias")), c.kv_heads)
            positions = torch.cat([ctx_pos, blk_pos])
            q, k = self._rope(q[None], blk_pos)[0], self._rope(k[None], positions)[0]
            group = c.heads // c.kv_heads
            k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
            attn = ((q @ k.transpose(-1, -2)) / math.sqrt(c.head_dim)).softmax(-1) @ v
            h = h + F.linear(attn.transpose(0, 1).reshape(b, -1), p[pre + "o"])
            y = self.norm(h, p[pre + "post_norm"])
            h = h + F.linear(F.silu(F.linear(y, p[pre + "gate"])) * F.linear(y, p[pre + "up"]), p[pre + "down"])
        return torch.log_softmax(self.norm(h, p["norm"])[1:] @ self.lm_head.T, -1)
