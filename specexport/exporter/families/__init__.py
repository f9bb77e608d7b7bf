"""Model families as data: what each decoder family does differently from the plain pre-norm Llama decoder.

A family is one `Family` value in a small module of this package, registered by its transformers `model_type`. The
graph builder reads only the resolved numbers (`arch.Dims`) and the weight table; nothing compares family names.
Adding a family: docs/families.md.

Example: `families.get("gemma2").names["mlp_post_norm"]` is `"post_feedforward_layernorm"`.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Callable

from specexport.errors import UserError

# Each block's norms, as the checkpoint names them under `model.layers.{i}.`: a pre-norm on the block's input
# (`*_norm`), a post-norm on its output before the residual add (`*_post_norm`), or both.
PRE_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
SANDWICH_NORMS = {"attn_norm": "input_layernorm", "attn_post_norm": "post_attention_layernorm",
                  "mlp_norm": "pre_feedforward_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}
POST_NORMS = {"attn_post_norm": "post_attention_layernorm", "mlp_post_norm": "post_feedforward_layernorm"}


def _none(config) -> dict:
    return {}


@dataclass(frozen=True)
class ExpertFiles:
    """How a published checkpoint stores a layer's experts when it stores them one matrix per expert and projection
    (transformers fuses them at load: layouts.ConvertedExperts does the same a layer at a time): the names under
    `model.layers.{i}.`, `{e}` the expert, and the router's checkpoint name.

    Example: Mixtral's `ExpertFiles("block_sparse_moe.experts.{e}.w1.weight", ..., router="block_sparse_moe.gate")`.
    """

    gate: str
    up: str
    down: str
    router: str


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP: the router and the experts as transformers' state dict holds them (v5 fuses a
    checkpoint's per-expert matrices into one tensor per projection at load), and how tokens are routed.

    - `router`: the router linear's name under the layer (its `.weight` [E, hidden], `.bias` if `router_bias`).
    - `gate_up` / `down`: the fused expert tensors, [E, 2I, hidden] (gate rows, then up rows) and [E, hidden, I];
      `transposed`: stored as x @ W, [E, hidden, 2I] and [E, I, hidden] (GPT-OSS); `interleaved`: gate and up
      alternate along the 2I axis (GPT-OSS); `biases`: `{gate_up,down}_bias` tensors [E, 2I] and [E, hidden].
    - `count(config)` experts, `top_k(config)` per token, `intermediate(config)` per expert, `renormalize(config)`:
      the top k's softmax weights rescaled to sum to 1 (Mixtral; Qwen3-MoE by `norm_topk_prob`; GPT-OSS's softmax
      over the top k logits is the same), `sparse(config)` per layer: MoE or a dense MLP.
    - `swiglu(config)`: (alpha, beta, limit) of the experts' gate: clamp(g, max=limit) * sigmoid(alpha g) *
      (clamp(u, +-limit) + beta); (1, 0, 0) is SiLU(g) * u.
    - `routing`: "softmax" (the top k of the router's softmax) or "sparsemixer" (Phi-MoE: two experts, each weighted
      by a softmax over the logits within `router_jitter_noise` of it, in eval mode).
    - `files`: the published per-expert layout (ExpertFiles), where the checkpoint is not stored fused.
    """

    count: Callable[[object], int]
    top_k: Callable[[object], int] = lambda config: int(config.num_experts_per_tok)
    intermediate: Callable[[object], int] = lambda config: int(config.intermediate_size)
    renormalize: Callable[[object], bool] = lambda config: True
    sparse: Callable[[object], list] = lambda config: [True] * config.num_hidden_layers
    swiglu: Callable[[object], tuple] = lambda config: (1.0, 0.0, 0.0)
    routing: str = "softmax"
    router: str = "mlp.gate"
    router_bias: bool = False
    gate_up: str = "mlp.experts.gate_up_proj"
    down: str = "mlp.experts.down_proj"
    transposed: bool = False
    interleaved: bool = False
    biases: bool = False
    files: ExpertFiles | None = None


@dataclass(frozen=True)
class Family:
    """How one family's graph and checkpoint differ from Llama's.

    - `norms`: which block norms exist and their checkpoint names (PRE_NORMS, SANDWICH_NORMS, POST_NORMS).
    - `norm_offset`: RMSNorm scales by (offset + w) (Gemma: 1).
    - `qkv_bias` / `o_bias`: projection biases; `qk_norm`: RMSNorm of q and k before RoPE, per head ("head") or over
      the whole projection ("full").
    - `fused_qkv` / `fused_gate_up`: the checkpoint stores one matrix (Phi-3), split on load.
    - `scales(config)`: embed_scale, residual_scale, attn_scale, attn_softcap, final_softcap, logits_scaling (dict).
    - `rope_layers(config)`: per layer, whether it rotates (SmolLM3's NoPE layers); None: every layer.
    - `layer_norm`: LayerNorm (mean subtracted) instead of RMSNorm, with biases where `norm_bias` (Phi-MoE, Cohere2).
    - `parallel`: attention and MLP read the same normed input and both add to the stream (Cohere2).
    - `rope_interleaved`: RoPE rotates adjacent pairs (x0, x1), (x2, x3)... rather than the two halves (Cohere2).
    - `sinks`: one learned logit per head joins every softmax (GPT-OSS: `self_attn.sinks`).
    - `experts`: the MoE MLP (`Experts`), on the layers its `sparse` names; None: dense MLPs.
    - `refuse(config)`: a config option this family's export cannot express, as one line; None: none.
    """

    model_type: str
    norms: dict = field(default_factory=lambda: dict(PRE_NORMS))
    norm_offset: float = 0.0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: str = ""
    fused_qkv: bool = False
    fused_gate_up: bool = False
    scales: Callable[[object], dict] = _none
    rope_layers: Callable[[object], list] | None = None
    layer_norm: bool = False
    norm_bias: bool = False
    parallel: bool = False
    rope_interleaved: bool = False
    sinks: bool = False
    experts: Experts | None = None
    refuse: Callable[[object], str | None] = lambda config: None


_REGISTRY: dict[str, Family] = {}


def register(*families: Family) -> None:
    for family in families:
        _REGISTRY[family.model_type] = family


def _load() -> None:
    if not _REGISTRY:
        for module in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{module.name}")


def supported() -> list[str]:
    _load()
    return sorted(_REGISTRY)


def get(model_type: str) -> Family:
    """The family of a transformers `model_type`, or one line naming the ones we export."""
    _load()
    if model_type not in _REGISTRY:
        raise UserError(f"unsupported architecture '{model_type}'; supported: {', '.join(supported())}")
    return _REGISTRY[model_type]
