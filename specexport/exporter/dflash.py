"""DFlash block drafters (arXiv 2602.06036; z-lab/dflash, dflash/model.py): one draft call proposes a whole block.

The target's hidden states at a few layers (`target_layer_ids`, layer OUTPUTS in z-lab's files: our layer inputs
+ 1) are concatenated and fused, ctx = hidden_norm(fc(cat(...))), one row per committed token. The block is
[the last committed token, mask token x (B - 1)] at the positions after the context; through `layers` Qwen3
decoder layers whose attention takes its queries from the block and its keys and values from the context rows
(each layer's own k_proj / v_proj over ctx, k_norm, RoPE at their positions) and from the block itself, with no
mask (every block row sees the whole context and the whole block); the final norm and the target's LM head score
block rows 1..B-1, the draft tokens for the B - 1 positions after the last committed one.

Two layouts are read. z-lab's (config.json: `architectures ["DFlashDraftModel"]`, Qwen3 keys, `block_size` at the top
or in `dflash_config`, `dflash_config: {mask_token_id, target_layer_ids}` (layer outputs); model.safetensors:
`fc.weight [h, n h]`, `hidden_norm.weight`, `norm.weight`, `layers.{i}.*` of a Qwen3 decoder layer with
`self_attn.{q,k}_norm`; no embeddings or LM head: the target's). Red Hat's speculators (models/dflash: config.json
with `speculators_model_type: "dflash"`, a nested Qwen3 `transformer_layer_config`, `block_size`, `mask_token_id`,
`aux_hidden_state_layer_ids` (layer inputs, as vLLM reads them); the same tensors plus frozen copies of the
verifier's `embed_tokens` and `lm_head`, the head cut to a draft vocabulary with `d2t` / `t2d` where it is smaller:
then the block is scored over the draft vocabulary and its ids mapped to the target's, as vLLM does). Weights here use
eagle.py's per-layer names plus `fc`, `hidden_norm`, `norm`, and `lm_head` / `hot` (draft id -> target id) for a
draft's own head.

Example: `load_dflash("Qwen3-8B-DFlash-b16", target_layers=36).config.block == 16`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specexport.errors import UserError
from specexport.exporter.drafts import speculators
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
    draft_vocab: int = 0  # rows of the draft's own LM head (speculators); 0: scored by the target's


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
    if c.draft_vocab:
        out["lm_head"] = (c.draft_vocab, h)
        if c.draft_vocab < c.vocab:
            out["hot"] = (c.draft_vocab,)
    return out


def checkpoint_key(name: str) -> str:
    if name.startswith("layers."):
        _, i, part = name.split(".", 2)
        return f"layers.{i}." + LAYER[part]
    return "d2t" if name == "hot" else name + ".weight"


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
    """A DFlash draft from a folder in z-lab's or speculators' layout, strictly (every tensor mapped, every shape
    checked)."""
    folder = Path(path)
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise UserError(f"DFlash draft {path}: give the draft's folder (config.json and model.safetensors)")
    where = str(folder / "config.json")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{where}: cannot read the draft's config ({e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{where}: not a DFlash draft (not a JSON object)")
    read = _speculators if config.get("speculators_model_type") == speculators.DFLASH_TYPE else _zlab
    fields, inputs, block, mask, producer, meta = read(config, where)
    tensors = read_tensors(folder / "model.safetensors")
    layers = len({k.split(".")[1] for k in tensors if k.startswith("layers.")})
    own = producer == speculators.NAME and "lm_head.weight" in tensors
    c = DFlashConfig(**fields, layers=layers, block=block, mask_token=mask, target_layers=inputs,
                     qkv_bias=f"layers.0.{LAYER['q_bias']}" in tensors, producer=producer,
                     draft_vocab=len(tensors["lm_head.weight"]) if own else 0)
    if c.block < 2:
        raise UserError(f"{where}: block_size {c.block}: a block drafts block_size - 1 tokens")
    table = shapes(c)
    unexpected = sorted(set(tensors) - {checkpoint_key(n) for n in table} - {"embed_tokens.weight", "lm_head.weight"}
                        - ({"t2d"} if "hot" in table else set()))
    if unexpected:
        raise UserError(f"{folder}: unexpected tensors in the DFlash draft: {', '.join(unexpected[:5])}")
    weights = {}
    for name, shape in table.items():
        key = checkpoint_key(name)
        if key not in tensors:
            raise UserError(f"{folder}: the DFlash draft lacks '{key}'" + (" (its draft vocabulary is smaller than the "
                                                                           "target's)" if key == "d2t" else ""))
        if tuple(tensors[key].shape) != shape:
            raise UserError(f"{folder}: '{key}' has shape {tuple(tensors[key].shape)}, expected {shape}")
        weights[name] = tensors[key].astype(np.float32) if name != "hot" else tensors[key].astype(np.int64)
    if "hot" in weights:
        weights["hot"] = weights["hot"] + np.arange(c.draft_vocab)  # d2t holds offsets: target = draft id + d2t
        if weights["hot"].min() < 0 or weights["hot"].max() >= c.vocab:
            raise UserError(f"{folder}: d2t maps draft ids outside the vocabulary of {c.vocab}")
    return DFlashDraft(c, weights, meta)


def _layer_ids(ids, where: str, key: str) -> list[int]:
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise UserError(f"{where}: {key} must be a list of layer numbers, got {ids!r:.60}")
    return ids


def _zlab(config: dict, where: str):
    """z-lab's config: (decoder fields, context layers as inputs, block, mask token, producer, meta)."""
    dflash = config.get("dflash_config")
    if not isinstance(dflash, dict):
        raise UserError(f"{where}: not a DFlash draft (no dflash_config, no speculators_model_type 'dflash')")
    ids = _layer_ids(dflash.get("target_layer_ids"), where, "dflash_config.target_layer_ids")
    return (decoder_fields(config, where), tuple(i + 1 for i in ids),
            int(number({**config, **dflash}, "block_size", where)), int(number(dflash, "mask_token_id", where)),
            PRODUCER, {})


def _speculators(config: dict, where: str):
    """speculators' config (models/dflash/config.py): the layer config nested, the aux ids as layer inputs."""
    layer = speculators.layer_config(config.get("transformer_layer_config"), where)
    if "sliding_attention" in (layer.get("layer_types") or []):
        raise UserError(f"{where}: a DFlash draft with sliding-window layers (causal inside the block) is not "
                        "supported")
    if config.get("sample_from_anchor"):
        raise UserError(f"{where}: sample_from_anchor (every block row predicts, DSpark's way) is not supported")
    ids = _layer_ids(config.get("aux_hidden_state_layer_ids"), where, "aux_hidden_state_layer_ids")
    return (decoder_fields(layer, where), tuple(ids), int(number(config, "block_size", where)),
            int(number(config, "mask_token_id", where)), speculators.NAME, speculators.meta(config))


def save_dflash(draft: DFlashDraft, folder: Path, meta: dict | None = None) -> None:
    """Write the draft in z-lab's layout (bf16 model.safetensors, config.json with `dflash_config`), with our
    `specexport` object (`meta`: how it was trained). Example: `save_dflash(module.to_draft(), Path("out"))`."""
    import torch
    from safetensors.torch import save_file

    c = draft.config
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {checkpoint_key(name): torch.from_numpy(np.ascontiguousarray(draft.weights[name])).to(torch.bfloat16)
               for name in shapes(c) if name != "hot"}
    if "hot" in draft.weights:  # d2t: offsets, target = draft id + d2t
        tensors["d2t"] = torch.from_numpy(draft.weights["hot"] - np.arange(c.draft_vocab))
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": c.hidden,
              "intermediate_size": c.intermediate, "num_attention_heads": c.heads, "num_key_value_heads": c.kv_heads,
              "head_dim": c.head_dim, "num_hidden_layers": c.layers, "rms_norm_eps": c.rms_eps,
              "rope_theta": c.rope_theta, "vocab_size": c.vocab, "hidden_act": "silu", "attention_bias": c.qkv_bias,
              "block_size": c.block, "torch_dtype": "bfloat16",
              "dflash_config": {"mask_token_id": c.mask_token, "target_layer_ids": [i - 1 for i in c.target_layers]}}
    if c.rope_scaling:
        config["rope_scaling"] = c.rope_scaling
    config["specexport"] = {**draft.meta, **(meta or {})}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


class DFlashModule:
    """The draft on torch tensors, as z-lab's model.py computes it: `context` (target features -> ctx rows),
    `blocks` (many blocks at once, each seeing the context rows before its anchor: what training runs) and `block`
    (one block's log-probabilities over the target vocabulary at rows 1..B-1: what the graphs are checked
    against). `trainable` makes the draft's weights leaves with gradients; the embeddings and LM head stay frozen."""

    def __init__(self, draft: DFlashDraft, embed, lm_head, trainable: bool = False):
        import torch

        self.c, self.embed, self.meta = draft.config, embed, dict(draft.meta)
        self.p = {k: torch.tensor(v, requires_grad=trainable and k not in ("lm_head", "hot"))
                  for k, v in draft.weights.items()}
        self.lm_head = self.p.get("lm_head", lm_head)  # the draft's own (speculators) or the target's
        self.inv_freq, self.rope_scale = draft_rope(draft.config)

    def to_draft(self) -> DFlashDraft:
        return DFlashDraft(self.c, {k: v.detach().numpy().copy() for k, v in self.p.items()}, dict(self.meta))

    def norm(self, x, weight):
        import torch

        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.c.rms_eps) * weight

    def context(self, features):
        """ctx [..., S, h] of the target's hidden states at target_layers, concatenated [..., S, n h]."""
        return self.norm(features @ self.p["fc"].T, self.p["hidden_norm"])

    def _rope(self, x, positions):
        from specexport.exporter.eagle import rope

        return rope(x, positions, self.inv_freq, self.rope_scale)

    def blocks(self, ctx, ids, anchors):
        """The final-normed hidden states [N, A, B, h] of A blocks per sequence: `ids` [N, A, B] (each block's
        anchor token and mask tokens) at positions anchors[n, a].. after context rows ctx [N, S, h] (positions
        0..S-1); block a attends to the context rows before its anchor and to its own rows, without a mask."""
        import torch
        import torch.nn.functional as F

        c, p = self.c, self.p
        n, a, b = ids.shape
        s, rows = ctx.shape[1], a * b
        h = F.embedding(ids.reshape(n, rows), self.embed).float()
        blk_pos = (anchors[..., None] + torch.arange(b)).reshape(n, rows)
        positions = torch.cat([torch.arange(s).expand(n, s), blk_pos], 1)
        owner = torch.arange(a).repeat_interleave(b)
        seen = torch.cat([torch.arange(s)[None, None, :] < anchors.repeat_interleave(b, 1)[..., None],
                          (owner[:, None] == owner[None, :]).expand(n, rows, rows)], -1)  # [N, rows, S + rows]
        bias = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))[:, None]
        group = c.heads // c.kv_heads

        def heads(t, count):
            return t.reshape(n, t.shape[1], count, c.head_dim)

        for i in range(c.layers):
            pre = f"layers.{i}."
            x = self.norm(h, p[pre + "attn_norm"])
            q = self.norm(heads(F.linear(x, p[pre + "q"], p.get(pre + "q_bias")), c.heads), p[pre + "q_norm"])
            src = torch.cat([ctx, x], 1)
            k = self.norm(heads(F.linear(src, p[pre + "k"], p.get(pre + "k_bias")), c.kv_heads), p[pre + "k_norm"])
            v = heads(F.linear(src, p[pre + "v"], p.get(pre + "v_bias")), c.kv_heads).transpose(1, 2)
            q, k = self._rope(q.transpose(1, 2), blk_pos), self._rope(k.transpose(1, 2), positions)
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            attn = ((q @ k.transpose(-1, -2)) / math.sqrt(c.head_dim) + bias).softmax(-1) @ v
            h = h + F.linear(attn.transpose(1, 2).reshape(n, rows, -1), p[pre + "o"])
            y = self.norm(h, p[pre + "post_norm"])
            h = h + F.linear(F.silu(F.linear(y, p[pre + "gate"])) * F.linear(y, p[pre + "up"]), p[pre + "down"])
        return self.norm(h, p["norm"]).reshape(n, a, b, -1)

    def block(self, ctx, ids, start: int):
        """Log-probabilities [B - 1, vocab] of block `ids` [B] at positions start.. after context rows ctx
        [start, h] (positions 0..start-1); with a draft vocabulary, over it (-inf at the other target ids)."""
        import torch

        out = self.blocks(ctx[None, :start], torch.as_tensor(ids).reshape(1, 1, -1), torch.tensor([[start]]))
        logp = torch.log_softmax(out[0, 0, 1:] @ self.lm_head.T, -1)
        if "hot" not in self.p:
            return logp
        full = torch.full((logp.shape[0], self.c.vocab), float("-inf"))
        return full.index_copy(1, self.p["hot"], logp)
