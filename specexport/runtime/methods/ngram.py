"""Prompt lookup (n-gram): drafts are continuations of earlier occurrences of the last n-gram (runtime/ngram.py);
several matches merge into a tree. Training-free and nearly free to run."""

from __future__ import annotations

from dataclasses import dataclass

from specexport.errors import UserError
from specexport.options import from_section, setting, with_given
from specexport.runtime.ngram import NgramIndex
from specexport.runtime.proposer import Proposer
from specexport.runtime.tree import DraftTree, check_draft_length


@dataclass(frozen=True)
class Settings:
    draft_length: int = setting(8, "ngram: draft tokens per match (the tree's depth).")
    max_ngram: int = setting(3, "ngram: longest n-gram looked up.")
    min_ngram: int = setting(2, "ngram: shortest n-gram looked up.")
    max_matches: int = setting(1, "ngram: matches merged into a tree.")

    def __post_init__(self):
        check_draft_length(self.draft_length)
        if not (1 <= self.min_ngram <= self.max_ngram <= 16 and 1 <= self.max_matches <= 16):
            raise UserError("n-gram options must satisfy 1 <= --min-ngram <= --max-ngram <= 16, "
                            "1 <= --max-matches <= 16")


class NgramLookup(Proposer):
    def __init__(self, s: Settings):
        self.index = NgramIndex(max_ngram=s.max_ngram, min_ngram=s.min_ngram, draft_len=s.draft_length,
                                max_matches=s.max_matches)
        self.max_drafts = s.draft_length * s.max_matches

    def start(self, prompt_len: int, capacity: int, cache=None) -> None:
        self.index.reset()

    def propose(self, history: list[int]) -> DraftTree:
        tokens, parents = self.index.propose(history)
        return DraftTree(tokens, parents)


class Ngram:
    Settings = Settings
    profile_section = "ngram"

    def settings(self, section: dict, given: dict) -> Settings:
        """The bundle's settings with `given` over them (each Settings checks itself)."""
        return with_given(from_section(Settings, section, "the bundle's n-gram settings"), given, "n-gram")

    def proposer(self, engine, settings: Settings, sampler) -> NgramLookup:
        return NgramLookup(settings)

    def describe(self, settings: Settings) -> str:
        return f"draft length {settings.draft_length}"

    def tree_info(self, settings: Settings) -> dict:
        return {"tokens_per_step": self.tokens_per_step(settings), "depth": settings.draft_length}

    def tokens_per_step(self, settings: Settings) -> int:
        return settings.draft_length * settings.max_matches + 1


METHOD = Ngram()
