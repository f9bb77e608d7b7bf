"""The bundle: a folder with manifest.json, the graphs and the tokenizer files.

The manifest is the contract between exporter and runtime. Besides what the exporter puts in
(model dims, method, tree, dtype, graph I/O), it holds `schema_version` and, under `files`, the
size and sha256 of every other file in the folder, so a copied or edited bundle is caught at load.
Standard library only: the runtime (and a C++ one) must be able to read this without torch.
"""

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from specexport.bundle import kinds, methods
from specexport.errors import UserError
from specexport.fsutil import staged_output

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


def staged_bundle(dest: Path, overwrite: bool = False):
    """A staged output folder (fsutil.staged_output) that --overwrite may replace only when it is a bundle."""
    return staged_output(dest, overwrite, "a specexport bundle", lambda folder: (folder / MANIFEST).is_file())


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

    @property
    def profile_kind(self) -> str | None:
        """The kind of hardware ("cpu", "gpu") the bundle's profile was chosen for; None without a profile."""
        return ((self.manifest.get("profile") or {}).get("hardware") or {}).get("kind")

    @property
    def profile_cores(self) -> int | None:
        """The cores of the CPU the bundle's profile was chosen for (its tree and settings suit that many); None for
        a GPU profile or none."""
        detected = (self.manifest.get("profile") or {}).get("detected") or {}
        return detected.get("cores") if self.profile_kind == "cpu" else None

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


# What the runtime reads from every manifest, by dotted key: a missing key or a wrong type is one clear error at
# load, not a crash mid-run. Each method's section adds its own keys (bundle/methods).
_REQUIRED = {"model.name": kinds.TEXT, "model.vocab": kinds.COUNT, "method.name": kinds.TEXT,
             "precision": kinds.TEXT, "flavour": kinds.TEXT, "max_context": kinds.COUNT,
             "graphs.target.file": kinds.TEXT, "tokenizer.files": kinds.LIST}


def check_manifest(manifest: dict, where) -> None:
    """Every key the runtime reads is present with its type (_REQUIRED and the method's section); the method is
    known."""
    def get(key: str):
        value = manifest
        for part in key.split("."):
            if not isinstance(value, dict) or part not in value:
                raise UserError(f"{where} is malformed: {key} is missing (re-export the bundle)")
            value = value[part]
        return value

    def check(key: str, kind) -> None:
        value = get(key)
        if not kinds.has_type(value, kind):
            raise UserError(f"{where} is malformed: {key} must be {kinds.type_name(kind)}, not {value!r:.40}")

    for key, kind in _REQUIRED.items():
        check(key, kind)
    try:
        section = methods.get(manifest["method"]["name"])
    except UserError as e:
        raise UserError(f"{where}: {e}") from None
    for key, kind in section.SCHEMA.items():
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
