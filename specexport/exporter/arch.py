"""Architecture specs: one small declaration per supported model type.

Each spec names the Hugging Face weights of a decoder layer with their expected shapes, so
loading is strict: every tensor of the checkpoint is mapped, every shape is checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specexport.errors import UserError

# RoPE variants whose frequencies do not depend on the sequence length (a static cos/sin table).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class ArchSpec:
    """What differs between Llama-family architectures."""

    model_type: str
    qkv_bias: bool = False  # qwen2: q/k/v projections carry a bias
    qk_norm: bool = False  # qwen3: RMSNorm over each head of q and k before RoPE


ARCHS = {
    "llama": ArchSpec("llama"),  # Llama 2/3/3.x, Vicuna, SmolLM2, TinyLlama
    "mistral": ArchSpec("mistral"),
    "qwen2": ArchSpec("qwen2", qkv_bias=True),
    "qwen3": ArchSpec("qwen3", qk_norm=True),
}


@dataclass(frozen=True)
class Dims:
    """Model dimensions, read once from the Hugging Face config."""

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

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    def as_dict(self) -> dict:
        return dict(self.__dict__)


def spec_for(model_type: str) -> ArchSpec:
    if model_type not in ARCHS:
        raise UserError(
            f"unsupported architecture '{model_type}'; supported: {', '.join(sorted(ARCHS))}"
        )
    return ARCHS[model_type]


def dims_from_config(config) -> Dims:
    spec_for(config.model_type)
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        raise UserError(
            f"unsupported RoPE type '{rope_type}'; supported: {', '.join(STATIC_ROPE_TYPES)}"
        )
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise UserError(f"unsupported MLP activation '{act}' (only silu)")
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    max_positions = config.max_position_embeddings
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        max_positions = min(max_positions, window)  # beyond the window the model attends locally
    return Dims(
        model_type=config.model_type,
        vocab=config.vocab_size,
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
        rms_eps=float(config.rms_norm_eps),
        max_positions=int(max_positions),
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        rope_type=rope_type,
    )


def weight_table(spec: ArchSpec, d: Dims) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Our name -> (Hugging Face name, shape). Linear weights are [out, in] as in PyTorch."""
    table = {
        "embed": ("model.embed_tokens.weight", (d.vocab, d.hidden)),
        "norm": ("model.norm.weight", (d.hidden,)),
    }
    if not d.tie_embeddings:
        table["lm_head"] = ("lm_head.weight", (d.vocab, d.hidden))
    for i in range(d.layers):
        p = f"model.layers.{i}."
        layer = {
            "attn_norm": ("input_layernorm.weight", (d.hidden,)),
            "q": ("self_attn.q_proj.weight", (d.q_size, d.hidden)),
            "k": ("self_attn.k_proj.weight", (d.kv_size, d.hidden)),
            "v": ("self_attn.v_proj.weight", (d.kv_size, d.hidden)),
            "o": ("self_attn.o_proj.weight", (d.hidden, d.q_size)),
            "mlp_norm": ("post_attention_layernorm.weight", (d.hidden,)),
            "gate": ("mlp.gate_proj.weight", (d.intermediate, d.hidden)),
            "up": ("mlp.up_proj.weight", (d.intermediate, d.hidden)),
            "down": ("mlp.down_proj.weight", (d.hidden, d.intermediate)),
        }
        if spec.qkv_bias:
            layer["q_bias"] = ("self_attn.q_proj.bias", (d.q_size,))
            layer["k_bias"] = ("self_attn.k_proj.bias", (d.kv_size,))
            layer["v_bias"] = ("self_attn.v_proj.bias", (d.kv_size,))
        if spec.qk_norm:
            layer["q_norm"] = ("self_attn.q_norm.weight", (d.head_dim,))
            layer["k_norm"] = ("self_attn.k_norm.weight", (d.head_dim,))
        for name, (hf, shape) in layer.items():
            table[f"layers.{i}.{name}"] = (p + hf, shape)
    return table


def extract_weights(spec: ArchSpec, d: Dims, state_dict: dict) -> dict[str, np.ndarray]:
    """Map a PyTorch state dict onto our names, strictly: no missing, unexpected or misshapen tensor."""
    table = weight_table(spec, d)
    expected = {hf for hf, _ in table.values()}
    if d.tie_embeddings:
        expected.add("lm_head.weight")  # tied: may be listed, and must then equal the embedding
    unexpected = sorted(k for k in state_dict if k not in expected and not k.endswith("rotary_emb.inv_freq"))
    if unexpected:
        raise UserError(f"unexpected weights for {spec.model_type}: {', '.join(unexpected[:5])}")
    weights = {}
    for name, (hf, shape) in table.items():
        if hf not in state_dict:
            raise UserError(f"missing weight '{hf}' for {spec.model_type}")
        array = state_dict[hf].detach().float().cpu().numpy()
        if tuple(array.shape) != shape:
            raise UserError(f"weight '{hf}' has shape {tuple(array.shape)}, expected {shape}")
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
    """cos/sin tables [max_positions, head_dim/2] (fp32) from the model's own inverse frequencies."""
    # fp32 angles, as transformers computes them, so that far positions round the same way
    angles = np.outer(np.arange(max_positions, dtype=np.float32), inv_freq.astype(np.float32))
    angles = angles.astype(np.float64)
    return (np.cos(angles) * scaling).astype(np.float32), (np.sin(angles) * scaling).astype(np.float32)
