"""Mixture-of-experts decoders: Mixtral (Mistral attention), Qwen3-MoE (Qwen3 attention; `norm_topk_prob`,
`decoder_sparse_step`, `mlp_only_layers`), GPT-OSS (q/k/v/o biases, attention sinks, alternating sliding layers,
YaRN; a router with a bias, experts stored transposed with interleaved gate/up and biases, a clamped SwiGLU) and
Phi-MoE (Phi-3.5-MoE: LayerNorm with biases, sparsemixer routing, LongRoPE, an optional LM head bias)."""

from specexport.exporter.families import ExpertFiles, Experts, Family, register

# the published checkpoints' per-expert tensors (transformers' conversion mapping fuses them at load)
_W123 = ExpertFiles(*(f"block_sparse_moe.experts.{{e}}.{w}.weight" for w in ("w1", "w3", "w2")),
                    router="block_sparse_moe.gate")
_PROJ = ExpertFiles(*(f"mlp.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")), router="mlp.gate")


def _qwen3_sparse(config) -> list:
    step, dense = int(getattr(config, "decoder_sparse_step", 1) or 1), set(getattr(config, "mlp_only_layers", None) or ())
    return [i not in dense and (i + 1) % step == 0 for i in range(config.num_hidden_layers)]


register(
    Family("mixtral", experts=Experts(count=lambda c: int(c.num_local_experts), files=_W123)),
    Family("qwen3_moe", qk_norm="head",
           experts=Experts(count=lambda c: int(c.num_experts), intermediate=lambda c: int(c.moe_intermediate_size),
                           renormalize=lambda c: bool(c.norm_topk_prob), sparse=_qwen3_sparse, files=_PROJ)),
    Family("gpt_oss", qkv_bias=True, o_bias=True, sinks=True,
           experts=Experts(count=lambda c: int(c.num_local_experts), swiglu=lambda c: (1.702, 1.0, float(c.swiglu_limit)),
                           router="mlp.router", router_bias=True, transposed=True, interleaved=True, biases=True)),
    Family("phimoe", layer_norm=True, norm_bias=True,
           experts=Experts(count=lambda c: int(c.num_local_experts), routing="sparsemixer", router="mlp.router",
                           files=_W123)),
)
