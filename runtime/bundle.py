"""The bundle: a folder with manifest.json, the graphs and the tokenizer files.

The manifest is the contract between exporter and runtime. Besides what the exporter puts in
(model dims, method, tree, dtype, graph I/O), it holds `schema_version` and, under `files`, the
size and sha256 of every other file in the folder, so a copied or edited bundle is caught at load.
Standard library only: the runtime (and a C++ one) must be able to read this without torch.
"""

import hashlib
import json
import os
import shutil
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from specexport.errors import UserError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
_CHUNK = 1 << 20


def sha256_file(path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(folder: Path, manifest: dict) -> dict:
    """Write `folder/manifest.json`: `manifest` plus schema_version and every file's size and sha256."""
    folder = Path(folder)
    files = {}
    for path in sorted(folder.rglob("*")):
        rel = path.relative_to(folder).as_posix()
        if path.is_file() and rel != MANIFEST:
            files[rel] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    final = {**manifest, "schema_version": SCHEMA_VERSION, "files": files}
    (folder / MANIFEST).write_text(json.dumps(final, indent=2) + "\n")
    return final


@contextmanager
def staged_output(dest: Path, overwrite: bool = False):
    """Yield an empty folder beside `dest`; on success it replaces `dest`, on any exception it vanishes.

    So an interrupted export never leaves a half-written bundle where a good one was expected.
    """
    dest = Path(dest)
    if dest.exists() and not overwrite:
        raise UserError(f"{dest} already exists (pass --overwrite to replace it)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    temp = dest.parent / f".{dest.name}.partial-{os.getpid()}"
    shutil.rmtree(temp, ignore_errors=True)
    temp.mkdir()
    try:
        yield temp
        _replace(temp, dest)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise


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


@dataclass(frozen=True)
class Bundle:
    path: Path
    manifest: dict

    @property
    def method(self) -> str:
        """The speculation method's name ("none" = plain decoding)."""
        return self.manifest.get("method", {}).get("name", "none")

    @property
    def precision(self) -> str:
        return self.manifest.get("precision", "fp32")

    @property
    def graphs(self) -> dict:
        return self.manifest.get("graphs", {})

    def file(self, rel) -> Path:
        """Path of a file inside the bundle; `rel` is relative and may not leave the folder."""
        if Path(rel).is_absolute() or ".." in Path(rel).parts:
            raise UserError(f"bundle {self.path}: file name {rel!r} points outside the bundle")
        return self.path / rel


def load_bundle(path, verify: bool = True) -> Bundle:
    """Read and check a bundle folder; with `verify`, every file's sha256 is compared too."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"bundle {path} does not exist")
    if not path.is_dir():
        raise UserError(f"{path} is not a folder (a bundle is a folder with {MANIFEST})")
    if not (path / MANIFEST).is_file():
        raise UserError(f"{path} is not a specexport bundle (no {MANIFEST})")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{path / MANIFEST} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict):
        raise UserError(f"{path / MANIFEST} is not a JSON object")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise UserError(
            f"bundle {path} has schema_version {version!r}; this specexport reads version {SCHEMA_VERSION} "
            "(re-export it with this version)"
        )
    bundle = Bundle(path, manifest)
    _check_files(bundle, verify)
    return bundle


def _check_files(bundle: Bundle, verify: bool) -> None:
    """Every listed file must exist with its size; with `verify`, its hash. Sizes first: it is cheap."""
    files = bundle.manifest.get("files", {})
    for rel, entry in files.items():
        path = bundle.file(rel)
        if not path.is_file():
            kind = "graph" if rel.endswith((".onnx", ".onnx.data")) else "file"
            raise UserError(f"bundle {bundle.path} is incomplete: {kind} {rel} missing")
        if path.stat().st_size != entry["bytes"]:
            raise UserError(
                f"bundle {bundle.path}: file {rel} changed since export "
                f"({path.stat().st_size} bytes, expected {entry['bytes']})"
            )
    if verify:
        for rel, entry in files.items():
            if sha256_file(bundle.file(rel)) != entry["sha256"]:
                raise UserError(f"bundle {bundle.path}: file {rel} changed since export (sha256 mismatch)")
