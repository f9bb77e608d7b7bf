"""The transformers reference on the same model and prompt ids as a bundle (`bench --compare-hf`)."""

from __future__ import annotations

import time

import torch

from specexport.exporter.sources import load_model, resolve


def hf_speed(source: str, ids: list[list[int]], eos: list[int], max_new_tokens: int, progress) -> float:
    """transformers `generate` tokens/s (greedy, fp32, CPU) on the model at `source` (the manifest's model source)."""
    progress("  loading the transformers model for --compare-hf")
    model, _ = load_model(resolve(source))
    tokens = seconds = 0.0
    with torch.inference_mode():
        model.generate(torch.tensor([ids[0]]), max_new_tokens=4, do_sample=False)  # warm-up
        for prompt_ids in ids:
            start = time.perf_counter()
            out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=eos or None)
            seconds += time.perf_counter() - start
            tokens += out.shape[1] - len(prompt_ids)
    rate = round(tokens / seconds, 2) if seconds else 0.0
    progress(f"  transformers generate: {rate:.1f} tokens/s")
    return rate
