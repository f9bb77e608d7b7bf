"""Gemma 1/2/3 (text). RMSNorm scales by (1 + w); the embedding by sqrt(hidden) in the weights' dtype; GeGLU (tanh).
Gemma 2 and 3: sandwich norms, the attention scale query_pre_attn_scalar^-0.5, sliding layers (`layer_types`);
Gemma 2: attention and final logit soft-caps; Gemma 3: q/k head norms and a RoPE table per layer type."""

import numpy as np

from specexport.exporter.families import SANDWICH_NORMS, Family, register


def _scales(config) -> dict:
    scales = {"embed_scale": float(np.float32(config.hidden_size ** 0.5))}
    if getattr(config, "query_pre_attn_scalar", None):
        scales["attn_scale"] = float(config.query_pre_attn_scalar) ** -0.5
    scales["attn_softcap"] = float(getattr(config, "attn_logit_softcapping", None) or 0.0)
    scales["final_softcap"] = float(getattr(config, "final_logit_softcapping", None) or 0.0)
    return scales


def _refuse(config):
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention (an embedding model) is not a decoder to speculate with"
    return None


register(
    Family("gemma", norm_offset=1.0, scales=_scales),
    Family("gemma2", norms=dict(SANDWICH_NORMS), norm_offset=1.0, scales=_scales),
    Family("gemma3_text", norms=dict(SANDWICH_NORMS), norm_offset=1.0, qk_norm="head", scales=_scales,
           refuse=_refuse),
)
