"""Each speculation method's section of the manifest: its keys and their types, and how `info` shows it.

One module per method; SECTIONS is the registry (EAGLE-1/2 and EAGLE-3 share one). A section module has
`SCHEMA` (dotted key -> kind; keys under `graphs.` are graph entries, the others live under `method.`) and
`describe(section)` / `numerics(numerics)`, the lines `specexport info` prints for it.
"""

from __future__ import annotations

from specexport.bundle.methods import dflash, draft, eagle, hybrid, medusa, ngram, none, suffix
from specexport.errors import UserError

SECTIONS = {"none": none, "ngram": ngram, "draft": draft, "medusa": medusa, "eagle": eagle, "eagle3": eagle,
            "mtp": eagle, "dflash": dflash, "suffix": suffix, "hybrid": hybrid}


def get(name):
    """The section module of method `name`; one line for an unknown method."""
    if not isinstance(name, str) or name not in SECTIONS:
        raise UserError(f"unknown method {name!r:.40} (this specexport runs {', '.join(SECTIONS)})")
    return SECTIONS[name]

