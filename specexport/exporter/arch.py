"""A checkpoint's architecture, resolved: the model dimensions and per-layer plan (`Dims`) and the strict weight table.

The family declarations live in exporter/families/ (one small module each); this module turns a transformers config
into the numbers the graph builder reads, so the builder never compares family names.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from specexport.errors import UserError
from specexport.exporter import families
from specexport.exporter.families import Family

# RoPE variants whose frequencies do not depend on the sequence length (a static cos/sin table); longrope has two
# static tables, one chosen per bundle (longrope_policy).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
# transformers' activation names -> the graph's (exporter/graph.py DecoderGraphBuilder.activation)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh",
               "gelu_fast": "gelu_tanh", "gelu": "gelu", "relu": "relu"}


@dataclass(frozen=True)
class Dims:
    """Model dimensions and the per-layer plan, read once from the Hugging Face config."""

    model_type: str
    vocab: int
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rms_eps: float
    max_positions: int
    tie_embeddings: bool
    rope_type: str
    activation: str = "silu"
    embed_scale: float = 1.0
    residual_scale: float = 1.0
    attn_scale: float = 0.0  # 0: head_dim ** -0.5
    attn_softcap: float = 0.0  # 0: none
    final_softcap: float = 0.0
    logits_scaling: float = 1.0  # logits are divided by it (Granite)
    rotary_dim: int = 0  # 0: head_dim (partial rotary: fewer)
    windows: tuple = ()  # per layer: the sliding window (0: full attention); (): every layer full
    rope_layers: tuple = ()  # per layer: the RoPE table's name ("" : no rotation); (): every layer "default"

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def rope(self, layer: int) -> str:
        return self.rope_layers[layer] if self.rope_layers else "default"

    def within(self, max_context: int) -> "Dims":
        """These dims for a bundle of `max_context` positions: windows that never bind there dropped (a 4096-window
        Mistral built for 4096 positions attends fully: no window mask in its graph)."""
        windows = tuple(w if w < max_context else 0 for w in self.windows)
        return replace(self, windows=windows if any(windows) else ())

    def as_dict(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}


def spec_for(model_type: str) -> Family:
    return families.get(model_type)


def _rope_parameters(config, layer_type: str | None) -> dict:
    rope = getattr(config, "rope_parameters", None) or {}
    if layer_type is not None and isinstance(rope.get(layer_type), dict):  # per layer type (Gemma 3, OLMo 3)
        return rope[layer_type]
    return rope


def layer_windows(config) -> tuple:
    """Per layer, the sliding window transformers applies there (0: full): every layer when the config has no
    `layer_types` (Mistral, Phi-3), else the layers typed `sliding_attention`; none when `use_sliding_window` is
    off (Qwen2/3, SmolLM3)."""
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", True):
        return ()
    types = getattr(config, "layer_types", None)
    if types is None:
        return (int(window),) * config.num_hidden_layers
    windows = tuple(int(window) if t == "sliding_attention" else 0 for t in types)
    return windows if any(windows) else ()


def rope_layer_names(family: Family, config) -> tuple:
    """Per layer, the RoPE table it uses: its layer type's where the config gives RoPE per type, "" where the layer
    does not rotate."""
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None) or ["default"] * n
    rope = getattr(config, "rope_parameters", None) or {}
    names = [t if isinstance(rope.get(t), dict) else "default" for t in types]
    if family.rope_layers is not None:
        names = [name if uses else "" for name, uses in zip(names, family.rope_layers(config))]
    return () if all(name == "default" for name in names) else tuple(names)


def dims_from_config(config) -> Dims:
    family = spec_for(config.model_type)
    if (why := family.refuse(config)) is not None:
        raise UserError(f"{config.model_type}: {why}")
    rope_names = rope_layer_names(family, config)
    rope_types = {_rope_parameters(config, None if n == "default" else n).get("rope_type", "default")
                  for n in (rope_names or ("default",)) if n}
    for rope_type in sorted(rope_types):
        if rope_type not in STATIC_ROPE_TYPES:
            raise UserError(f"unsupported RoPE type '{rope_type}'; supported: {', '.join(STATIC_ROPE_TYPES)}")
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise UserError(f"unsupported MLP activation '{act}'; supported: {', '.join(sorted(ACTIVATIONS))}")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    partial = float(_rope_parameters(config, None).get("partial_rotary_factor",
                                                        getattr(config, "partial_rotary_factor", 1.0)) or 1.0)
    rotary_dim = int(head_dim * partial)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise UserError(f"unsupported partial rotary: {rotary_dim} of head_dim {head_dim} (needs an even count)")
    scales = family.scales(config)
    if family.fused_qkv and heads % kv_heads:
        raise UserError(f"{heads} heads do not group over {kv_heads} kv heads")
    return Dims(
        model_type=config.model_type,
        vocab=config.vocab_size,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        rms_eps=float(config.rms_norm_eps),
        max_positions=int(config.max_position_embeddings),  # the model's own: windows are per layer, in the mask
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        rope_type=sorted(rope_types)[0] if rope_types else "default",
        activation=ACTIVATIONS[act],
        rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
        windows=layer_windows(config),
        rope_layers=rope_names,
        **scales,
    )


def weight_table(family: Family, d: Dims, config=None) -> dict[str, tuple[str, tuple[int, ...], tuple | None]]:
    """Our name -> (checkpoint name, its shape, rows): linear weights are [out, in] as in PyTorch; `rows` (start,
    stop) takes a slice of a fused checkpoint matrix (Phi-3's qkv_proj and gate_up_proj), None the whole tensor."""
    attention_bias = bool(getattr(config, "attention_bias", False))
    qkv_bias, o_bias = family.qkv_bias or attention_bias, family.o_bias or attention_bias
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    table = {
        "embed": ("model.embed_tokens.weight", (d.vocab, d.hidden), None),
        "norm": ("model.norm.weight", (d.hidden,), None),
    }
    if not d.tie_embeddings:
        table["lm_head"] = ("lm_head.weight", (d.vocab, d.hidden), None)
    q, kv, inter = d.q_size, d.kv_size, d.intermediate
    for i in range(d.layers):
        p = f"model.layers.{i}."
        layer = {name: (f"{hf}.weight", (d.hidden,), None) for name, hf in family.norms.items()}
        if family.fused_qkv:
            fused = (q + 2 * kv, d.hidden)
            layer.update(q=("self_attn.qkv_proj.weight", fused, (0, q)),
                         k=("self_attn.qkv_proj.weight", fused, (q, q + kv)),
                         v=("self_attn.qkv_proj.weight", fused, (q + kv, q + 2 * kv)))
        else:
            layer.update(q=("self_attn.q_proj.weight", (q, d.hidden), None),
                         k=("self_attn.k_proj.weight", (kv, d.hidden), None),
                         v=("self_attn.v_proj.weight", (kv, d.hidden), None))
        layer["o"] = ("self_attn.o_proj.weight", (d.hidden, q), None)
        if family.fused_gate_up:
            fused = (2 * inter, d.hidden)
            layer.update(gate=("mlp.gate_up_proj.weight", fused, (0, inter)),
                         up=("mlp.gate_up_proj.weight", fused, (inter, 2 * inter)))
        else:
            layer.update(gate=("mlp.gate_proj.weight", (inter, d.hidden), None),
                         up=("mlp.up_proj.weight", (inter, d.hidden), None))
        layer["down"] = ("mlp.down_proj.weight", (d.hidden, inter), None)
        if qkv_bias:
            layer.update(q_bias=("self_attn.q_proj.bias", (q,), None), k_bias=("self_attn.k_proj.bias", (kv,), None),
                         v_bias=("self_attn.v_proj.bias", (kv,), None))
        if o_bias:
            layer["o_bias"] = ("self_attn.o_proj.bias", (d.hidden,), None)
        if mlp_bias:
            layer.update(gate_bias=("mlp.gate_proj.bias", (inter,), None), up_bias=("mlp.up_proj.bias", (inter,), None),
                         down_bias=("mlp.down_proj.bias", (d.hidden,), None))
        if family.qk_norm == "head":
            layer.update(q_norm=("self_attn.q_norm.weight", (d.head_dim,), None),
                         k_norm=("self_attn.k_norm.weight", (d.head_dim,), None))
        elif family.qk_norm == "full":
            layer.update(q_norm=("self_attn.q_norm.weight", (q,), None), k_norm=("self_attn.k_norm.weight", (kv,), None))
        for name, (hf, shape, rows) in layer.items():
            table[f"layers.{i}.{name}"] = (p + hf, shape, rows)
    return table


def _is_norm(name: str) -> bool:
    return name == "norm" or name.endswith("_norm")


def extract_weights(family: Family, d: Dims, state_dict: dict, config=None) -> dict[str, np.ndarray]:
    """Map a PyTorch state dict onto our names, strictly: no missing, unexpected or misshapen tensor. Norm weights
    come with the family's offset folded in (Gemma's 1 + w, in fp32 as transformers computes it)."""
    table = weight_table(family, d, config)
    expected = {hf for hf, _, _ in table.values()}
    if d.tie_embeddings:
        expected.add("lm_head.weight")  # tied: may be listed, and must then equal the embedding
    unexpected = sorted(k for k in state_dict if k not in expected and not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise UserError(f"unexpected weights for {family.model_type}: {', '.join(unexpected[:5])}")
    weights = {}
    for name, (hf, shape, rows) in table.items():
        if hf not in state_dict:
            raise UserError(f"missing weight '{hf}' for {family.model_type}")
        array = state_dict[hf].detach().float().cpu().numpy()
        if tuple(array.shape) != shape:
            raise UserError(f"weight '{hf}' has shape {tuple(array.shape)}, expected {shape}")
        if rows is not None:
            array = np.ascontiguousarray(array[rows[0]:rows[1]])
        if family.norm_offset and _is_norm(name):
            array = array + np.float32(family.norm_offset)
        weights[name] = array
    if not d.tie_embeddings:
        return weights
    weights["lm_head"] = weights["embed"]
    return weights


POSITION_SLACK = 512  # rotary rows past the context limit (rope_rows)


def rope_rows(max_context: int, flavour: str, tree_rows: int = 0) -> int:
    """Rows of a step graph's rotary tables. ONNX Runtime's GroupQueryAttention requires its table to cover every
    call's total length (past + T), and calls write rows past the last position a generation reaches: a step's tree
    of up to 256 tokens at the end of the context, a draft's tree levels, a batched call's padding; so the tables
    run POSITION_SLACK rows past the context limit. The trt flavour's table length is its static cache length: the
    context limit and the `tree_rows` its draft's trees take."""
    return max_context + (tree_rows if flavour == "trt" else POSITION_SLACK)


def rope_tables(inv_freq: np.ndarray, scaling: float, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [max_positions, rotary_dim/2] (fp32) from the model's own inverse frequencies."""
    # fp32 angles, as transformers computes them, so that far positions round the same way
    angles = np.outer(np.arange(max_positions, dtype=np.float32), inv_freq.astype(np.float32))
    angles = angles.astype(np.float64)
    return (np.cos(angles) * scaling).astype(np.float32), (np.sin(angles) * scaling).astype(np.float32)


def longrope_policy(config, max_context: int) -> str | None:
    """LongRoPE's factors for a bundle: transformers picks short or long per forward by the sequence's length and
    re-prefills when a generation crosses `original_max_position_embeddings`; an in-place cache cannot, so a bundle
    takes one set for its whole context: "short" when its context limit fits the original length (then equal to
    transformers everywhere), "long" otherwise (equal to transformers on sequences past the original length).
    None: the model has no LongRoPE."""
    rope = _rope_parameters(config, None)
    if rope.get("rope_type") != "longrope":
        return None
    original = rope.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings")
    return "short" if max_context <= int(original) else "long"
