"""Medusa heads: every published on-disk layout, read safely and strictly, and our own.

A head is `n` ResBlocks (x + SiLU(W x + b)) followed by a projection onto the vocabulary: either its own
[vocab, hidden] matrix ("own" style, Medusa v0.1 and Medusa-2) or the base model's LM head ("shared" style,
the TGI "v2" layout). Its input is the target's final hidden state after the final norm; head k (0-based)
predicts the token k + 2 places ahead (the base LM head predicts the next one).

Layouts read (head and layer counts come from the tensor keys, never from config.json, which is wrong
for the v0.1 checkpoints):
- v0.1 `medusa_lm_head.pt` / our own `medusa_lm_head.safetensors`: `{i}.{j}.linear.weight|bias`,
  optionally `{i}.{n}.weight` (own LM head);
- Medusa-2 full models: the same under `medusa_head.`, in the model's safetensors or .bin shards;
- TGI safetensors: `medusa_heads.{i}.medusa_layers.{j}.linear.*`, `medusa_heads.{i}.lm_head.weight`;
- vLLM's (vllm/model_executor/models/medusa.py, its config in transformers_utils/configs/medusa.py):
  `blocks.{i}.layers.{j}.weight` (+ `.bias` with `medusa_fc_bias`, else none), `lm_heads.{i}.weight` (one,
  `lm_heads.0`, shared by every head with `original_lm_head`), optionally a `medusa_heads.` prefix, and with a
  `truncated_vocab_size` below the vocabulary a `token_map` (the token id of each LM head row); config.json's
  `logit_scale` multiplies the heads' logits.
`.pt`/`.bin` files go through `torch.load(weights_only=True)` only: a pickle that would run code is refused.
Our own format is `medusa_lm_head.safetensors` (v0.1 keys, plus an optional `vocab_subset`: the sorted token
ids the heads may propose, the trainer's most frequent labels) and `config.json` (`version: "specexport-1"`)
with the counts, dims, style and the trainer's per-head accuracies. Projecting onto a subset of 8192 tokens
instead of 49152 makes the heads' share of a CPU step six times smaller and rarely changes a top-10 list.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specexport.errors import UserError

WEIGHTS_FILE = "medusa_lm_head.safetensors"
FORMAT_VERSION = "specexport-1"
_KEY_PATTERNS = tuple(re.compile(p) for p in (  # a ResBlock has `param`; an own LM head does not
    r"^(?:medusa_head\.)?(?P<head>\d+)\.(?P<layer>\d+)\.linear\.(?P<param>weight|bias)$",
    r"^(?:medusa_head\.)?(?P<head>\d+)\.(?P<layer>\d+)\.weight$",
    r"^medusa_heads\.(?P<head>\d+)\.medusa_layers\.(?P<layer>\d+)\.linear\.(?P<param>weight|bias)$",
    r"^medusa_heads\.(?P<head>\d+)\.lm_head\.weight$",
    r"^(?:medusa_heads\.)?blocks\.(?P<head>\d+)\.layers\.(?P<layer>\d+)\.(?P<param>weight|bias)$",
    r"^(?:medusa_heads\.)?lm_heads\.(?P<head>\d+)\.weight$",
))
_VLLM = re.compile(r"^(?:medusa_heads\.)?(?:blocks|lm_heads)\.")
_INDEX_KEYS = ("vocab_subset", "token_map", "medusa_heads.token_map")
_SINGLE_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt", "medusa_heads.safetensors")


@dataclass
class MedusaHeads:
    """Per head: its ResBlocks [(W [h, h], b [h]), ...] and its own LM head [vocab, h], or None (shared)."""

    blocks: list[list[tuple[np.ndarray, np.ndarray]]]
    lm_heads: list[np.ndarray] | None
    meta: dict = field(default_factory=dict)  # config.json of our format (accuracies, training), else {}
    vocab_subset: np.ndarray | None = None  # sorted token ids the heads project onto (None: the whole vocabulary)
    token_map: np.ndarray | None = None  # own LM heads of a truncated vocabulary (vLLM): each row's token id

    @property
    def count(self) -> int:
        return len(self.blocks)

    @property
    def layers(self) -> int:
        return len(self.blocks[0])

    @property
    def hidden(self) -> int:
        return self.blocks[0][0][0].shape[0]

    @property
    def style(self) -> str:
        return "shared" if self.lm_heads is None else "own"

    def check(self, hidden: int, vocab: int, where: str) -> None:
        if self.hidden != hidden:
            raise UserError(f"{where}: Medusa heads of hidden size {self.hidden} do not fit a target of hidden size {hidden}")
        rows = vocab if self.token_map is None else len(self.token_map)
        if self.token_map is not None and (self.token_map.ndim != 1 or len(np.unique(self.token_map)) != rows
                                           or self.token_map.min() < 0 or self.token_map.max() >= vocab):
            raise UserError(f"{where}: the heads' token_map must hold distinct token ids in 0..{vocab - 1}")
        if self.lm_heads is not None and self.lm_heads[0].shape[0] != rows:
            raise UserError(f"{where}: Medusa heads with a {self.lm_heads[0].shape[0]}-token vocabulary do not fit "
                            f"a target with {vocab} tokens")
        subset = self.vocab_subset
        if subset is not None and (subset.ndim != 1 or not len(subset) or subset[0] < 0 or subset[-1] >= vocab
                                   or np.any(np.diff(subset) <= 0)):
            raise UserError(f"{where}: the heads' vocab_subset must be sorted, distinct token ids in 0..{vocab - 1}")
        declared = self.meta.get("vocab_size")
        if declared is not None and declared != vocab:
            raise UserError(f"{where}: Medusa heads trained for a {declared}-token vocabulary do not fit a target "
                            f"with {vocab} tokens")

    def state_dict(self) -> dict[str, np.ndarray]:
        """v0.1 key layout (own LM head as `{i}.{n}.weight`)."""
        out = {}
        for i, blocks in enumerate(self.blocks):
            for j, (w, b) in enumerate(blocks):
                out[f"{i}.{j}.linear.weight"], out[f"{i}.{j}.linear.bias"] = w, b
            if self.lm_heads is not None:
                out[f"{i}.{len(blocks)}.weight"] = self.lm_heads[i]
        if self.vocab_subset is not None:
            out["vocab_subset"] = self.vocab_subset
        return out

    def numpy_forward(self, hidden: np.ndarray, lm_head: np.ndarray) -> np.ndarray:
        """Reference logits [heads, n, vocab] for hidden [n, h] (fp32 numpy), `lm_head` the base one; tokens
        outside the vocab subset get -inf."""
        out = []
        for i, blocks in enumerate(self.blocks):
            x = hidden.astype(np.float32)
            for w, b in blocks:
                z = x @ w.T + b
                x = x + z / (1 + np.exp(-z))
            out.append(x @ (lm_head if self.lm_heads is None else self.lm_heads[i]).T)
        logits = np.stack(out)
        if self.token_map is not None:
            full = np.full((*logits.shape[:-1], lm_head.shape[0]), -np.inf, np.float32)
            full[..., self.token_map] = logits
            logits = full
        if self.vocab_subset is not None:
            outside = np.ones(logits.shape[-1], bool)
            outside[self.vocab_subset] = False
            logits[..., outside] = -np.inf
        return logits


def save_heads(heads: MedusaHeads, folder: Path, config: dict) -> None:
    """Our format into `folder` (which must exist): weights first, then config.json, each via a temp name."""
    from safetensors.numpy import save_file

    folder = Path(folder)
    temp = folder / (WEIGHTS_FILE + ".tmp")
    save_file({k: np.ascontiguousarray(v, np.int64 if k == "vocab_subset" else np.float32)
               for k, v in heads.state_dict().items()}, str(temp))
    os.replace(temp, folder / WEIGHTS_FILE)
    meta = {"version": FORMAT_VERSION, "medusa_num_heads": heads.count, "medusa_num_layers": heads.layers,
            "hidden_size": heads.hidden, "head_style": heads.style, **config}
    temp = folder / "config.json.tmp"
    temp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(temp, folder / "config.json")


def load_heads(path: str | Path) -> MedusaHeads:
    """Medusa heads from a folder or a weights file, in any layout above; one clear error otherwise."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"Medusa heads {path} not found")
    tensors, meta, config = _read(path)
    return _assemble(tensors, meta, path, config)


def _read(path: Path) -> tuple[dict[str, np.ndarray], dict, dict]:
    """(the heads' tensors, our format's config, the folder's config.json whatever its producer)."""
    files = [path] if path.is_file() else _files_in(path)
    meta, loaded = {}, {}
    config = (path if path.is_dir() else path.parent) / "config.json"
    if config.is_file():
        try:
            loaded = json.loads(config.read_text())
        except (OSError, ValueError) as e:
            raise UserError(f"{config}: not valid JSON ({e})") from None
        if not isinstance(loaded, dict):
            loaded = {}
        if loaded.get("version") == FORMAT_VERSION:
            meta = loaded
    tensors = {}
    for file in files:
        tensors.update(_read_file(file))
    return tensors, meta, loaded


def _files_in(folder: Path) -> list[Path]:
    for name in _SINGLE_FILES:
        if (folder / name).is_file():
            return [folder / name]
    shards = sorted(folder.glob("*.safetensors")) or sorted(folder.glob("pytorch_model*.bin"))
    if not shards:
        raise UserError(f"{folder} holds no Medusa heads (looked for {', '.join(_SINGLE_FILES)}, "
                        "model safetensors or pytorch_model*.bin)")
    return shards


def _is_medusa_key(key: str) -> bool:
    return key in _INDEX_KEYS or any(p.match(key) for p in _KEY_PATTERNS)


def _read_file(file: Path) -> dict[str, np.ndarray]:
    if file.suffix == ".safetensors":
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(file), framework="pt") as f:
                return {k: _numpy(f.get_tensor(k), k) for k in f.keys() if _is_medusa_key(k)}
        except (SafetensorError, OSError, ValueError) as e:
            raise UserError(f"{file}: not a readable safetensors file ({e})") from None
    if file.suffix in (".pt", ".bin", ".pth"):
        import pickle

        import torch

        try:
            data = torch.load(file, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            raise UserError(f"{file}: refusing to load, it holds more than plain tensors (a pickle that could run code)") from None
        except (OSError, RuntimeError, EOFError, ValueError) as e:
            raise UserError(f"{file}: not a readable PyTorch tensor file ({str(e).splitlines()[0]})") from None
        if not isinstance(data, dict):
            raise UserError(f"{file}: expected a dict of tensors, found {type(data).__name__}")
        return {k: _numpy(v, k) for k, v in data.items() if isinstance(v, torch.Tensor) and _is_medusa_key(k)}
    raise UserError(f"{file}: unknown Medusa weights file type (expected .safetensors, .pt or .bin)")


def _numpy(tensor, key: str) -> np.ndarray:
    return tensor.long().numpy() if key in _INDEX_KEYS else tensor.float().numpy()


def _assemble(tensors: dict[str, np.ndarray], meta: dict, where: Path, config: dict) -> MedusaHeads:
    subset = tensors.pop("vocab_subset", None)
    token_map = tensors.pop("token_map", tensors.pop("medusa_heads.token_map", None))
    vllm = any(_VLLM.match(k) for k in tensors)
    if not tensors:
        raise UserError(f"{where}: no Medusa head tensors found")
    layers: dict[int, dict[int, dict[str, np.ndarray]]] = {}
    lm: dict[int, dict[int, np.ndarray]] = {}
    for key, value in tensors.items():
        m = next(m for m in (p.match(key) for p in _KEY_PATTERNS) if m)
        head, index = int(m["head"]), int(m.groupdict().get("layer") or -1)
        if m.groupdict().get("param"):
            layers.setdefault(head, {}).setdefault(index, {})[m["param"]] = value
        else:
            lm.setdefault(head, {})[index] = value
    heads = sorted(layers)
    if heads != list(range(len(heads))):
        raise UserError(f"{where}: Medusa head indices {heads} are not 0..{len(heads) - 1}")
    count = len(layers[0])
    blocks = []
    for i in heads:
        if sorted(layers[i]) != list(range(count)):
            raise UserError(f"{where}: head {i} has ResBlocks {sorted(layers[i])}, head 0 has {count}")
        head = []
        for j in range(count):
            part = layers[i][j]
            if vllm and set(part) == {"weight"}:  # vLLM's blocks have a bias only with medusa_fc_bias
                part = {**part, "bias": np.zeros(part["weight"].shape[0], np.float32)}
            if set(part) != {"weight", "bias"}:
                raise UserError(f"{where}: head {i} ResBlock {j} lacks its {'bias' if 'weight' in part else 'weight'}")
            w, b = part["weight"], part["bias"]
            first = blocks[0][0][0].shape if blocks else w.shape
            if w.ndim != 2 or w.shape[0] != w.shape[1] or b.shape != (w.shape[0],) or w.shape != first:
                raise UserError(f"{where}: head {i} ResBlock {j} has weight {list(w.shape)} and bias {list(b.shape)}; "
                                "expected a square [hidden, hidden] weight and a [hidden] bias, the same for every head")
            head.append((w, b))
        blocks.append(head)
    lm_heads = None
    if vllm and config.get("original_lm_head") and sorted(lm) == [0]:  # one LM head for every head
        lm = {i: lm[0] for i in heads}
    if lm:
        if sorted(lm) != heads:
            raise UserError(f"{where}: only heads {sorted(lm)} of {heads} have their own LM head")
        lm_heads = []
        for i in heads:
            (index, w), *rest = lm[i].items()
            if rest or index not in (-1, count):
                raise UserError(f"{where}: head {i}'s LM head is not after its {count} ResBlocks")
            hidden = blocks[0][0][0].shape[0]
            if w.ndim != 2 or w.shape[1] != hidden or (lm_heads and w.shape != lm_heads[0].shape):
                raise UserError(f"{where}: head {i}'s LM head has shape {list(w.shape)}; expected [vocab, {hidden}]")
            lm_heads.append(w)
    scale = config.get("logit_scale", 1.0) if vllm else 1.0
    if lm_heads is not None and scale != 1.0:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
            raise UserError(f"{where}: logit_scale must be a positive number, got {scale!r:.40}")
        lm_heads = [w * np.float32(scale) for w in lm_heads]
    if token_map is not None and (lm_heads is None or subset is not None):
        raise UserError(f"{where}: a token_map needs the heads' own LM heads and no vocab_subset")
    return MedusaHeads(blocks, lm_heads, meta, subset, token_map)

