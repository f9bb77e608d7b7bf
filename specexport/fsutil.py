"""Writing outputs safely: a folder appears whole or not at all, and --overwrite replaces only what we wrote.

Used by every command that writes a folder (export and build, train, profile), so none leaves half an output
where a good one was expected, and none deletes a user's files.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from specexport.errors import UserError


def cache_dir() -> Path:
    """Where specexport keeps what it measured or fetched (probes, ONNX Runtime's headers): $SPECEXPORT_CACHE, else
    $XDG_CACHE_HOME/specexport, else ~/.cache/specexport."""
    root = os.environ.get("SPECEXPORT_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specexport"


@contextmanager
def staged_output(dest: Path, overwrite: bool = False, kind: str = "a specexport bundle", is_kind=None):
    """Yield an empty folder beside `dest`; on success it replaces `dest`, on any exception it vanishes (with any
    parent folders it made). `overwrite` replaces only an empty folder or one that `is_kind(folder)` accepts."""
    dest = Path(dest)
    check_replaceable(dest, overwrite, kind, is_kind or (lambda folder: False))
    made = [p for p in [dest.parent, *dest.parent.parents] if not p.exists()]
    check_writable(dest)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        temp = dest.parent / f".{dest.name}.partial-{os.getpid()}"
        shutil.rmtree(temp, ignore_errors=True)
        temp.mkdir()
    except OSError as e:
        _remove_empty(made)
        raise UserError(f"cannot write {dest}: {e.strerror or e}") from None
    try:
        yield temp
        _replace(temp, dest)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        _remove_empty(made)
        raise


def check_replaceable(dest: Path, overwrite: bool, kind: str, is_kind) -> None:
    """One clear error unless `dest` may be written: it does not exist, or `overwrite` is given and it is an empty
    folder or one that `is_kind` (it holds `kind`). Never the current folder or one above it."""
    if dest.exists() and Path.cwd().resolve().is_relative_to(dest.resolve()):
        raise UserError(f"the output {dest} is the current folder or holds it; give a folder to write into")
    if not dest.exists():
        return
    if not overwrite:
        raise UserError(f"{dest} already exists (pass --overwrite to replace it)")
    if not dest.is_dir() or (any(dest.iterdir()) and not is_kind(dest)):
        raise UserError(f"{dest} is not {kind}; --overwrite replaces only that (remove it yourself if it must go)")


def check_writable(path: Path) -> None:
    """One clear error when a file stands where one of `path`'s folders should be."""
    blocking = next((p for p in Path(path).parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:
        raise UserError(f"cannot write {path}: {blocking} is a file, not a folder")


def probe_writable(folder: Path, what: str) -> None:
    """Fail now, in one line, when no file can be created in `folder` (permissions, a read-only mount), rather than
    after the work whose result would go there: a file is created there and removed."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".specexport-probe-"):
            pass
    except OSError as e:
        raise UserError(f"cannot write {what} in {folder}: {e.strerror or e}") from None


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders an output made for itself (deepest first), where they are still empty."""
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


def _replace(new: Path, dest: Path) -> None:
    """Rename `new` to `dest`; an existing `dest` is moved aside first and deleted last."""
    if not dest.exists():
        new.rename(dest)
        return
    old = dest.parent / f".{dest.name}.old-{os.getpid()}"
    dest.rename(old)
    try:
        new.rename(dest)
    except BaseException:
        old.rename(dest)
        raise
    if old.is_dir():
        shutil.rmtree(old)
    else:
        old.unlink()


def write_json(path: Path, data: dict) -> None:
    """Write `data` as JSON whole or not at all (a temporary file renamed over `path`)."""
    temp = Path(path).with_name(Path(path).name + ".tmp")
    temp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(temp, path)
