"""SmolLM3: NoPE layers (`no_rope_layers[i] == 0`: no rotation), an optional window on sliding layers."""

from specexport.exporter.families import Family, register


def _rope_layers(config) -> list:
    return [bool(x) for x in config.no_rope_layers]


register(Family("smollm3", rope_layers=_rope_layers))
