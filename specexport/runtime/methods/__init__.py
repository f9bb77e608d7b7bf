"""Speculation methods in the runtime, one module each, found here by name (nothing else compares method names).

A runtime method (`RuntimeMethod`) says what a run may change (`Settings`, a frozen dataclass whose fields carry
their help: the CLI's run/bench/build options and a profile's section of the method are made from it), reads
those settings from the bundle's manifest section with the overrides given, and makes the step's `Proposer`.
"""

from __future__ import annotations

from typing import Protocol

from specexport.errors import UserError
from specexport.options import fields
from specexport.runtime.methods import dflash, draft, eagle, hybrid, medusa, ngram, none, suffix
from specexport.runtime.proposer import Proposer


class RuntimeMethod(Protocol):
    Settings: type  # frozen dataclass of run-time settings (options.setting fields)
    profile_section: str | None  # the profile section holding its settings (EAGLE-1/2 and EAGLE-3 share one)

    def settings(self, section: dict, given: dict): ...  # the bundle's settings with `given` over them, checked
    def proposer(self, engine, settings, sampler) -> Proposer: ...
    def describe(self, settings) -> str: ...  # a few words on the tree, for run and bench summaries
    def tree_info(self, settings) -> dict | None: ...  # the tree, for bench's JSON
    def tokens_per_step(self, settings) -> int: ...  # the most tokens a step verifies, the root included


METHODS: dict[str, RuntimeMethod] = {"none": none.METHOD, "ngram": ngram.METHOD, "draft": draft.METHOD,
                                     "medusa": medusa.METHOD, "eagle": eagle.EAGLE1, "eagle3": eagle.EAGLE3,
                                     "mtp": eagle.MTP, "dflash": dflash.METHOD, "suffix": suffix.METHOD, "hybrid": hybrid.METHOD}
PLAIN_NAME = "none"  # plain decoding: the baseline every method is measured against
PLAIN = METHODS[PLAIN_NAME]


def get(name: str) -> RuntimeMethod:
    if name not in METHODS:
        raise UserError(f"unknown method {name!r:.40} (this specexport runs {', '.join(METHODS)})")
    return METHODS[name]


def owners(setting: str) -> list[str]:
    """The methods that have a setting of this name."""
    return [name for name, m in METHODS.items() if any(f.name == setting for f in fields(m.Settings))]


def check_given(name: str, given: dict) -> None:
    """One line when a setting given does not belong to method `name` (e.g. --depth on a Medusa bundle)."""
    known = {f.name: f for f in fields(get(name).Settings)}
    for key in given:
        if key not in known:
            flag = "--" + key.replace("_", "-")
            for other in owners(key):
                flag = next(f.flag for f in fields(METHODS[other].Settings) if f.name == key)
            raise UserError(f"{flag} applies to {', '.join(owners(key)) or 'no'} bundles; this one is '{name}'")
