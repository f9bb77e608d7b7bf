"""Phi-3, Phi-3.5 and Phi-4(-mini): fused qkv_proj and gate_up_proj (split on load), partial rotary (Phi-4-mini),
LongRoPE (arch.longrope_policy: the long or short factors for the whole bundle, by its context limit)."""

from specexport.exporter.families import Family, register

register(Family("phi3", fused_qkv=True, fused_gate_up=True))
