"""SGLang SpecForge's EAGLE-3 export (specforge/export/to_sglang.py: the reference's identity names, `midlayer.*`,
`fc`, optional `fc_norm.{k}`, `norm`, `lm_head`, `t2d`, `d2t`; embeddings dropped; one layer). Its configs
(configs/*-eagle3*.json) may give `eagle_config.eagle_aux_hidden_state_layer_ids` as layer OUTPUTS (SGLang adds one
to capture them: "for the ith layer, it takes the output of the (i-1)th layer"), e.g. [1, 11, 21] for
gpt-oss-20b, and EAGLE 3.1's `fc_norm` (a norm per feature before fc) and `norm_output`, which in SpecForge means
the final norm before the LM head (default true; the hidden passed on is the pre-norm one either way, unlike
speculators' key of the same name)."""

from __future__ import annotations

from specexport.exporter.drafts import reference
from specexport.exporter.drafts.common import Read, aux_ids, flag

NAME = "specforge"


def detect(config: dict, keys: set[str]) -> bool:
    midlayer = any(k.startswith("midlayer.") for k in keys)
    return midlayer and ("eagle_config" in config or "fc_norm" in config or "norm_output" in config)


def read(config: dict, keys: set[str], where: str, target_layers: int | None) -> Read:
    ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    flags = {"final_norm": flag(config, "norm_output", where, True),
             "feature_norm": "each" if flag(config, "fc_norm", where) else ""}
    return reference.read(config, keys, where, target_layers, producer=NAME,
                          ids=lambda: aux_ids(ids, where, True, target_layers), flags=flags)
