"""The hybrid at export time: EAGLE-3's plan (the draft graph, the target's features) and suffix lookup's (the
datastore), one manifest section with the hybrid's settings."""

from __future__ import annotations

from dataclasses import dataclass

from specexport.exporter.methods.eagle import EaglePlan
from specexport.exporter.methods.plan import ExportMethod, Target, settings_dict
from specexport.exporter.methods.suffix import SuffixPlan
from specexport.exporter.save import ExportContext
from specexport.options import setting
from specexport.runtime.methods import hybrid


class HybridPlan(EaglePlan):
    def __init__(self, options: Options, settings: hybrid.Settings, target: Target):
        super().__init__("eagle3", 3, options, settings.eagle_settings(), target)
        self.settings = settings
        self.lookup = SuffixPlan(options, settings.suffix_settings(), target)
        self.extra_graphs = EaglePlan.extra_graphs + self.lookup.extra_graphs

    def write_graphs(self, ctx: ExportContext) -> dict[str, dict]:
        graphs = super().write_graphs(ctx)
        self.lookup.write_graphs(ctx)
        return graphs

    def manifest(self) -> dict:
        return {**super().manifest(), **self.lookup.manifest(), **settings_dict(self.settings)}


@dataclass(frozen=True)
class Options:
    draft: str | None = setting(None, "hybrid: the EAGLE-3 draft folder (default: the draft shipped for the model).")
    datastore: str | None = setting(None, "suffix, hybrid: a datastore of the target's outputs (specexport datastore) "
                                          "to ship in the bundle, or off (default: the one shipped for the model, "
                                          "if any).")


METHOD = ExportMethod(Options, hybrid.METHOD, HybridPlan)
