"""Medusa: heads on the target's last hidden state guess the next tokens; a fixed rank tree (runtime/rank_tree.py)
turns their ranked candidates into the step's tree, node at depth d holding head d-1's candidate of its rank.

In a fused graph the target call itself returns the candidates at the accepted row (one call per step: verify,
accept, propose). Otherwise (sampling on an older graph, or typical acceptance) the stand-alone heads graph runs
on that row's hidden state."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import numpy as np

from specexport.errors import UserError
from specexport.options import setting, with_given
from specexport.runtime import rank_tree
from specexport.runtime.proposer import Proposer
from specexport.runtime.tree import AcceptMode, DraftTree


@dataclass(frozen=True)
class Settings:
    tree: str = setting("auto:4", "medusa: a preset (" + ", ".join(rank_tree.PRESETS) + "), a JSON file or inline JSON "
                        "of rank paths, or auto:N (N nodes from the heads' measured accuracies). [default: the "
                        "profile's, else auto:4: 4-token trees measured fastest on a 2-core CPU]")
    typical: bool = setting(False, "medusa, temperature > 0: Medusa's typical acceptance. LOSSY: the output no longer "
                                   "follows the model's distribution (longer accepts in exchange).", build=False)


class MedusaHeads(Proposer):
    """`heads()`: the heads graph, asked for where a step accepts outside the target graph (which then brings the
    hidden states, not the candidates the fused graph's heads made)."""

    def __init__(self, tree: rank_tree.RankTree, heads=None, typical: bool = False):
        self.tree, self.parents = tree, tree.parents
        self.max_drafts = tree.size - 1
        self.heads = heads
        self.mode = AcceptMode.TYPICAL if typical else AcceptMode.TOPK
        self.candidates = None

    def wants(self, fused: bool) -> tuple[str, ...]:
        return ("medusa_tokens",) if fused else ("hidden_states",)

    def start(self, prompt_len: int, capacity: int, cache=None) -> None:
        self.candidates = None

    def observe(self, outputs: dict, rows) -> None:
        if "medusa_tokens" in outputs:
            self.candidates = outputs["medusa_tokens"][0]
            return
        hidden = outputs["hidden_states"][0, list(rows)[-1]][None]
        self.candidates = self.heads().run({"hidden": hidden})["medusa_tokens"][0]

    def propose(self, history: list[int]) -> DraftTree:
        if self.candidates is None:
            return DraftTree.root_only(history[-1])
        return DraftTree(self.tree.medusa_tokens(history[-1], self.candidates), self.parents, self.mode,
                         candidates=np.array(self.candidates))


class Medusa:
    Settings = Settings
    profile_section = "medusa"

    def settings(self, section: dict, given: dict) -> Settings:
        """The bundle's tree, or the one given, resolved once against the bundle's heads (a bad tree fails before any
        generation) and kept as JSON paths. With no bundle yet (an empty section), the given spec unresolved."""
        s = with_given(Settings(tree=json.dumps(section["tree"])) if "tree" in section else Settings(), given, "medusa")
        if "heads_count" not in section:
            return s
        return dataclasses.replace(s, tree=json.dumps(self.resolve(s, section).as_lists()))

    @staticmethod
    def resolve(settings: Settings, section: dict) -> rank_tree.RankTree:
        """A tree spec checked against the heads (depth) and the graph (candidates per head); auto:N from the heads'
        measured accuracies."""
        ranks = [row.get("ranks") for row in section.get("accuracy") or [] if isinstance(row, dict)]
        return rank_tree.parse(settings.tree, section["heads_count"], section["top_k"],
                               ranks if ranks and all(ranks) else None)

    def proposer(self, engine, settings: Settings, sampler) -> MedusaHeads:
        if settings.typical and sampler.params.greedy:
            raise UserError("--typical needs --temperature > 0 (greedy acceptance is already exact)")
        return MedusaHeads(self.resolve(settings, engine.bundle.manifest["method"]),
                           lambda: engine.graph("medusa_heads"), settings.typical)

    def describe(self, settings: Settings) -> str:
        tree = rank_tree.parse(settings.tree)
        lossy = ", typical acceptance: LOSSY, the output does not follow the model's distribution"
        return f"tree of {tree.size} tokens, depth {tree.depth}" + (lossy if settings.typical else "")

    def tree_info(self, settings: Settings) -> dict:
        tree = rank_tree.parse(settings.tree)
        return {"tokens_per_step": tree.size, "depth": tree.depth, "choices": tree.as_lists()}

    def tokens_per_step(self, settings: Settings) -> int:
        return rank_tree.size_of(settings.tree)


METHOD = Medusa()
