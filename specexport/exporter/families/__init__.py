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
class Family:
    """How one family's graph and checkpoint differ from Llama's.

    - `norms`: which block norms exist and their checkpoint names (PRE_NORMS, SANDWICH_NORMS, POST_NORMS).
    - `norm_offset`: RMSNorm scales by (offset + w) (Gemma: 1).
    - `qkv_bias` / `o_bias`: projection biases; `qk_norm`: RMSNorm of q and k before RoPE, per head ("head") or over
      the whole projection ("full").
    - `fused_qkv` / `fused_gate_up`: the checkpoint stores one matrix (Phi-3), split on load.
    - `scales(config)`: embed_scale, residual_scale, attn_scale, attn_softcap, final_softcap, logits_scaling (dict).
    - `rope_layers(config)`: per layer, whether it rotates (SmolLM3's NoPE layers); None: every layer.
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
