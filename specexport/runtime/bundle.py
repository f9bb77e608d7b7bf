"""The bundle: a folder with manifest.json, the graphs and the tokenizer files.

The manifest is the contract between exporter and runtime. Besides what the exporter puts in
(model dims, method, tree, dtype, graph I/O), it holds `schema_version` and, under `files`, the
size and sha256 of every other file in the folder, so a copied or edited bundle is caught at load.
Standard library only: the runtime (and a C++ one) must be able to read this without torch.
"""

import contextlib
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
    """Yield an empty folder beside `dest`; on success it replaces `dest`, on any exception it vanishes (with any
    parent folders it made). So an interrupted export never leaves a half-written bundle where a good one was
    expected. `overwrite` replaces only a bundle or an empty folder, never other files."""
    dest = Path(dest)
    check_replaceable(dest, overwrite, "a specexport bundle", lambda folder: (folder / MANIFEST).is_file())
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


@dataclass(frozen=True)
class Bundle:
    path: Path
    manifest: dict

    @property
    def method(self) -> str:
        """The speculation method's name ("none" = plain decoding)."""
        return self.manifest["method"]["name"]

    @property
    def precision(self) -> str:
        return self.manifest["precision"]

    @property
    def graphs(self) -> dict:
        return self.manifest["graphs"]

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
    check_manifest(manifest, path / MANIFEST)
    bundle = Bundle(path, manifest)
    _check_files(bundle, verify)
    return bundle


# What the runtime reads from a manifest, by dotted key: a missing key or a wrong type is one clear error at load,
# not a crash mid-run. Counts must be >= 1.
_COUNT, _LIST, _TEXT = "count", list, str
_REQUIRED = {"model.name": _TEXT, "model.vocab": _COUNT, "method.name": _TEXT, "precision": _TEXT, "flavour": _TEXT,
             "max_context": _COUNT, "graphs.target.file": _TEXT, "tokenizer.files": _LIST}
_METHODS = {
    "none": {},
    "ngram": {"max_ngram": _COUNT, "min_ngram": _COUNT, "max_matches": _COUNT, "draft_length": _COUNT},
    "draft": {"draft_length": _COUNT, "draft_branching": _LIST, "graphs.draft.file": _TEXT},
    "medusa": {"tree": _LIST, "heads_count": _COUNT, "top_k": _COUNT, "graphs.medusa_heads.file": _TEXT},
    "eagle": {"depth": _COUNT, "top_k": _COUNT, "total_tokens": _COUNT, "graph_top_k": _COUNT, "version": _COUNT,
              "graphs.draft.file": _TEXT},
}
_METHODS["eagle3"] = _METHODS["eagle"]


def check_manifest(manifest: dict, where) -> None:
    """Every key the runtime reads is present with its type (see _REQUIRED, _METHODS); the method is known."""
    def get(key: str):
        value = manifest
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise UserError(f"{where} is malformed: {key} is missing (re-export the bundle)")
            value = value[part]
        return value

    def check(key: str, kind) -> None:
        value = get(key)
        if kind == _COUNT:
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= 1
        else:
            ok = isinstance(value, kind)
        if not ok:
            want = "a positive integer" if kind == _COUNT else f"a {kind.__name__}"
            raise UserError(f"{where} is malformed: {key} must be {want}, not {value!r:.40}")

    for key, kind in _REQUIRED.items():
        check(key, kind)
    name = manifest["method"]["name"]
    if name not in _METHODS:
        raise UserError(f"{where}: unknown method {name!r:.40} (this specexport runs {', '.join(_METHODS)})")
    for key, kind in _METHODS[name].items():
        check(key if key.startswith("graphs.") else f"method.{key}", kind)
    if not isinstance(manifest.get("profile") or {}, dict):
        raise UserError(f"{where} is malformed: profile must be an object")
    files = get("files")
    if not isinstance(files, dict) or not all(
            isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
            for e in files.values()):
        raise UserError(f"{where} is malformed: files must map each file to its bytes and sha256")
    listed = [g.get("file") for g in manifest["graphs"].values() if isinstance(g, dict)] + manifest["tokenizer"]["files"]
    for rel in listed:
        if rel not in files:
            raise UserError(f"{where} is malformed: {rel!r:.60} is used but not listed under files (no checksum)")


def _check_files(bundle: Bundle, verify: bool) -> None:
    """Every listed file must exist with its size; with `verify`, its hash. Sizes first: it is cheap."""
    files = bundle.manifest["files"]
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
