"""NVIDIA Model Optimizer's EAGLE-3 export (modelopt/torch/export/plugins/hf_spec_export.py; the Megatron path in
unified_export_megatron.py): `model.safetensors` with the reference's names, `midlayer.*` (a deep Megatron draft:
`midlayer.{i}.*`, whose later layers name their input norm `hidden_norm`), `fc`, `norm`, `lm_head` (the base's
[vocab, h] head copied in where the draft has none), `d2t` where the draft vocabulary is reduced, no `t2d` or
`embed_tokens`. config.json: Llama keys, `draft_vocab_size`, the base model's RoPE scaling copied in, and a nested
`eagle_config` whose `eagle_aux_hidden_state_layer_ids` are layer OUTPUTS (ModelOpt hooks each layer's output;
default [1, L//2-1, L-4]) with its flags: `use_aux_hidden_state` (EAGLE-3's features), `use_last_layernorm` (the
final norm), `use_input_layernorm_in_first_layer` (Megatron: the hidden's norm, absent when false),
`parallel_draft_step` (more than one: parallel draft heads, which we do not run). A quantized draft
(hf_quant_config.json) is refused by the caller."""

from __future__ import annotations

from specexport.errors import UserError
from specexport.exporter.drafts.common import Read, aux_ids, decoder_fields, flag, layer_count, number, optional_parts
from specexport.exporter.eagle import DraftConfig, checkpoint_keys

NAME = "modelopt"
FLAGS = ("use_aux_hidden_state", "use_input_layernorm_in_first_layer", "use_last_layernorm", "use_mtp_layernorm",
         "next_layer_regular", "parallel_draft_step", "parallel_draft_heads_num_layers")


def detect(config: dict, keys: set[str]) -> bool:
    eagle = config.get("eagle_config")
    return isinstance(eagle, dict) and any(k in eagle for k in FLAGS)


def read(config: dict, keys: set[str], where: str, target_layers: int | None) -> Read:
    eagle = config["eagle_config"]
    if not flag(eagle, "use_aux_hidden_state", where, True):
        raise UserError(f"{where}: a ModelOpt draft without aux hidden states (use_aux_hidden_state false) is EAGLE-1 "
                        "shaped with ModelOpt's own norms, which specexport does not read")
    steps = eagle.get("parallel_draft_step", 1)
    if steps not in (None, 1) or any(k.startswith("parallel_draft_heads.") for k in keys):
        raise UserError(f"{where}: a ModelOpt parallel draft (parallel_draft_step {steps}) is not supported")
    deep = any(k.startswith("midlayer.0.") for k in keys)
    first, rest = ("midlayer.0.", "midlayer.{i}.") if deep else ("midlayer.", "layers.{i}.")
    fields = decoder_fields(config, where)
    vocab = fields["vocab"]
    draft_vocab = int(number(config, "draft_vocab_size", where, vocab))
    if draft_vocab != vocab and "d2t" not in keys:
        raise UserError(f"{where}: a draft vocabulary of {draft_vocab} (the target's is {vocab}) without its d2t map "
                        "(ModelOpt's Megatron export leaves it out): the draft's tokens cannot be mapped")
    c = DraftConfig(version=3, **fields, layers=max(1, layer_count(keys, first, rest)), producer=NAME,
                    draft_vocab=draft_vocab,
                    target_hidden=int(number(config, "target_hidden_size", where, fields["hidden"])),
                    aux_layers=aux_ids(eagle.get("eagle_aux_hidden_state_layer_ids") or None, where, True,
                                       target_layers),
                    hidden_norm=first + "hidden_norm.weight" in keys,
                    final_norm=flag(eagle, "use_last_layernorm", where, True), **optional_parts(keys, first))
    names = checkpoint_keys(c, first, rest)
    if deep:  # a later layer's input norm is exported as its hidden_norm
        names.update({k: v.replace("input_layernorm", "hidden_norm") for k, v in names.items()
                      if k.endswith(".attn_norm")})
    return Read(c, names, {"embed_tokens.weight"})
