"""EAGLE drafts as their producers publish them: one reader per layout (a small module each), picked from the
files, each giving the one model of exporter/eagle.py, its aux layers in one meaning (the target layers whose
INPUTS make the feature), read strictly: every tensor mapped, every shape checked, safetensors or a weights-only
.bin, never a pickle that runs code.

Readers, in the order they are tried (the first whose `detect` holds reads the folder):
- specexport: ours (a `specexport` object in config.json, which no other producer writes);
- speculators: Red Hat / vLLM's format (`speculators_model_type`, a nested `transformer_layer_config`);
- modelopt: NVIDIA Model Optimizer's export (its `eagle_config` flags, `midlayer.*` names, d2t without t2d);
- specforge: SGLang SpecForge's export (the reference's names, with explicit aux ids or EAGLE 3.1 keys);
- reference: SafeAILab's EAGLE-1/2/3 (`midlayer.*` for EAGLE-3, `fc` + `layers.*` for EAGLE-1/2).

Example: `load_draft("EAGLE3-LLaMA3.1-Instruct-8B", target_layers=32).config.aux_layers == (2, 16, 29)`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from specexport.errors import UserError
from specexport.exporter.drafts import modelopt, ours, reference, specforge, speculators
from specexport.exporter.drafts.common import Read, read_tensors
from specexport.exporter.eagle import EagleDraft, shapes

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
READERS = (ours, speculators, modelopt, specforge, reference)


def load_draft(path: str | Path, target_layers: int | None = None) -> EagleDraft:
    """An EAGLE-1/2/3 draft from a folder (config.json + model.safetensors or pytorch_model.bin) in any layout
    above; one clear line for anything it cannot read."""
    folder = Path(path)
    if folder.is_file() and folder.name not in WEIGHT_FILES:
        raise UserError(f"EAGLE draft {path} is a file; give the draft's folder (config.json and "
                        f"{' or '.join(WEIGHT_FILES)})")
    if folder.is_file():
        folder = folder.parent
    if not folder.is_dir():
        raise UserError(f"EAGLE draft {path} not found")
    files = [folder / name for name in WEIGHT_FILES if (folder / name).is_file()]
    if not files:
        raise UserError(f"{folder}: no {' or '.join(WEIGHT_FILES)}")
    config = _config(folder)
    _refuse_quantized(folder, config)
    tensors = read_tensors(files[0])
    keys = set(tensors)
    reader = next(r for r in READERS if r.detect(config, keys))
    read = reader.read(config, keys, str(folder / "config.json"), target_layers)
    return _assemble(read, tensors, folder)


def _config(folder: Path) -> dict:
    where = folder / "config.json"
    try:
        config = json.loads(where.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{where}: cannot read the draft's config ({e})") from None
    if not isinstance(config, dict):
        raise UserError(f"{where}: not a JSON object")
    return config


def _refuse_quantized(folder: Path, config: dict) -> None:
    """ModelOpt writes hf_quant_config.json beside a quantized draft (FP8, NVFP4 weights with their scales): we read
    unquantized drafts, and quantize them ourselves at build time."""
    quant = config.get("quantization_config")
    where = folder / "hf_quant_config.json"
    if where.is_file():
        try:
            quant = json.loads(where.read_text()).get("quantization", {}) or {"quant_algo": "unknown"}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
            quant = {"quant_algo": "unreadable"}
    if quant:
        algo = (quant.get("quant_algo") or quant.get("quant_method") or "quantized") if isinstance(quant, dict) else quant
        raise UserError(f"{folder}: the draft is quantized ({algo}); specexport reads unquantized drafts (bf16, fp16, "
                        "fp32) and quantizes at build time: export the draft unquantized")


def _assemble(read: Read, tensors: dict[str, np.ndarray], folder: Path) -> EagleDraft:
    c = read.config
    table = shapes(c)
    expected = {read.keys[name] for name in table}
    unexpected = sorted(set(tensors) - expected - read.ignored)
    if unexpected:
        raise UserError(f"{folder}: unexpected tensors in the {c.producer} draft: {', '.join(unexpected[:5])}")
    weights = {}
    for name, shape in table.items():
        key = read.keys[name]
        if key not in tensors:
            raise UserError(f"{folder}: the {c.producer} draft lacks '{key}'")
        array = tensors[key]
        if tuple(array.shape) != shape:
            raise UserError(f"{folder}: '{key}' has shape {tuple(array.shape)}, expected {shape}")
        weights[name] = array.astype(np.int64) if name == "d2t" else array.astype(np.float32)
    if "embed_tokens.weight" in tensors and tensors["embed_tokens.weight"].shape != (c.vocab, c.target_hidden):
        raise UserError(f"{folder}: embed_tokens.weight has shape {tensors['embed_tokens.weight'].shape}, "
                        f"expected {(c.vocab, c.target_hidden)}")
    if "t2d" in tensors and tensors["t2d"].shape != (c.vocab,):
        raise UserError(f"{folder}: t2d has shape {tensors['t2d'].shape}, expected ({c.vocab},)")
    draft = EagleDraft(c, weights, read.meta)
    hot = draft.hot_ids
    if hot.min() < 0 or hot.max() >= c.vocab or len(np.unique(hot)) != len(hot):
        raise UserError(f"{folder}: the d2t map gives target ids out of 0..{c.vocab - 1} or repeats one")
    return draft
