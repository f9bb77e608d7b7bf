"""specexport's own drafts (`specexport train`, the ones we ship): the EAGLE reference's names, and config.json's
`specexport` object, which no other producer writes, marks the aux ids in `eagle_config` as layer INPUTS (the same
key SpecForge and ModelOpt write as layer outputs). Drafts shipped before the mark carry the object too."""

from __future__ import annotations

from specexport.errors import UserError
from specexport.exporter.drafts import reference
from specexport.exporter.drafts.common import Read, aux_ids
from specexport.exporter.eagle import FEATURE_NORMS

NAME = "specexport"
FLAGS = ("hidden_norm", "final_norm", "norm_before_residual", "feature_norm", "norm_output")


def detect(config: dict, keys: set[str]) -> bool:
    return isinstance(config.get("specexport"), dict)


def read(config: dict, keys: set[str], where: str, target_layers: int | None) -> Read:
    mark = config["specexport"]
    if mark.get("aux_layers_are", "inputs") != "inputs":
        raise UserError(f"{where}: specexport.aux_layers_are must be 'inputs', got {mark['aux_layers_are']!r:.40}")
    if mark.get("feature_norm", "") not in FEATURE_NORMS:
        raise UserError(f"{where}: specexport.feature_norm must be one of {FEATURE_NORMS}")
    result = reference.read(config, keys, where, target_layers, producer=NAME,
                            ids=lambda: aux_ids((config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
                                                or config.get("aux_layers"), where, False, target_layers),
                            flags={k: mark[k] for k in FLAGS if k in mark})
    result.meta = {k: v for k, v in mark.items() if k not in FLAGS and k != "aux_layers_are"}
    return result

