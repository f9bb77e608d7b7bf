"""Our own ONNX Runtime kernels (rows4.c: MatMulRows4, `build --int4-rows`; attention.c: AttentionRows, `build
--attention-rows`), compiled on this machine from the package's source into the specexport cache, the first time a
graph needs them.

Why compiled here, not shipped in a bundle: a bundle then stays data (graphs, weights, JSON), never code that a
runtime would load from a folder someone sent. Why at first use: a custom-op library is compiled against ONNX
Runtime's C API header, which no onnxruntime wheel ships. The header is found where a system install puts it
($ONNXRUNTIME_INCLUDE_DIR, /usr/include/onnxruntime), else taken from Debian's libonnxruntime-dev package (API
version 21, which any later onnxruntime serves), checked against a pinned SHA-256. The compiler is cc (or $CC).

Example: a graph whose manifest entry has "kernels": ["rows4"] (or "attention_rows") loads with
`session_options(...).register_custom_ops_library(str(library()))`.
"""

from __future__ import annotations

import hashlib
import io
import lzma
import os
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import urllib.request
from pathlib import Path

from specexport.errors import UserError
from specexport.fsutil import cache_dir

SOURCES = tuple(Path(__file__).with_name(name) for name in ("ops.c", "rows4.c", "attention.c"))
LIBRARY = "libspecexport_rows.so"
DOMAIN = "specexport.kernels"  # the ops' domain in a graph
ROWS4 = "rows4"  # MatMulRows4, the int4 kernel (a profile's `[engine] int4_kernel`)
ATTENTION_ROWS = "attention_rows"  # AttentionRows, the packed rows' attention
OPS = {"MatMulRows4": ROWS4, "AttentionRows": ATTENTION_ROWS}  # op type in the graph -> its manifest name
NAMES = tuple(OPS.values())  # what a manifest's graph entry may list under "kernels"
HEADER = "onnxruntime_c_api.h"
DEB = ("http://deb.debian.org/debian/pool/main/o/onnxruntime/libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb",
       "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08")
SYSTEM = ("/usr/include/onnxruntime", "/usr/local/include/onnxruntime", "/opt/homebrew/include/onnxruntime")


def used(manifest: dict) -> tuple[str, ...]:
    """Our kernels a bundle's target graph takes (its manifest entry's "kernels")."""
    return tuple(((manifest.get("graphs") or {}).get("target") or {}).get("kernels", ()))


def int4_kernel(manifest: dict) -> str:
    """The int4 kernel a bundle's target graph runs: "rows4" (ours, `--int4-rows`) or "" (MatMulNBits), as a
    profile's `[engine] int4_kernel` names it."""
    return ROWS4 if ROWS4 in used(manifest) else ""


def unavailable() -> str | None:
    """Why our kernels cannot run here (no compiler, no header: library()'s line), or None where they compile.

    Example: `if why := unavailable(): say(f"int4 in MatMulNBits only: {why}")`."""
    try:
        library()
    except UserError as e:
        return str(e)
    return None


def library() -> Path:
    """The compiled library of this package's kernel source (cached by the source's and the header's digest):
    compiled now where it is not yet. One clear line where it cannot be (no compiler, no header)."""
    header = include_dir()
    texts = [path.read_bytes() for path in (*SOURCES, SOURCES[0].with_name("ops.h"), header / HEADER)]
    digest = hashlib.sha256(b"".join(texts)).hexdigest()[:16]
    target = cache_dir() / "kernels" / digest / LIBRARY
    if target.is_file():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not compiler:
        raise UserError("this graph takes specexport's own kernels (--int4-rows, --attention-rows), compiled here at "
                        "first use: no C compiler found (install cc, gcc or clang, or set CC)")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as tmp:
            built = Path(tmp) / LIBRARY
            done = subprocess.run([*shlex.split(compiler), "-O3", "-std=c11", "-shared", "-fPIC", "-ffp-contract=off",
                                   f"-I{header}", *map(str, SOURCES), "-o", str(built), "-lm"], capture_output=True, text=True)
            if done.returncode:
                first = (done.stderr.strip().splitlines() or ["no message"])[0]
                raise UserError(f"compiling specexport's kernels failed: {first}")
            os.replace(built, target)  # whole or not at all, also when two processes compile at once
    except OSError as e:  # a compiler that does not run, a cache folder that cannot be written
        raise UserError(f"compiling specexport's kernels failed: {e}") from None
    return target


def include_dir() -> Path:
    """The folder holding ONNX Runtime's C API header: a system one, else the cached Debian one (module
    docstring), fetched the first time."""
    given = os.environ.get("ONNXRUNTIME_INCLUDE_DIR")
    for folder in ([given] if given else []) + list(SYSTEM):
        if (Path(folder) / HEADER).is_file():
            return Path(folder)
    if given:
        raise UserError(f"ONNXRUNTIME_INCLUDE_DIR has no {HEADER}: {given}")
    cached = cache_dir() / "onnxruntime-headers-1.21"
    if not (cached / HEADER).is_file():
        _fetch_headers(cached)
    return cached


def _fetch_headers(folder: Path) -> None:
    url, digest = DEB
    try:
        with urllib.request.urlopen(url, timeout=60) as reply:
            deb = reply.read()
    except OSError as e:
        raise UserError(f"specexport's kernels compile against ONNX Runtime's C API header: none is "
                        f"installed (set ONNXRUNTIME_INCLUDE_DIR) and Debian's could not be fetched ({e})") from None
    if hashlib.sha256(deb).hexdigest() != digest:
        raise UserError(f"the downloaded {url.rsplit('/', 1)[1]} does not match its pinned SHA-256")
    data = _ar_member(deb, "data.tar.xz")
    staging = Path(tempfile.mkdtemp(prefix=".headers-", dir=_parent(folder)))
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data))) as tar:
        for member in tar.getmembers():  # the headers only, by their base names: no path from the archive is used
            name = Path(member.name).name
            if member.isfile() and member.name.startswith("./usr/include/onnxruntime/") and name.endswith(".h"):
                (staging / name).write_bytes(tar.extractfile(member).read())
    if not (staging / HEADER).is_file():
        shutil.rmtree(staging)
        raise UserError(f"Debian's libonnxruntime-dev has no {HEADER}")
    try:
        staging.rename(folder)
    except OSError:  # another build fetched it meanwhile
        shutil.rmtree(staging)


def _parent(folder: Path) -> Path:
    folder.parent.mkdir(parents=True, exist_ok=True)
    return folder.parent


def _ar_member(archive: bytes, wanted: str) -> bytes:
    """One member of a Unix ar archive (a .deb): 8-byte magic, then 60-byte headers each before its data."""
    if archive[:8] != b"!<arch>\n":
        raise UserError("the downloaded Debian package is not an ar archive")
    at = 8
    while at + 60 <= len(archive):
        header = archive[at:at + 60]
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58].decode().strip())
        if name == wanted:
            return archive[at + 60:at + 60 + size]
        at += 60 + size + (size % 2)
    raise UserError(f"the Debian package has no {wanted}")
