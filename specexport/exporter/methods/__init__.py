"""Speculation methods at export time, found here by name (nothing else compares method names).

An export method has `Options` (its build-only options: the heads, the draft; a frozen dataclass of
options.setting fields, which the CLI makes `build` options from), `runtime` (its runtime method, whose Settings
the bundle saves) and `plan(options, settings, target)`, which checks what it was given before any work and then
says what it adds to the export (methods/plan.py). Plain decoding and prompt lookup add no graph.
"""

from __future__ import annotations

from specexport.errors import UserError
from specexport.exporter.methods import dflash, draft, eagle, hybrid, medusa, suffix
from specexport.exporter.methods.plan import ExportMethod, NoOptions, PlainPlan, Plan
from specexport.runtime import methods as runtime_methods

METHODS: dict[str, ExportMethod] = {
    "none": ExportMethod(NoOptions, runtime_methods.METHODS["none"], PlainPlan),
    "ngram": ExportMethod(NoOptions, runtime_methods.METHODS["ngram"], Plan),
    "draft": draft.METHOD,
    "medusa": medusa.METHOD,
    "eagle": eagle.EAGLE1,
    "eagle3": eagle.EAGLE3,
    "mtp": eagle.MTP,
    "dflash": dflash.METHOD,
    "suffix": suffix.METHOD,
    "hybrid": hybrid.METHOD,
}


def get(name: str) -> ExportMethod:
    if name not in METHODS:
        raise UserError(f"unknown method {name!r:.40}; choose from {', '.join(METHODS)}")
    return METHODS[name]
