"""Red Hat / vLLM's `speculators` format (vllm-project/speculators, models/eagle3/config.py and core.py):
config.json with `speculators_model_type: "eagle3"`, `speculators_config` (its proposal's `speculative_tokens`,
the `verifier`), the draft's decoder layer as a nested `transformer_layer_config` (Llama or Qwen3 keys, written as
the difference from that class's defaults), `draft_vocab_size`, `target_hidden_size`, `norm_before_residual`,
`eagle_aux_hidden_state_layer_ids` (layer INPUTS, as vLLM captures them), `norm_before_fc` (one norm over the
concatenated features: `input_norm.weight`), `fc_norm` (one per feature: `fc_norm.{k}.weight`), `norm_output`.
Tensors `layers.{i}.*` (the converter renames the reference's `midlayer.*`, which we also take), `fc`, `norm`,
`lm_head`, `d2t`, `t2d`, optionally `embed_tokens`; Qwen3 layers carry `self_attn.{q,k}_norm`."""

from __future__ import annotations

from specexport.errors import UserError
from specexport.exporter.drafts.common import Read, aux_ids, decoder_fields, flag, layer_count, number, optional_parts
from specexport.exporter.eagle import DraftConfig, checkpoint_keys

NAME = "speculators"
MODEL_TYPE = "eagle3"  # the speculators_model_type of its EAGLE-3 drafts (dflash, mtp, peagle name others)
DFLASH_TYPE = "dflash"  # ... and of its DFlash drafts (exporter/dflash.py reads them)


def detect(config: dict, keys: set[str]) -> bool:
    return "speculators_model_type" in config


def read(config: dict, keys: set[str], where: str, target_layers: int | None) -> Read:
    kind = config["speculators_model_type"]
    if kind != MODEL_TYPE:
        hint = ": build it with --method dflash" if kind == DFLASH_TYPE else ""
        raise UserError(f"{where}: a speculators '{kind}' draft is not an EAGLE-3 draft{hint} (EAGLE reads "
                        "speculators_model_type eagle3)")
    layer = layer_config(config.get("transformer_layer_config"), where)
    fields = decoder_fields(layer, where)
    if layer.get("layer_types") and any(t != "full_attention" for t in layer["layer_types"]):
        raise UserError(f"{where}: draft layers with sliding-window attention are not supported")
    first = "midlayer." if any(k.startswith("midlayer.") for k in keys) else "layers.0."
    before_fc, each = flag(config, "norm_before_fc", where), flag(config, "fc_norm", where)
    if before_fc and each:
        raise UserError(f"{where}: norm_before_fc and fc_norm exclude each other")
    c = DraftConfig(version=3, **fields, layers=max(1, layer_count(keys, first)), producer=NAME,
                    draft_vocab=int(number(config, "draft_vocab_size", where, fields["vocab"])),
                    target_hidden=int(number(config, "target_hidden_size", where, fields["hidden"])),
                    aux_layers=aux_ids(config.get("eagle_aux_hidden_state_layer_ids"), where, False, target_layers),
                    norm_before_residual=flag(config, "norm_before_residual", where),
                    feature_norm="concat" if before_fc else "each" if each else "",
                    norm_output=flag(config, "norm_output", where), **optional_parts(keys, first))
    keys_of = checkpoint_keys(c, first)
    if c.feature_norm == "concat":
        keys_of["feature_norm"] = "input_norm.weight"
    return Read(c, keys_of, {"t2d", "embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight"},
                meta(config))


def layer_config(layer, where: str) -> dict:
    """The nested layer config as its transformers class makes it (speculators writes only the differences from the
    class's defaults; the class derives head_dim and the RoPE parameters as it does for the verifier)."""
    if not isinstance(layer, dict):
        raise UserError(f"{where}: a speculators draft needs its 'transformer_layer_config' object")
    kind = layer.get("model_type", "qwen3")
    if kind not in ("llama", "qwen3"):
        raise UserError(f"{where}: a speculators draft layer of type '{kind}'; specexport reads llama and qwen3 layers")
    from transformers import CONFIG_MAPPING

    try:
        return CONFIG_MAPPING[kind](**{k: v for k, v in layer.items() if k != "model_type"}).to_dict()
    except (TypeError, ValueError, KeyError) as e:
        raise UserError(f"{where}: transformer_layer_config is not a valid {kind} config ({e})") from None


def meta(config: dict) -> dict:
    """speculators_config's verifier and speculative token count, for the manifest."""
    spec = config.get("speculators_config") or {}
    proposals = spec.get("proposal_methods") or [{}]
    verifier = spec.get("verifier") or {}
    return {k: v for k, v in (("verifier", verifier.get("name_or_path")),
                              ("speculative_tokens", proposals[0].get("speculative_tokens"))) if v is not None}
