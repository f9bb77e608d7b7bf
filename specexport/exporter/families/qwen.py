"""Qwen2/2.5 (q/k/v biases) and Qwen3 (RMSNorm over each head of q and k before RoPE). Their sliding window, when
`use_sliding_window`, covers the layers from `max_window_layers` on (transformers' `layer_types`)."""

from specexport.exporter.families import Family, register

register(Family("qwen2", qkv_bias=True), Family("qwen3", qk_norm="head"))
