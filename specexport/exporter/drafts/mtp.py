"""MTP layers that ship inside the target's checkpoint, read as an EAGLE-1-shaped draft (exporter/eagle.py's `mtp`
flags): the user needs no draft at all.

MiMo-7B (XiaomiMiMo; vLLM's model_executor/models/mimo_mtp.py and mimo.py): config.json's
`num_nextn_predict_layers`, and per MTP layer k `model.mtp_layers.{k}.{token_layernorm, hidden_layernorm,
input_proj, final_layernorm}.weight` around a Qwen2 decoder block (`self_attn.{q,k,v}_proj` with biases, `o_proj`,
`mlp.*`, `input_layernorm`, `post_attention_layernorm`). Its forward: the token's embedding (zeroed at position 0)
and the target's last layer output before the final norm, each normed, concatenated hidden first, projected by
input_proj, through the block, final-normed: that is scored by the target's LM head and passed on as the next
step's hidden. Drafts deeper than one token chain the first layer, as vLLM and SGLang do.

Example: `load_mtp(source, config).config.producer == "mimo-mtp"`.
"""

from __future__ import annotations

from specexport.errors import UserError
from specexport.exporter.drafts.common import decoder_fields
from specexport.exporter.eagle import LAYER, DraftConfig, EagleDraft, shapes

PRODUCER = "mimo-mtp"
PREFIX = "model.mtp_layers.0."
NAMES = {"in_norm": "token_layernorm.weight", "hidden_norm": "hidden_layernorm.weight", "fc": "input_proj.weight",
         "norm": "final_layernorm.weight"}


def mtp_layers(config) -> int:
    """MTP layers the target's checkpoint declares (0: none)."""
    count = getattr(config, "num_nextn_predict_layers", 0) or 0
    return count if isinstance(count, int) and not isinstance(count, bool) and count > 0 else 0


def load_mtp(source, config) -> EagleDraft:
    """The first MTP layer of the target at `source` (sources.ModelSource) as a draft, strictly."""
    from specexport.exporter.weights import SafetensorsSource

    where = source.path.name
    if not mtp_layers(config):
        raise UserError(f"{where} has no MTP layers (its config gives no num_nextn_predict_layers): use a draft "
                        "method (eagle3, draft, medusa) or a lookup (suffix, ngram)")
    if source.kind == "gguf" or not SafetensorsSource.usable(source.path):
        raise UserError(f"{where}: MTP layers are read from the model's safetensors shards (a GGUF leaves them out)")
    weights = SafetensorsSource(source.path)
    stored = weights.shapes()
    if not any(name.startswith(PREFIX) for name in stored):
        raise UserError(f"{where}: config.json declares {mtp_layers(config)} MTP layer(s) but the checkpoint holds no "
                        f"{PREFIX}* tensors (MiMo's layout); this MTP layout is not read")
    fields = decoder_fields(config.to_dict(), f"{where}/config.json")
    c = DraftConfig(version=1, **fields, producer=PRODUCER, draft_vocab=fields["vocab"], target_hidden=fields["hidden"],
                    qkv_bias=PREFIX + LAYER["q_bias"] in stored, mtp=True, hidden_first=True, prenorm_feature=True)
    draft = {}
    for name, shape in shapes(c).items():
        key = PREFIX + (NAMES[name] if name in NAMES else LAYER[name.split(".", 2)[2]])
        if key not in stored:
            raise UserError(f"{where}: the MTP layer lacks '{key}'")
        if tuple(stored[key]) != shape:
            raise UserError(f"{where}: '{key}' has shape {tuple(stored[key])}, expected {shape}")
        draft[name] = weights.get(key)
    return EagleDraft(c, draft, {"mtp_layers": mtp_layers(config)})
