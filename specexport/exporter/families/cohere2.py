"""Cohere2 (Command R7B, Command A): LayerNorm without bias; attention and MLP in parallel on one normed input;
RoPE over interleaved pairs, on the sliding layers only (the full layers have no positions); logits times
`logit_scale`; tied embeddings."""

from specexport.exporter.families import Family, register

register(Family("cohere2", norms={"attn_norm": "input_layernorm"}, layer_norm=True, parallel=True,
                rope_interleaved=True, scales=lambda c: {"logits_scaling": 1.0 / float(c.logit_scale)},
                rope_layers=lambda c: [t == "sliding_attention" for t in c.layer_types]))
