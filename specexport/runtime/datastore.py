"""The suffix method's datastore: the target's own outputs on many prompts, as one file that loads fast.

One `.npz` file (numpy's zip of arrays; read with allow_pickle=False, so loading runs no code), holding:

- `format` ("specexport-suffix-datastore") and `version`;
- `meta`: a JSON object: the model's name, the tokenizer's identity (`tokenizer_sha256`: sha256 of its vocabulary,
  every token with its id, added tokens included), the vocabulary size, the prefix array's depth, and how it was
  made (prompts, samples, new tokens);
- `tokens` (int32): the outputs back to back, each after a -1 separator, the array starting and ending with one;
- `order` (int32): the prefix array (runtime/suffix.py): every position whose token and next token are not
  separators, sorted by the tokens read backwards from it, `depth` deep (ties in position order).

A corrupt or truncated file, another format or version, or a datastore of another tokenizer is one line.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import zipfile
from functools import lru_cache
from pathlib import Path

import numpy as np

from specexport.errors import UserError, first_line
from specexport.runtime.suffix import MATCH_DEPTH, StaticIndex

FORMAT = "specexport-suffix-datastore"
VERSION = 1
META_KEYS = {"model": str, "tokenizer_sha256": str, "vocab": int, "depth": int}


def tokenizer_identity(vocab: dict[str, int]) -> str:
    """sha256 of a vocabulary (token -> id, added tokens included): the same ids mean the same tokens."""
    items = sorted(vocab.items(), key=lambda kv: (kv[1], kv[0]))
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode()).hexdigest()


def prefix_order(tokens: np.ndarray, depth: int = MATCH_DEPTH) -> np.ndarray:
    """The prefix array of `tokens` (int32, -1 separators): the positions p with tokens[p] and tokens[p + 1] not
    separators, sorted by tokens[p], tokens[p - 1], ... (`depth` deep; before the start reads as -1)."""
    tokens = np.asarray(tokens, dtype=np.int64)
    nxt = np.append(tokens[1:], -1)
    positions = np.flatnonzero((tokens >= 0) & (nxt >= 0))
    keys = [np.where(positions >= d, tokens[np.maximum(positions - d, 0)], -1) for d in range(depth)]
    return positions[np.lexsort(keys[::-1])].astype(np.int32)  # lexsort: the last key is the primary one


def concatenate(documents: list[list[int]]) -> np.ndarray:
    """Documents back to back, each after a -1 separator, ending with one."""
    parts = [np.array([-1], np.int32)]
    for doc in documents:
        parts += [np.asarray(doc, np.int32), np.array([-1], np.int32)]
    return np.concatenate(parts)


def write(path: Path, documents: list[list[int]], meta: dict) -> dict:
    """Write a datastore of `documents` (token lists) to `path` whole (a temporary file renamed into place); `meta`
    needs META_KEYS but `depth`. Returns the meta written."""
    tokens = concatenate(documents)
    meta = {**meta, "depth": MATCH_DEPTH, "documents": len(documents), "tokens": int((tokens >= 0).sum())}
    order = prefix_order(tokens)
    path = Path(path)
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", suffix=".npz", delete=False) as f:
        try:
            np.savez_compressed(f, format=np.array(FORMAT), version=np.array(VERSION),
                                meta=np.array(json.dumps(meta)), tokens=tokens, order=order)
        except BaseException:
            os.unlink(f.name)
            raise
    os.chmod(f.name, 0o644)  # a temporary file is private; the datastore is not
    os.replace(f.name, path)
    return meta


class Datastore:
    """A loaded datastore: its meta and its static prefix-array index."""

    def __init__(self, tokens: np.ndarray, order: np.ndarray, meta: dict):
        self.meta = meta
        self.index = StaticIndex(tokens, order, meta["depth"])

    def documents(self) -> list[list[int]]:
        """The outputs it holds, as token lists."""
        tokens = self.index.tokens
        cuts = np.flatnonzero(tokens < 0)
        return [tokens[a + 1:b].tolist() for a, b in zip(cuts, cuts[1:])]

    def check_for(self, vocab: int, tokenizer_sha256: str | None, where) -> None:
        """One line unless it was made with this vocabulary size and (when given) this tokenizer."""
        if self.meta["vocab"] != vocab or (tokenizer_sha256 and self.meta["tokenizer_sha256"] != tokenizer_sha256):
            raise UserError(f"{where} was built for another tokenizer (model {self.meta['model']!r:.60}, vocabulary "
                            f"{self.meta['vocab']}); build one for this model with specexport datastore BUNDLE")


def load(path: Path, where: str | None = None) -> Datastore:
    """Read and check a datastore file; one line for anything wrong with it."""
    where = where or str(path)
    path = Path(path)
    if not path.is_file():
        raise UserError(f"datastore {where} " + ("is a folder" if path.is_dir() else "not found"))
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in ("format", "version", "meta", "tokens", "order") if k in f.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as e:
        raise UserError(f"datastore {where} is corrupt or truncated ({first_line(e)})") from None
    if arrays.get("format") is None or str(arrays["format"]) != FORMAT:
        raise UserError(f"{where} is not a specexport suffix datastore")
    if int(arrays.get("version", -1)) != VERSION:
        raise UserError(f"datastore {where} has format version {arrays.get('version')}; this specexport reads "
                        f"version {VERSION} (build it again with specexport datastore)")
    try:
        meta = json.loads(str(arrays["meta"]))
    except (KeyError, json.JSONDecodeError):
        raise UserError(f"datastore {where} is corrupt (its meta is not JSON)") from None
    if not isinstance(meta, dict) or any(not isinstance(meta.get(k), t) for k, t in META_KEYS.items()):
        raise UserError(f"datastore {where} is corrupt (its meta lacks {', '.join(META_KEYS)})")
    tokens, order = arrays.get("tokens"), arrays.get("order")
    if (tokens is None or order is None or tokens.dtype != np.int32 or order.dtype != np.int32 or tokens.ndim != 1
            or order.ndim != 1 or len(tokens) < 1 or tokens[0] != -1 or tokens[-1] != -1
            or tokens.min() < -1 or tokens.max() >= meta["vocab"] or not 1 <= meta["depth"] <= 256):
        raise UserError(f"datastore {where} is corrupt (its token arrays are malformed)")
    if len(order) and (order.min() < 1 or order.max() >= len(tokens) - 1 or (tokens[order] < 0).any()
                       or (np.diff(tokens[order]) < 0).any()):
        raise UserError(f"datastore {where} is corrupt (its prefix array is not sorted)")
    return Datastore(tokens, order, meta)


@lru_cache(maxsize=4)
def cached(path: str, sha256: str) -> Datastore:
    """A bundle's datastore, loaded once per process (keyed by its checksum in the manifest)."""
    return load(Path(path))
