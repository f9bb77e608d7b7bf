"""What a trainer keeps on disk: the output folder, resumable checkpoints, cached target features, training.json.

A checkpoint folder holds the trained weights and the AdamW moments as safetensors and the rest of the state as
JSON (never a pickle); it is replaced as a whole, so a crash leaves the previous one intact. Resuming checks the
settings saved with a checkpoint (or with cached features) against the ones given, and refuses others.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

from tqdm import tqdm

from specexport.errors import UserError, first_line
from specexport.fsutil import check_replaceable, write_json

TRAINING_OUTPUTS = ("training.json", "checkpoint", "features")  # what marks a folder as a trainer's output


# ---------------------------------------------------------------------------------------------------- output


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


def same_settings(made: dict, settings: dict, keys, where: Path) -> None:
    """One clear error when files being resumed were made with other settings (the first of `keys` that differs)."""
    changed = [k for k in keys if made.get(k) != settings[k]]
    if changed:
        k = changed[0]
        raise UserError(f"{where} was made with {k}={made.get(k)!r}, not {settings[k]!r}; "
                        "pass the same settings, or --overwrite to start again")


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


# ------------------------------------------------------------------------------------------------ checkpoint


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
        """Write the held-out chunk once, then a chunk per training group ((kind, items); `samples` sequences in all),
        skipping the chunks already there. `write(name, groups)` makes and saves one chunk and returns what the progress
        bar shows of it."""
        if not (self.folder / "heldout.safetensors").is_file():
            groups = list(heldout_groups)
            log(f"held-out features ({sum(len(items) for _, items in groups)} sequences) ...")
            write("heldout", groups)
        done = len(self.chunks())
        bar = tqdm(total=samples, unit="seq", desc="features", disable=quiet, file=sys.stderr, dynamic_ncols=True)
        with bar:
            for index, group in enumerate(train_groups):
                if index >= done:
                    bar.set_postfix(made=write(f"chunk_{index:05d}", [group]))
                bar.update(len(group[1]))
