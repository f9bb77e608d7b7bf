"""Suffix lookup at export time: no graph of its own; the datastore of the target's outputs (given, or the one
shipped for the model) is checked against the target's tokenizer and copied into the bundle, where the manifest
lists it with its checksum."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from specexport.errors import UserError
from specexport.exporter.methods.plan import ASSETS, ExportMethod, Plan, Target, settings_dict
from specexport.exporter.save import ExportContext
from specexport.options import setting
from specexport.runtime import datastore as datastores
from specexport.runtime.methods import suffix

DATASTORE = "datastore.npz"  # its name in the bundle


def shipped(target: str) -> Path:
    """Where the datastore shipped for a model lies (it may not exist)."""
    return ASSETS / f"suffix-{target}.npz"


class SuffixPlan(Plan):
    def __init__(self, options: Options, settings: suffix.Settings, target: Target):
        super().__init__(options, settings, target)
        given = options.datastore
        if given == "off":
            self.source = None
        elif given is None:
            self.source = shipped(target.name) if shipped(target.name).is_file() else None
        else:
            self.source = Path(given)
        self.store = None
        if self.source is not None:  # a wrong or broken file fails here, before any work
            self.store = datastores.load(self.source)
            self.store.check_for(target.dims.vocab, None, f"datastore {self.source}")
        self.extra_graphs = 1 if self.source is not None else 0

    def write_graphs(self, ctx: ExportContext) -> dict[str, dict]:
        if self.source is None:
            return {}
        meta = self.store.meta
        ctx.step(f"adding the datastore ({meta.get('documents', '?')} outputs, {meta.get('tokens', '?')} tokens)")
        identity = datastores.tokenizer_identity(ctx.tokenizer.get_vocab())
        self.store.check_for(ctx.dims.vocab, identity, f"datastore {self.source}")
        try:
            shutil.copyfile(self.source, ctx.folder / DATASTORE)
        except OSError as e:
            raise UserError(f"cannot copy the datastore {self.source}: {e.strerror or e}") from None
        return {}

    def manifest(self) -> dict:
        if self.source is None:
            return {**settings_dict(self.settings), "datastore": None}
        return {**settings_dict(self.settings), "datastore": DATASTORE,
                "datastore_meta": {**self.store.meta, "source": self.source.name}}


@dataclass(frozen=True)
class Options:
    datastore: str | None = setting(None, "suffix, hybrid: a datastore of the target's outputs (specexport datastore) "
                                          "to ship in the bundle, or off (default: the one shipped for the model, "
                                          "if any).")


METHOD = ExportMethod(Options, suffix.METHOD, SuffixPlan)
