"""The proposer: what guesses a step's tree. A documented interface (typing.Protocol); a proposer may subclass it
explicitly to take the defaults of the calls it does not need (no target outputs, no state across steps)."""

from __future__ import annotations

from typing import Protocol

from specexport.runtime.tree import DraftTree


class Proposer(Protocol):
    """The engine calls, per generation, `start`, then per step `propose`, verifies and accepts the tree, and calls
    `accepted` and (when it `wants` target outputs) `observe`.

    - `max_drafts`: the most draft nodes a tree can hold (the engine reserves that much KV cache).
    - `wants(fused)`: the target outputs it reads (Medusa's candidates or hidden states, EAGLE's features); the
      engine asks the target for them on every prompt chunk and every step. `fused`: whether the step accepts
      inside the graph.
    - `observe(outputs, rows)`: those outputs, and the rows now committed (the prompt chunk's, or the accepted
      path's); the last one is where the next step grows from.
    - `propose(history)`: the step's tree, root first; its root is history[-1], emitted but not yet verified.
    - `accepted(path)`: the accepted tree nodes, root first (a proposer with a KV cache keeps their rows).
    - `start(prompt_len, capacity, cache)`: a new generation of at most `capacity` target rows. `cache`: where a
      proposer with a draft graph keeps its rows (a slot of the scheduler's draft pool), else None (its own).

    A proposer with a draft graph of its own (EAGLE, a draft model) is a runtime/drafting.DraftingProposer: its
    proposal is a generator of draft calls, so that a scheduler can make many sequences' calls as one.
    """

    max_drafts: int

    def propose(self, history: list[int]) -> DraftTree: ...

    def wants(self, fused: bool) -> tuple[str, ...]:
        return ()

    def start(self, prompt_len: int, capacity: int, cache=None) -> None:
        return None

    def observe(self, outputs: dict, rows) -> None:
        return None

    def accepted(self, path: list[int]) -> None:
        return None
