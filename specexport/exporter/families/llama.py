"""Llama 2/3/3.x (also Vicuna, SmolLM2, TinyLlama) and Mistral: the plain pre-norm decoder every family departs from.
Mistral's `sliding_window`, when set, applies to every layer (arch.layer_windows)."""

from specexport.exporter.families import Family, register

register(Family("llama"), Family("mistral"))
