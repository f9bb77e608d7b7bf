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
    layer_norm: bool = False  # LayerNorm rather than RMSNorm (biases where the weights have them)
    parallel: bool = False  # attention and MLP on the same normed input, both added to the stream (Cohere2)
    rope_interleaved: bool = False  # RoPE over adjacent pairs rather than halves
    sinks: bool = False  # a learned logit per head joins each softmax (GPT-OSS)
    experts: int = 0  # mixture of experts: how many (0: dense MLPs)
    top_k: int = 0  # experts per token
    expert_dim: int = 0  # each expert's intermediate size
    moe_layers: tuple = ()  # per layer: MoE (True) or a dense MLP
    renormalize: bool = True  # the top k's routing weights rescaled to sum to 1
    sparsemixer: float = 0.0  # > 0: Phi-MoE's sparsemixer routing with this jitter epsilon
    swiglu: tuple = (1.0, 0.0, 0.0)  # the experts' gate: (alpha, beta, limit), families.Experts

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    def window(self, layer: int) -> int:
        return self.windows[layer] if self.windows else 0

    def moe(self, layer: int) -> bool:
        return bool(self.moe_layers) and self.moe_layers[layer]

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
        **_experts(family, config),
        model_type=config.model_type,
        vocab=config.vocab_size,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        rms_eps=float(getattr(config, "rms_norm_eps", None) or config.layer_norm_eps),
        max_positions=int(config.max_position_embeddings),  # the model's own: windows are per layer, in the mask
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        rope_type=sorted(rope_types)[0] if rope_types else "default",
        activation=ACTIVATIONS[act],
        rotary_dim=0 if rotary_dim == head_dim else rotary_dim,
        windows=layer_windows(config),
        rope_layers=rope_names,
        sinks=family.sinks,
        layer_norm=family.layer_norm,
        parallel=family.parallel,
        rope_interleaved=family.rope_interleaved,
        **scales,
    )


def _experts(family: Family, config) -> dict:
    """The Dims fields of a mixture of experts (none for a dense family)."""
    moe = family.experts
    if moe is None:
        return {}
    act = getattr(config, "hidden_act", "silu")
    if ACTIVATIONS.get(act) != "silu":
        raise UserError(f"unsupported expert activation '{act}': experts are SiLU-gated (SwiGLU)")
    count, top_k = moe.count(config), moe.top_k(config)
    if not 0 < top_k <= count:
        raise UserError(f"num_experts_per_tok {top_k} must be in 1..{count} (the number of experts)")
    sparsemixer = 0.0
    if moe.routing == "sparsemixer":
        sparsemixer = float(getattr(config, "router_jitter_noise", 0.0) or 0.0)
        if top_k != 2 or not sparsemixer > 0:
            raise UserError(f"sparsemixer routing takes 2 experts a token and a positive router_jitter_noise; got "
                            f"{top_k} and {sparsemixer}")
    return {"experts": count, "top_k": top_k, "expert_dim": moe.intermediate(config), "sparsemixer": sparsemixer,
            "moe_layers": tuple(bool(x) for x in moe.sparse(config)), "renormalize": bool(moe.renormalize(config)),
            "swiglu": tuple(float(x) for x in moe.swiglu(config))}


@dataclass(frozen=True)
class Part:
    """Which part of a checkpoint tensor one of our weights is, in numpy terms: `index` (a tuple of slices) taken
    first, then `axes` transposed. Phi-3's q is rows 0..q of qkv_proj; GPT-OSS's expert gates are the even columns
    of gate_up_proj [E, hidden, 2I], transposed to [E, I, hidden]."""

    index: tuple = ()
    axes: tuple | None = None

    def of(self, array: np.ndarray) -> np.ndarray:
        array = array[self.index]
        return np.ascontiguousarray(array if self.axes is None else array.transpose(self.axes))


WHOLE = Part()


def _rows(start: int, stop: int) -> Part:
    return Part((slice(start, stop),))


def _expert_parts(moe, d: Dims) -> dict:
    """Our expert weights (gate, up [E, I, hidden], down [E, hidden, I], and biases) as parts of the fused tensors."""
    e, i, h, every = d.experts, d.expert_dim, d.hidden, slice(None)
    halves = (slice(0, None, 2), slice(1, None, 2)) if moe.interleaved else (slice(0, i), slice(i, 2 * i))
    if moe.transposed:
        gate_up_shape, down = (e, h, 2 * i), (moe.down, (e, i, h), Part(axes=(0, 2, 1)))
        gate, up = (Part((every, every, half), (0, 2, 1)) for half in halves)
    else:
        gate_up_shape, down = (e, 2 * i, h), (moe.down, (e, h, i), WHOLE)
        gate, up = (Part((every, half)) for half in halves)
    parts = {"gate": (moe.gate_up, gate_up_shape, gate), "up": (moe.gate_up, gate_up_shape, up), "down": down}
    if moe.biases:
        bias = moe.gate_up + "_bias"
        parts.update(gate_bias=(bias, (e, 2 * i), Part((every, halves[0]))),
                     up_bias=(bias, (e, 2 * i), Part((every, halves[1]))), down_bias=(moe.down + "_bias", (e, h), WHOLE))
    parts = {f"experts.{name}": (hf, shape, part) for name, (hf, shape, part) in parts.items()}
    parts["router"] = (moe.router + ".weight", (e, h), WHOLE)
    if moe.router_bias:
        parts["router_bias"] = (moe.router + ".bias", (e,), WHOLE)
    return parts


def weight_table(family: Family, d: Dims, config=None) -> dict[str, tuple[str, tuple[int, ...], Part]]:
    """Our name -> (checkpoint name, its shape, the Part we take): linear weights are [out, in] as in PyTorch
    (experts' [E, out, in]); a Part slices a fused tensor (Phi-3's qkv_proj and gate_up_proj, MoE experts)."""
    attention_bias = bool(getattr(config, "attention_bias", False))
    qkv_bias, o_bias = family.qkv_bias or attention_bias, family.o_bias or attention_bias
    mlp_bias = bool(getattr(config, "mlp_bias", False))
    table = {
        "embed": ("model.embed_tokens.weight", (d.vocab, d.hidden), WHOLE),
        "norm": ("model.norm.weight", (d.hidden,), WHOLE),
    }
    if family.norm_bias:
        table["norm_bias"] = ("model.norm.bias", (d.hidden,), WHOLE)
    if not d.tie_embeddings:
        table["lm_head"] = ("lm_head.weight", (d.vocab, d.hidden), WHOLE)
    if getattr(config, "lm_head_bias", False):
        table["lm_head_bias"] = ("lm_head.bias", (d.vocab,), WHOLE)
    q, kv, inter = d.q_size, d.kv_size, d.intermediate
    for i in range(d.layers):
        p = f"model.layers.{i}."
        layer = {name: (f"{hf}.weight", (d.hidden,), WHOLE) for name, hf in family.norms.items()}
        if family.norm_bias:
            layer.update({f"{name}_bias": (f"{hf}.bias", (d.hidden,), WHOLE) for name, hf in family.norms.items()})
        if family.fused_qkv:
            fused = (q + 2 * kv, d.hidden)
            layer.update(q=("self_attn.qkv_proj.weight", fused, _rows(0, q)),
                         k=("self_attn.qkv_proj.weight", fused, _rows(q, q + kv)),
                         v=("self_attn.qkv_proj.weight", fused, _rows(q + kv, q + 2 * kv)))
        else:
            layer.update(q=("self_attn.q_proj.weight", (q, d.hidden), WHOLE),
                         k=("self_attn.k_proj.weight", (kv, d.hidden), WHOLE),
                         v=("self_attn.v_proj.weight", (kv, d.hidden), WHOLE))
        layer["o"] = ("self_attn.o_proj.weight", (d.hidden, q), WHOLE)
        if d.moe(i):
            layer.update(_expert_parts(family.experts, d))
        elif family.fused_gate_up:
            fused = (2 * inter, d.hidden)
            layer.update(gate=("mlp.gate_up_proj.weight", fused, _rows(0, inter)),
                         up=("mlp.gate_up_proj.weight", fused, _rows(inter, 2 * inter)))
        else:
            layer.update(gate=("mlp.gate_proj.weight", (inter, d.hidden), WHOLE),
                         up=("mlp.up_proj.weight", (inter, d.hidden), WHOLE))
        if not d.moe(i):
            layer["down"] = ("mlp.down_proj.weight", (d.hidden, inter), WHOLE)
        if qkv_bias:
            layer.update(q_bias=("self_attn.q_proj.bias", (q,), WHOLE), k_bias=("self_attn.k_proj.bias", (kv,), WHOLE),
                         v_bias=("self_attn.v_proj.bias", (kv,), WHOLE))
        if o_bias:
            layer["o_bias"] = ("self_attn.o_proj.bias", (d.hidden,), WHOLE)
        if mlp_bias and not d.moe(i):
            layer.update(gate_bias=("mlp.gate_proj.bias", (inter,), WHOLE), up_bias=("mlp.up_proj.bias", (inter,), WHOLE),
                         down_bias=("mlp.down_proj.bias", (d.hidden,), WHOLE))
        if family.qk_norm == "head":
            layer.update(q_norm=("self_attn.q_norm.weight", (d.head_dim,), WHOLE),
                         k_norm=("self_attn.k_norm.weight", (d.head_dim,), WHOLE))
        elif family.qk_norm == "full":
            layer.update(q_norm=("self_attn.q_norm.weight", (q,), WHOLE), k_norm=("self_attn.k_norm.weight", (kv,), WHOLE))
        if family.sinks:
            layer["sinks"] = ("self_attn.sinks", (d.heads,), WHOLE)
        for name, (hf, shape, part) in layer.items():
            table[f"layers.{i}.{name}"] = (p + hf, shape, part)
    return table


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
