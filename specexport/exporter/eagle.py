"""EAGLE draft decoders: one model of them, whichever producer wrote the checkpoint, and its PyTorch module.

Two architectures:

- EAGLE-1/2 (`version` 1): x = fc(cat(embed(token), feature)) (+ bias), then Llama decoder layers of which the
  first has no input norm, no final norm; the target's LM head scores the output. The feature is the target's
  last hidden state after its final norm.
- EAGLE-3 (`version` 3): the first step's hidden is fc(cat(aux features)) of target layer inputs (layers 2, L//2,
  L-3 by default), optionally normed first (EAGLE 3.1: one norm over the concatenation, or one per feature); the
  first layer attends over cat(in_norm(embed), hidden_norm(hidden)) (2h wide) with the raw hidden (or, with
  `norm_before_residual`, the normed one) as its residual; further layers are plain decoder layers; a final norm
  and a reduced-vocabulary LM head, and the d2t map: target id = draft id + d2t[draft id].

The hidden a draft step returns is the next step's input hidden: the last layer's output, or its final-normed
value where the draft was trained so (`norm_output`, EAGLE 3.1). Layers may be Qwen3-shaped (q/k norms per head)
and carry biases; RoPE may be scaled as the target's (llama3, yarn, linear).

Checkpoints are read by exporter/drafts (one reader per producer's layout); `aux_layers` is always in one
meaning here: the target layers whose INPUTS make the feature. Our own drafts are saved in the EAGLE reference
layout with a `specexport` object in config.json, which no other producer writes.

Weights use our names: `fc`, `fc_bias`, `feature_norm` (one norm over the concatenated features), `fc_norm.{k}`,
`in_norm`, `hidden_norm` (the first layer's two input norms), `norm`, `lm_head`, `d2t`, and per layer i
`layers.{i}.{q,k,v,o,post_norm,gate,up,down}` with optional `attn_norm` (i > 0), `q_norm`, `k_norm` and
`{q,k,v,o,gate,up,down}_bias`. Example: `layers.0.q` is EAGLE-3's `midlayer.self_attn.q_proj.weight`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specexport.errors import UserError

# our per-layer name -> the suffix Hugging Face decoder layers use
LAYER = {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
         "o": "self_attn.o_proj.weight", "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
         "v_bias": "self_attn.v_proj.bias", "o_bias": "self_attn.o_proj.bias", "q_norm": "self_attn.q_norm.weight",
         "k_norm": "self_attn.k_norm.weight", "attn_norm": "input_layernorm.weight",
         "post_norm": "post_attention_layernorm.weight", "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight",
         "down": "mlp.down_proj.weight", "gate_bias": "mlp.gate_proj.bias", "up_bias": "mlp.up_proj.bias",
         "down_bias": "mlp.down_proj.bias"}
FEATURE_NORMS = ("", "concat", "each")  # none; norm_before_fc (one over the concatenation); fc_norm (one per feature)


def default_aux_layers(layers: int) -> tuple[int, int, int]:
    """EAGLE-3's feature layers: the INPUTS of layers 2, L//2 and L-3 (the outputs of layers 1, L//2-1, L-4)."""
    return (2, layers // 2, layers - 3)


@dataclass
class DraftConfig:
    version: int  # 1 (EAGLE-1/2) or 3 (EAGLE-3)
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_eps: float
    rope_theta: float
    vocab: int  # the target's vocabulary
    draft_vocab: int  # = vocab unless a d2t map reduces it (EAGLE-3)
    target_hidden: int
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: which target layers' INPUTS make the feature
    fc_bias: bool = False
    layers: int = 1
    producer: str = "specexport"  # whose layout the checkpoint was in (exporter/drafts)
    rope_scaling: dict | None = None  # the RoPE parameters beyond theta (rope_type llama3, yarn, linear)
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3-shaped layers: RMSNorm over each head's q and k
    hidden_norm: bool = True  # EAGLE-3: the first layer norms the hidden (ModelOpt's Megatron export may not)
    final_norm: bool = True  # EAGLE-3: the norm before the LM head
    norm_before_residual: bool = False  # EAGLE-3: the first layer's residual is hidden_norm(hidden)
    feature_norm: str = ""  # FEATURE_NORMS
    norm_output: bool = False  # EAGLE 3.1: the hidden passed on is final-normed
    # an MTP layer of the target's own checkpoint (EAGLE-1's shape): the embedding (zeroed at position 0) and the
    # feature each normed before fc, the layer's own input norm, a final norm before the target's LM head whose
    # output is also passed on; `hidden_first`: fc reads cat(hidden, embedding) (MiMo); `prenorm_feature`: the
    # feature is the target's last layer output before its final norm (MiMo), else after it
    mtp: bool = False
    hidden_first: bool = False
    prenorm_feature: bool = False

    @property
    def feature_size(self) -> int:
        return self.target_hidden * len(self.aux_layers) if self.version == 3 else self.target_hidden


def shapes(c: DraftConfig) -> dict[str, tuple[int, ...]]:
    """Our name -> shape of every tensor the draft's config calls for."""
    q, kv, h = c.heads * c.head_dim, c.kv_heads * c.head_dim, c.hidden
    out: dict[str, tuple[int, ...]] = {}
    for i in range(c.layers):
        width = 2 * h if c.version == 3 and i == 0 else h
        p = f"layers.{i}."
        out.update({p + "q": (q, width), p + "k": (kv, width), p + "v": (kv, width), p + "o": (h, q),
                    p + "post_norm": (h,), p + "gate": (c.intermediate, h), p + "up": (c.intermediate, h),
                    p + "down": (h, c.intermediate)})
        if i > 0 or c.mtp:
            out[p + "attn_norm"] = (h,)
        if c.qkv_bias:
            out.update({p + "q_bias": (q,), p + "k_bias": (kv,), p + "v_bias": (kv,)})
        if c.o_bias:
            out[p + "o_bias"] = (h,)
        if c.mlp_bias:
            out.update({p + "gate_bias": (c.intermediate,), p + "up_bias": (c.intermediate,), p + "down_bias": (h,)})
        if c.qk_norm:
            out.update({p + "q_norm": (c.head_dim,), p + "k_norm": (c.head_dim,)})
    if c.version == 1:
        out["fc"] = (h, 2 * h)
        if c.fc_bias:
            out["fc_bias"] = (h,)
        if c.mtp:
            out.update(in_norm=(h,), hidden_norm=(h,), norm=(h,))
        return out
    out.update(fc=(h, c.feature_size), in_norm=(h,), lm_head=(c.draft_vocab, h))
    if c.hidden_norm:
        out["hidden_norm"] = (h,)
    if c.final_norm:
        out["norm"] = (h,)
    if c.feature_norm == "concat":
        out["feature_norm"] = (c.feature_size,)
    elif c.feature_norm == "each":
        out.update({f"fc_norm.{k}": (c.target_hidden,) for k in range(len(c.aux_layers))})
    if c.draft_vocab != c.vocab:
        out["d2t"] = (c.draft_vocab,)
    return out


def checkpoint_keys(c: DraftConfig, first: str, rest: str = "layers.{i}.") -> dict[str, str]:
    """Our name -> the checkpoint's key, for a layout whose first layer's keys start with `first` (midlayer. or
    layers.0.) and layer i's with `rest`; the names outside the layers are the EAGLE reference's."""
    keys = {}
    for name in shapes(c):
        if name.startswith("layers."):
            _, i, part = name.split(".", 2)
            keys[name] = (first if i == "0" else rest.format(i=i)) + LAYER[part]
        elif name in ("in_norm", "hidden_norm"):
            keys[name] = first + ("input_layernorm.weight" if name == "in_norm" else "hidden_norm.weight")
        elif name == "fc_bias":
            keys[name] = "fc.bias"
        elif name == "d2t":
            keys[name] = "d2t"
        else:
            keys[name] = name + ".weight"
    return keys


def draft_rope(c: DraftConfig) -> tuple[np.ndarray, float]:
    """(inverse frequencies, attention scaling) of the draft's RoPE: plain from its theta, or as transformers
    initializes the scaled kinds (llama3, yarn, linear) from the same parameters."""
    d = c.head_dim
    if not c.rope_scaling:
        return (1.0 / c.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d)).astype(np.float32), 1.0
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    original = c.rope_scaling.get("original_max_position_embeddings") or 8192
    config = LlamaConfig(hidden_size=c.hidden, num_attention_heads=c.heads, head_dim=d,
                         rope_parameters={**c.rope_scaling, "rope_theta": c.rope_theta},
                         max_position_embeddings=int(original * float(c.rope_scaling.get("factor") or 1)))
    rotary = LlamaRotaryEmbedding(config)
    return rotary.inv_freq.detach().float().numpy(), float(rotary.attention_scaling)


@dataclass
class EagleDraft:
    config: DraftConfig
    weights: dict[str, np.ndarray]  # our names (module docstring)
    meta: dict = field(default_factory=dict)

    @property
    def hot_ids(self) -> np.ndarray:
        """Target id of each draft id (arange when the draft scores the whole vocabulary)."""
        d2t = self.weights.get("d2t")
        base = np.arange(self.config.draft_vocab, dtype=np.int64)
        return base if d2t is None else base + d2t.astype(np.int64)

    def check(self, target_dims, where: str) -> None:
        """The draft fits this target: hidden size, vocabulary, feature layers."""
        c = self.config
        if c.target_hidden != target_dims.hidden:
            raise UserError(f"{where}: the draft was made for hidden size {c.target_hidden}; the target has {target_dims.hidden}")
        if c.vocab != target_dims.vocab:
            raise UserError(f"{where}: the draft was made for a vocabulary of {c.vocab}; the target has {target_dims.vocab}")
        if c.hidden != target_dims.hidden:  # it embeds tokens with the target's embeddings
            raise UserError(f"{where}: the draft's hidden size {c.hidden} is not the target's {target_dims.hidden} (a "
                            "draft reads the target's token embeddings)")
        bad = [i for i in c.aux_layers if not 0 <= i < target_dims.layers]
        if bad:
            raise UserError(f"{where}: EAGLE-3 feature layers {bad} (as layer inputs; {c.producer} layout) are out of "
                            f"range for a target of {target_dims.layers} layers")


def save_draft(draft: EagleDraft, folder: Path, meta: dict | None = None, half: bool = False) -> None:
    """Write the draft in the EAGLE reference layout (model.safetensors + config.json, `midlayer.*` for EAGLE-3's
    first layer) with our `specexport` object; `half` stores the float tensors in fp16, as published drafts are."""
    from safetensors.numpy import save_file

    c = draft.config
    keys = checkpoint_keys(c, "midlayer." if c.version == 3 else "layers.0.")
    tensors = {keys[name]: np.ascontiguousarray(draft.weights[name]) for name in shapes(c)}
    if half:
        tensors = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in tensors.items()}
    if "d2t" in draft.weights:
        t2d = np.zeros(c.vocab, dtype=bool)
        t2d[draft.hot_ids] = True
        tensors["t2d"] = t2d
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "qwen3" if c.qk_norm else "llama",
              "num_hidden_layers": c.layers, "hidden_size": c.hidden, "intermediate_size": c.intermediate,
              "num_attention_heads": c.heads, "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim,
              "rms_norm_eps": c.rms_eps, "rope_theta": c.rope_theta, "vocab_size": c.vocab, "hidden_act": "silu",
              "attention_bias": c.qkv_bias, "mlp_bias": c.mlp_bias}
    if c.rope_scaling:
        config["rope_scaling"] = c.rope_scaling
    if c.version == 3:
        config.update(draft_vocab_size=c.draft_vocab, target_hidden_size=c.target_hidden,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": list(c.aux_layers)})
    else:
        config["bias"] = c.fc_bias
    flags = {k: getattr(c, k) for k in ("hidden_norm", "final_norm", "norm_before_residual", "feature_norm",
                                        "norm_output") if getattr(c, k) != DraftConfig.__dataclass_fields__[k].default}
    # the mark: aux ids in the input meaning (other producers write the same eagle_config key as layer outputs)
    config["specexport"] = {**draft.meta, **(meta or {}), "aux_layers_are": "inputs", **flags}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------- PyTorch module


def rope(x, positions, inv_freq, scaling: float = 1.0):
    """Rotate-half RoPE of x [B, n, T, d] at positions [B, T] (or [T]) with the given inverse frequencies."""
    import torch

    angles = positions.float()[..., None] * torch.as_tensor(inv_freq, dtype=torch.float32)  # [B, T, d/2]
    if angles.dim() == 3:
        angles = angles[:, None]
    cos, sin = torch.cat([angles.cos()] * 2, -1) * scaling, torch.cat([angles.sin()] * 2, -1) * scaling
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class DraftModule:
    """The draft decoder on torch tensors (parameters in `params`, trainable), in pieces a caller composes: `start`
    (features -> first hidden), `qkv` and `finish` around the first layer's attention, `layer` for the others,
    `logits`; `step` is one call as the exported graph makes it."""

    def __init__(self, config: DraftConfig, params: dict, embed, target_head):
        self.c, self.p, self.embed, self.target_head = config, params, embed, target_head
        self.inv_freq, self.rope_scale = draft_rope(config)

    @classmethod
    def from_draft(cls, draft: EagleDraft, embed, target_head, trainable: bool = False) -> "DraftModule":
        import torch

        params = {k: torch.from_numpy(v.copy()) if k == "d2t" else torch.tensor(v, requires_grad=trainable)
                  for k, v in draft.weights.items()}
        return cls(draft.config, params, embed, target_head)

    def to_draft(self, meta: dict | None = None) -> EagleDraft:
        return EagleDraft(self.c, {k: v.detach().numpy().copy() for k, v in self.p.items()}, dict(meta or {}))

    def norm(self, x, name: str):
        import torch

        x32 = x.float()
        return x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.c.rms_eps) * self.p[name]

    def start(self, features):
        """The first step's input hidden: EAGLE-3 fuses the target features (normed first where the draft says);
        EAGLE-1 takes the feature as is."""
        import torch
        import torch.nn.functional as F

        c = self.c
        if c.version != 3:
            return features
        if c.feature_norm == "concat":
            features = self.norm(features, "feature_norm")
        elif c.feature_norm == "each":
            parts = features.chunk(len(c.aux_layers), -1)
            features = torch.cat([self.norm(part, f"fc_norm.{k}") for k, part in enumerate(parts)], -1)
        return F.linear(features, self.p["fc"])

    def _project(self, i: int, x, positions):
        import torch.nn.functional as F

        c, p = self.c, self.p
        b, t, _ = x.shape
        pre = f"layers.{i}."
        q = F.linear(x, p[pre + "q"], p.get(pre + "q_bias")).view(b, t, c.heads, c.head_dim).transpose(1, 2)
        k = F.linear(x, p[pre + "k"], p.get(pre + "k_bias")).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        v = F.linear(x, p[pre + "v"], p.get(pre + "v_bias")).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        if c.qk_norm:
            q, k = self.norm(q, pre + "q_norm"), self.norm(k, pre + "k_norm")
        return (rope(q, positions, self.inv_freq, self.rope_scale), rope(k, positions, self.inv_freq, self.rope_scale),
                v)

    def qkv(self, ids, hidden, positions):
        """The first layer: (residual, q [B, heads, T, d], k, v [B, kv_heads, T, d]) for tokens `ids` [B, T] with
        input hidden."""
        import torch
        import torch.nn.functional as F

        c, p = self.c, self.p
        emb = F.embedding(ids, self.embed)
        if c.version == 3:
            normed = self.norm(hidden, "hidden_norm") if c.hidden_norm else hidden
            residual = normed if c.norm_before_residual else hidden
            x = torch.cat([self.norm(emb, "in_norm"), normed], -1)
        elif c.mtp:
            emb = emb * (positions != 0)[..., None].to(emb.dtype)  # the first position's embedding is not read
            parts = [self.norm(hidden, "hidden_norm"), self.norm(emb, "in_norm")]
            residual = F.linear(torch.cat(parts if c.hidden_first else parts[::-1], -1), p["fc"])
            x = self.norm(residual, "layers.0.attn_norm")
        else:
            x = residual = F.linear(torch.cat([emb, hidden], -1), p["fc"], p.get("fc_bias"))
        return (residual, *self._project(0, x, positions))

    def expand_kv(self, k):
        """[B, kv_heads, ...] -> [B, heads, ...] (grouped-query attention)."""
        return k.repeat_interleave(self.c.heads // self.c.kv_heads, dim=1)

    def finish(self, residual, attn, i: int = 0):
        """Layer i after its attention: attn [B, heads, T, d] -> its output hidden [B, T, h] (o_proj, residual,
        MLP)."""
        import torch.nn.functional as F

        p, pre = self.p, f"layers.{i}."
        b, _, t, _ = attn.shape
        h = residual + F.linear(attn.transpose(1, 2).reshape(b, t, -1), p[pre + "o"], p.get(pre + "o_bias"))
        x = self.norm(h, pre + "post_norm")
        gate = F.linear(x, p[pre + "gate"], p.get(pre + "gate_bias"))
        return h + F.linear(F.silu(gate) * F.linear(x, p[pre + "up"], p.get(pre + "up_bias")), p[pre + "down"],
                            p.get(pre + "down_bias"))

    def attend(self, q, k, v, bias, past=None):
        """Attention of q over past + new keys with an additive `bias`; returns (output, (keys, values))."""
        import torch

        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        scores = q @ self.expand_kv(k).transpose(-1, -2) / math.sqrt(self.c.head_dim) + bias
        return scores.softmax(-1) @ self.expand_kv(v), (k, v)

    def passed_on(self, hidden):
        """The hidden the next draft step reads: the last layer's output, final-normed for EAGLE 3.1's
        norm_output."""
        return self.norm(hidden, "norm") if self.c.norm_output or self.c.mtp else hidden

    def logits(self, hidden):
        """Scores over the draft vocabulary of a last layer's output (EAGLE-3: own head after the final norm;
        EAGLE-1: the target's)."""
        import torch.nn.functional as F

        if self.c.version == 3:
            return F.linear(self.norm(hidden, "norm") if self.c.final_norm else hidden, self.p["lm_head"])
        return F.linear(self.norm(hidden, "norm") if self.c.mtp else hidden, self.target_head)

    def step(self, ids, hidden, positions, bias, past=None):
        """One call as the exported graph does it: new tokens `ids` [1, T] with input hidden, additive `bias`
        [1, 1, T, past + T]; past = per layer (k, v) of earlier rows, or None. Returns (hidden passed on, logits,
        per layer (k, v))."""
        past = past or [None] * self.c.layers
        residual, q, k, v = self.qkv(ids, hidden, positions)
        attn, first = self.attend(q, k, v, bias, past[0])
        out, present = self.finish(residual, attn), [first]
        for i in range(1, self.c.layers):
            q, k, v = self._project(i, self.norm(out, f"layers.{i}.attn_norm"), positions)
            attn, kv = self.attend(q, k, v, bias, past[i])
            out = self.finish(out, attn, i)
            present.append(kv)
        return self.passed_on(out), self.logits(out), present
