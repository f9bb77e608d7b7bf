"""Plain decoding: no drafts, every step verifies the root alone. Also the baseline of `bench` and `profile`."""

from __future__ import annotations

from dataclasses import dataclass

from specexport.runtime.proposer import Proposer
from specexport.runtime.tree import DraftTree


@dataclass(frozen=True)
class Settings:
    pass


class PlainDecoding(Proposer):
    max_drafts = 0

    def propose(self, history: list[int]) -> DraftTree:
        return DraftTree.root_only(history[-1])



class Plain:
    Settings = Settings
    profile_section = None  # nothing for a profile to choose

    def settings(self, section: dict, given: dict) -> Settings:
        return Settings()

    def proposer(self, engine, settings: Settings, sampler) -> PlainDecoding:
        return PlainDecoding()

    def describe(self, settings: Settings) -> str:
        return ""

    def tree_info(self, settings: Settings) -> dict | None:
        return None

    def tokens_per_step(self, settings: Settings) -> int:
        return 1


METHOD = Plain()
