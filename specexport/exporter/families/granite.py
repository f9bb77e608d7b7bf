"""Granite 3.x: embedding, residual-branch and attention multipliers, logits divided by `logits_scaling`."""

from specexport.exporter.families import Family, register


def _scales(config) -> dict:
    return {"embed_scale": float(config.embedding_multiplier), "residual_scale": float(config.residual_multiplier),
            "attn_scale": float(config.attention_multiplier), "logits_scaling": float(config.logits_scaling)}


register(Family("granite", scales=_scales))
