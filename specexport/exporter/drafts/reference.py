"""SafeAILab's EAGLE reference layouts (`yuhuili/EAGLE-*`, `yuhuili/EAGLE3-*`; eagle/model/cnets.py, cnets1.py):

- EAGLE-3: `fc.weight [h, 3H]`, `midlayer.{input_layernorm,hidden_norm,self_attn.*,post_attention_layernorm,mlp.*}`,
  `norm.weight`, `lm_head.weight [Vd, h]`, `d2t`, `t2d`; the aux features are the inputs of layers 2, L//2, L-3
  (no ids in the config);
- EAGLE-1/2: `fc.weight [h, 2h]` (+ `fc.bias` unless the config's `bias` is false), `layers.{i}.*` without layer 0's
  input norm, q/k/v biases for Qwen2 drafts (`qkv_bias`); optionally `embed_tokens.weight` (we take the target's).
"""

from __future__ import annotations

from specexport.exporter.drafts.common import Read, aux_ids, decoder_fields, layer_count, number, optional_parts
from specexport.exporter.eagle import DraftConfig, checkpoint_keys

NAME = "eagle-reference"


def detect(config: dict, keys: set[str]) -> bool:
    return True  # the last reader: the layouts everyone else derives from


def read(config: dict, keys: set[str], where: str, target_layers: int | None, producer: str = NAME, ids=None,
         flags: dict | None = None) -> Read:
    """The reference's names; `ids` (a callable giving our aux layers) and `flags` (DraftConfig fields) for the
    readers that share them."""
    first = "midlayer." if any(k.startswith("midlayer.") for k in keys) else "layers.0."
    version = 3 if first == "midlayer." or first + "hidden_norm.weight" in keys else 1
    fields = decoder_fields(config, where)
    layers = max(1, layer_count(keys, first))
    if version == 3:
        aux = ids() if ids else aux_ids(None, where, False, target_layers)
        c = DraftConfig(version=3, **fields, layers=layers, producer=producer,
                        draft_vocab=int(number(config, "draft_vocab_size", where, fields["vocab"])),
                        target_hidden=int(number(config, "target_hidden_size", where, fields["hidden"])),
                        aux_layers=aux, **optional_parts(keys, first), **(flags or {}))
    else:
        c = DraftConfig(version=1, **fields, layers=layers, producer=producer, draft_vocab=fields["vocab"],
                        target_hidden=fields["hidden"], fc_bias="fc.bias" in keys, **optional_parts(keys, first),
                        **(flags or {}))
    return Read(c, checkpoint_keys(c, first), {"t2d", "embed_tokens.weight"})
