"""EAGLE draft decoders: the published checkpoint layouts, loaded strictly, and the PyTorch module.

Two architectures:

- EAGLE-1/2 (`version` 1): x = fc(cat(embed(token), feature)) (+ bias), one Llama decoder layer without its
  input norm, no final norm; the target's LM head scores the output. The feature is the target's last hidden
  state after its final norm. Keys: `fc.weight [h, 2h]`, `fc.bias`, `layers.0.self_attn.{q,k,v,o}_proj`,
  `layers.0.mlp.{gate,up,down}_proj`, `layers.0.post_attention_layernorm`, optionally `embed_tokens.weight`.
- EAGLE-3 (`version` 3): the first step's hidden is fc(cat(low, mid, high)) of three target layer inputs
  (layers 2, L//2, L-3 by default); the layer attends over cat(input_norm(embed), hidden_norm(hidden)) (2h wide);
  its own final norm and reduced-vocabulary LM head, and the d2t map: target id = draft id + d2t[draft id].
  Keys: `fc.weight [h, 3H]`, `midlayer.*`, `norm.weight`, `lm_head.weight [Vd, h]`, `d2t`, `t2d`.

The hidden a draft step returns (before any final norm) is the next step's input hidden. Our own trained
drafts are saved in the published EAGLE-3 layout (model.safetensors + config.json), so one loader reads both.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specexport.errors import UserError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
LAYER = {"q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight", "v": "self_attn.v_proj.weight",
         "o": "self_attn.o_proj.weight", "post_norm": "post_attention_layernorm.weight",
         "gate": "mlp.gate_proj.weight", "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight"}


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
    aux_layers: tuple[int, ...] = ()  # EAGLE-3: which target layer inputs make the feature
    fc_bias: bool = False
    layer_prefix: str = ""  # the decoder layer's key prefix: midlayer. (EAGLE-3) or layers.0.; "" = the version's

    @property
    def prefix(self) -> str:
        return self.layer_prefix or ("midlayer." if self.version == 3 else "layers.0.")

    @property
    def feature_size(self) -> int:
        return self.target_hidden * len(self.aux_layers) if self.version == 3 else self.target_hidden


@dataclass
class EagleDraft:
    config: DraftConfig
    weights: dict[str, np.ndarray]  # our names: fc, fc_bias, in_norm, hidden_norm, q, k, v, o, post_norm, ...
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
        if c.version == 1 and c.hidden != target_dims.hidden:
            raise UserError(f"{where}: an EAGLE-1 draft must have the target's hidden size {target_dims.hidden}, has {c.hidden}")
        bad = [i for i in c.aux_layers if not 0 <= i < target_dims.layers]
        if bad:
            raise UserError(f"{where}: EAGLE-3 feature layers {bad} are out of range for a target of {target_dims.layers} layers")


def _number(config: dict, key: str, where: str, default=None):
    value = config.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise UserError(f"{where}: config.json needs a positive '{key}'")
    return value


def _read_config(folder: Path, keys: set[str], target_layers: int | None) -> DraftConfig:
    where = str(folder / "config.json")
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{where}: cannot read the draft's config ({e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{where}: not a JSON object")
    # EAGLE-3 names its layer midlayer.*; SpecForge/vLLM-style EAGLE-3 exports use layers.0.* with a hidden_norm
    version = 3 if any(k.startswith("midlayer.") for k in keys) or "layers.0.hidden_norm.weight" in keys else 1
    prefix = "midlayer." if any(k.startswith("midlayer.") for k in keys) else "layers.0."
    hidden = int(_number(config, "hidden_size", where))
    heads = int(_number(config, "num_attention_heads", where))
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UserError(f"{where}: rope_scaling / rope_parameters must be an object, got {rope!r:.40}")
    theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise UserError(f"{where}: only plain RoPE is supported in a draft, got {rope.get('rope_type', rope.get('type'))}")
    vocab = int(_number(config, "vocab_size", where))
    aux = ()
    if version == 3:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or config.get("aux_layers")
        if ids is None:
            if target_layers is None:
                raise UserError(f"{where}: an EAGLE-3 draft without aux layer ids needs the target's layer count")
            ids = default_aux_layers(target_layers)
        if not isinstance(ids, list | tuple) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) or not ids:
            raise UserError(f"{where}: EAGLE-3 aux layer ids must be a list of integers, got {ids!r}")
        aux = tuple(ids)
    return DraftConfig(
        version=version, hidden=hidden, intermediate=int(_number(config, "intermediate_size", where)), heads=heads,
        kv_heads=int(_number(config, "num_key_value_heads", where, heads)),
        head_dim=int(config.get("head_dim") or hidden // heads), rms_eps=float(_number(config, "rms_norm_eps", where, 1e-6)),
        rope_theta=float(_number({"t": theta}, "t", where)), vocab=vocab,
        draft_vocab=int(_number(config, "draft_vocab_size", where, vocab)),
        target_hidden=int(_number(config, "target_hidden_size", where, hidden)), aux_layers=aux,
        fc_bias=bool(config.get("bias", True)) if version == 1 else False,
        layer_prefix="" if prefix == ("midlayer." if version == 3 else "layers.0.") else prefix)


def _read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Tensors of a checkpoint file: safetensors, or a .bin read with weights_only (never running a pickle)."""
    import torch

    if path.suffix == ".safetensors":  # through torch: published drafts are often bf16, which numpy lacks
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise UserError(f"cannot read {path}: {e}") from None
        return {k: (v.float() if v.is_floating_point() else v).numpy() for k, v in state.items()}
    import pickle

    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as e:
        raise UserError(f"refusing {path.name}: not a plain tensor checkpoint ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path}: expected a dict of tensors")
    return {k: (v.float() if v.is_floating_point() else v).numpy() for k, v in state.items()}


def expected_shapes(c: DraftConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Our name -> (checkpoint key, shape), for the draft's version."""
    q, kv = c.heads * c.head_dim, c.kv_heads * c.head_dim
    width = 2 * c.hidden if c.version == 3 else c.hidden
    prefix = c.prefix
    shapes = {"q": (q, width), "k": (kv, width), "v": (kv, width), "o": (c.hidden, q), "post_norm": (c.hidden,),
              "gate": (c.intermediate, c.hidden), "up": (c.intermediate, c.hidden), "down": (c.hidden, c.intermediate)}
    table = {name: (prefix + LAYER[name], shape) for name, shape in shapes.items()}
    if c.version == 1:
        table["fc"] = ("fc.weight", (c.hidden, 2 * c.hidden))
        if c.fc_bias:
            table["fc_bias"] = ("fc.bias", (c.hidden,))
        return table
    table.update(fc=("fc.weight", (c.hidden, c.feature_size)), in_norm=(prefix + "input_layernorm.weight", (c.hidden,)),
                 hidden_norm=(prefix + "hidden_norm.weight", (c.hidden,)), norm=("norm.weight", (c.hidden,)),
                 lm_head=("lm_head.weight", (c.draft_vocab, c.hidden)))
    if c.draft_vocab != c.vocab:
        table["d2t"] = ("d2t", (c.draft_vocab,))
    return table


def load_draft(path: str | Path, target_layers: int | None = None) -> EagleDraft:
    """An EAGLE-1/2/3 draft from a folder (config.json + model.safetensors or pytorch_model.bin), strictly:
    every tensor mapped, every shape checked, the d2t map in range."""
    folder = Path(path)
    if folder.is_file() and folder.name not in WEIGHT_FILES:
        raise UserError(f"EAGLE draft {path} is a file; give the draft's folder (config.json and "
                        f"{' or '.join(WEIGHT_FILES)})")
    if folder.is_file():
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"EAGLE draft {path} not found")
    files = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not files:
        raise UserError(f"{folder}: no {' or '.join(WEIGHT_FILES)}")
    tensors = _read_tensors(files[0])
    config = _read_config(folder, set(tensors), target_layers)
    table = expected_shapes(config)
    known = {key for key, _ in table.values()} | {"t2d", "embed_tokens.weight"}
    if config.version == 1 and not config.fc_bias:
        known.add("fc.bias")  # some EAGLE-1 configs omit "bias" and ship one: read below
    unexpected = sorted(set(tensors) - known)
    if unexpected:
        raise UserError(f"{folder}: unexpected tensors in the draft: {', '.join(unexpected[:5])}")
    if config.version == 1 and "fc.bias" in tensors and not config.fc_bias:
        config.fc_bias = True
        table = expected_shapes(config)
    weights = {}
    for name, (key, shape) in table.items():
        if key not in tensors:
            raise UserError(f"{folder}: the draft lacks '{key}'")
        array = tensors[key]
        if tuple(array.shape) != shape:
            raise UserError(f"{folder}: '{key}' has shape {tuple(array.shape)}, expected {shape}")
        weights[name] = array.astype(np.int64) if name == "d2t" else array.astype(np.float32)
    if "embed_tokens.weight" in tensors and tensors["embed_tokens.weight"].shape != (config.vocab, config.target_hidden):
        raise UserError(f"{folder}: embed_tokens.weight has shape {tensors['embed_tokens.weight'].shape}, "
                        f"expected {(config.vocab, config.target_hidden)}")
    if "t2d" in tensors and tensors["t2d"].shape != (config.vocab,):
        raise UserError(f"{folder}: t2d has shape {tensors['t2d'].shape}, expected ({config.vocab},)")
    draft = EagleDraft(config, weights, _read_meta(folder))
    hot = draft.hot_ids
    if hot.min() < 0 or hot.max() >= config.vocab or len(np.unique(hot)) != len(hot):
        raise UserError(f"{folder}: the d2t map gives target ids out of 0..{config.vocab - 1} or repeats one")
    return draft


def _read_meta(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text()).get("specexport", {})
    except (OSError, json.JSONDecodeError, AttributeError):
        return {}


def save_draft(draft: EagleDraft, folder: Path, meta: dict | None = None, half: bool = False) -> None:
    """Write the draft in the published layout of its version (model.safetensors + config.json); `half` stores
    the float tensors in fp16, as published drafts are."""
    from safetensors.numpy import save_file

    c = draft.config
    tensors = {key: np.ascontiguousarray(draft.weights[name]) for name, (key, _) in expected_shapes(c).items()}
    if half:
        tensors = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in tensors.items()}
    if "d2t" in draft.weights:
        t2d = np.zeros(c.vocab, dtype=bool)
        t2d[draft.hot_ids] = True
        tensors["t2d"] = t2d
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
              "hidden_size": c.hidden, "intermediate_size": c.intermediate, "num_attention_heads": c.heads,
              "num_key_value_heads": c.kv_heads, "head_dim": c.head_dim, "rms_norm_eps": c.rms_eps,
              "rope_theta": c.rope_theta, "vocab_size": c.vocab, "hidden_act": "silu"}
    if c.version == 3:
        config.update(draft_vocab_size=c.draft_vocab, target_hidden_size=c.target_hidden,
                      eagle_config={"eagle_aux_hidden_state_layer_ids": list(c.aux_layers)})
    else:
        config["bias"] = c.fc_bias
    config["specexport"] = {**draft.meta, **(meta or {})}
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


# ----------------------------------------------------------------------------------------------- PyTorch module


def rope(x, positions, theta: float):
    """Rotate-half RoPE of x [B, n, T, d] at positions [B, T] (or [T])."""
    import torch

    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[..., None] * inv  # [B, T, d/2]
    if angles.dim() == 3:
        angles = angles[:, None]
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rotated * sin


class DraftModule:
    """The draft decoder on torch tensors (parameters in `params`, trainable), in three pieces a caller
    composes: `start` (features -> first hidden), `qkv` and `finish` around its own attention, `logits`."""

    def __init__(self, config: DraftConfig, params: dict, embed, target_head):
        self.c, self.p, self.embed, self.target_head = config, params, embed, target_head

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
        """The first step's input hidden: EAGLE-3 fuses the target features; EAGLE-1 takes the feature as is."""
        import torch.nn.functional as F

        return F.linear(features, self.p["fc"]) if self.c.version == 3 else features

    def qkv(self, ids, hidden, positions):
        """(residual, q [B, heads, T, d], k, v [B, kv_heads, T, d]) for tokens `ids` [B, T] with input hidden."""
        import torch
        import torch.nn.functional as F

        c, p = self.c, self.p
        emb = F.embedding(ids, self.embed)
        if c.version == 3:
            residual = hidden
            x = torch.cat([self.norm(emb, "in_norm"), self.norm(hidden, "hidden_norm")], -1)
        else:
            x = residual = F.linear(torch.cat([emb, hidden], -1), p["fc"], p.get("fc_bias"))
        b, t, _ = x.shape
        q = F.linear(x, p["q"]).view(b, t, c.heads, c.head_dim).transpose(1, 2)
        k = F.linear(x, p["k"]).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        v = F.linear(x, p["v"]).view(b, t, c.kv_heads, c.head_dim).transpose(1, 2)
        return residual, rope(q, positions, c.rope_theta), rope(k, positions, c.rope_theta), v

    def expand_kv(self, k):
        """[B, kv_heads, ...] -> [B, heads, ...] (grouped-query attention)."""
        return k.repeat_interleave(self.c.heads // self.c.kv_heads, dim=1)

    def finish(self, residual, attn):
        """attn [B, heads, T, d] -> the output hidden [B, T, h] (o_proj, residual, MLP)."""
        import torch.nn.functional as F

        p = self.p
        b, _, t, _ = attn.shape
        h = residual + F.linear(attn.transpose(1, 2).reshape(b, t, -1), p["o"])
        x = self.norm(h, "post_norm")
        return h + F.linear(F.silu(F.linear(x, p["gate"])) * F.linear(x, p["up"]), p["down"])

    def logits(self, hidden):
        """Scores over the draft vocabulary (EAGLE-3: own head after the final norm; EAGLE-1: the target's)."""
        import torch.nn.functional as F

        if self.c.version == 3:
            return F.linear(self.norm(hidden, "norm"), self.p["lm_head"])
        return F.linear(hidden, self.target_head)

    def step(self, ids, hidden, positions, bias, past=None):
        """One call as the exported graph does it: new tokens `ids` [1, T] with input hidden, additive `bias`
        [1, 1, T, past + T]; past = (k, v) of earlier rows or None. Returns (hidden out, logits, (k, v))."""
        import torch

        residual, q, k, v = self.qkv(ids, hidden, positions)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        scores = q @ self.expand_kv(k).transpose(-1, -2) / math.sqrt(self.c.head_dim) + bias
        out = self.finish(residual, scores.softmax(-1) @ self.expand_kv(v))
        return out, self.logits(out), (k, v)
