"""Training proposers for a target on ShareGPT, on a CPU: one module per trainer, found through this registry.

Each trainer has a frozen `Config` (its options, with their defaults and help: the train command's options come
from these fields), `train(model_spec, output, config, *, resume, overwrite, quiet) -> dict` (what it
writes to training.json) and `summary(result, output) -> list[str]` (what the command prints after training).
The modules it shares: data (ShareGPT and the target's features of it), loop (shared options, checks, the
schedule and the step loop), output (the output folder, checkpoints, cached features, training.json).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from specexport.errors import UserError
from specexport.train import dflash, draft, eagle, medusa


@dataclasses.dataclass(frozen=True)
class Trainer:
    about: str  # one line for the train command's help
    Config: type  # a frozen dataclass of options (specexport.options.setting fields)
    train: Callable[..., dict]
    summary: Callable[..., list[str]]


TRAINERS = {
    "draft": Trainer("a small draft model distilled from the target", draft.Config, draft.train, draft.summary),
    "medusa": Trainer("Medusa heads", medusa.Config, medusa.train, medusa.summary),
    "eagle": Trainer("an EAGLE-1/2 draft decoder", eagle.Config, eagle.train, eagle.summary),
    "eagle3": Trainer("an EAGLE-3 draft decoder", eagle.Config3, eagle.train, eagle.summary),
    "dflash": Trainer("a DFlash block draft", dflash.Config, dflash.train, dflash.summary),
}


def get(name: str) -> Trainer:
    if name not in TRAINERS:
        raise UserError(f"unknown training method '{name}' (known: {', '.join(TRAINERS)})")
    return TRAINERS[name]
