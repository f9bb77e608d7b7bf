"""What the draft readers share: the tensors of a checkpoint file, a decoder layer's config keys, the layers and
optional tensors a checkpoint holds, and aux ids turned from one producer's meaning into ours."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specexport.errors import UserError
from specexport.exporter.eagle import LAYER, default_aux_layers

SCALED_ROPE = ("llama3", "yarn", "linear")  # position-independent scalings: one table serves every position


@dataclass
class Read:
    """What a reader makes of a folder: the draft's config, our name -> checkpoint key, the keys it may hold and
    we do not use (t2d, the target's embeddings), and our metadata (config.json's `specexport` object)."""

    config: object  # eagle.DraftConfig
    keys: dict[str, str]
    ignored: set[str] = field(default_factory=set)
    meta: dict = field(default_factory=dict)


def read_tensors(path: Path) -> dict[str, np.ndarray]:
    """Tensors of a checkpoint file: safetensors, or a .bin read with weights_only (never running a pickle)."""
    import torch

    if path.suffix == ".safetensors":  # through torch: published drafts are often bf16, which numpy lacks
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            state = load_file(str(path))
        except (SafetensorError, OSError) as e:
            raise UserError(f"cannot read {path}: {e}") from None
        return {k: (v.float() if v.is_floating_point() else v).numpy() for k, v in state.items()}
    import pickle

    try:
        state = torch.load(str(path), map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, OSError, EOFError) as e:
        raise UserError(f"refusing {path.name}: not a plain tensor checkpoint ({str(e).splitlines()[0][:120]})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise UserError(f"{path}: expected a dict of tensors")
    return {k: (v.float() if v.is_floating_point() else v).numpy() for k, v in state.items()}


def number(config: dict, key: str, where: str, default=None):
    value = config.get(key, default)
    if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise UserError(f"{where}: config.json needs a positive '{key}'")
    return value


def decoder_fields(config: dict, where: str) -> dict:
    """DraftConfig's fields from a Hugging Face decoder config (Llama or Qwen3 keys): sizes, norm epsilon, RoPE."""
    hidden = int(number(config, "hidden_size", where))
    heads = int(number(config, "num_attention_heads", where))
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise UserError(f"{where}: rope_scaling / rope_parameters must be an object, got {rope!r:.40}")
    theta = config.get("rope_theta") or rope.get("rope_theta") or 10000.0
    kind = rope.get("rope_type", rope.get("type", "default")) or "default"
    if kind not in ("default", *SCALED_ROPE):
        raise UserError(f"{where}: RoPE of type '{kind}' in a draft is not supported (plain, "
                        f"{', '.join(SCALED_ROPE)})")
    scaling = None
    if kind != "default":
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "type")} | {"rope_type": kind}
    return dict(hidden=hidden, intermediate=int(number(config, "intermediate_size", where)), heads=heads,
                kv_heads=int(number(config, "num_key_value_heads", where, heads)),
                head_dim=int(config.get("head_dim") or hidden // heads),
                rms_eps=float(number(config, "rms_norm_eps", where, 1e-6)),
                rope_theta=float(number({"rope_theta": theta}, "rope_theta", where)), rope_scaling=scaling,
                vocab=int(number(config, "vocab_size", where)))


def layer_count(keys: set[str], first: str, rest: str = "layers.{i}.") -> int:
    """Decoder layers in the checkpoint: the first (`first` prefix) and those after it numbered 1, 2, ..."""
    pattern = re.compile("^" + re.escape(rest).replace(re.escape("{i}"), r"(\d+)") + r"\.?")
    numbers = {int(m[1]) for m in map(pattern.match, keys) if m} - {0}
    if not any(k.startswith(first) for k in keys):
        return 0
    count = 1 + len(numbers)
    if numbers and max(numbers) != count - 1:
        raise UserError(f"the draft's decoder layers are numbered {sorted(numbers)} after its first: not 1..{count - 1}")
    return count


def optional_parts(keys: set[str], first: str) -> dict:
    """The optional tensors the first layer holds, as DraftConfig flags: biases and Qwen3's q/k norms."""
    def has(part):
        return first + LAYER[part] in keys

    return dict(qkv_bias=has("q_bias"), o_bias=has("o_bias"), mlp_bias=has("gate_bias"), qk_norm=has("q_norm"))


def aux_ids(ids, where: str, outputs: bool, target_layers: int | None) -> tuple[int, ...]:
    """Aux ids in our meaning (layer inputs) from a producer's: `outputs` adds one (the output of layer i is the
    input of layer i + 1); none given: EAGLE-3's convention, the same in both meanings."""
    if ids is None:
        if target_layers is None:
            raise UserError(f"{where}: an EAGLE-3 draft without aux layer ids needs the target's layer count")
        return default_aux_layers(target_layers)
    if not isinstance(ids, list | tuple) or not ids or not all(isinstance(i, int) and not isinstance(i, bool)
                                                                 for i in ids):
        raise UserError(f"{where}: EAGLE-3 aux layer ids must be a list of integers, got {ids!r}")
    if target_layers is not None and outputs and max(ids) >= target_layers - 1:
        raise UserError(f"{where}: aux layer {max(ids)} is given as a layer OUTPUT (this producer's meaning); the "
                        f"output of the target's last layer ({target_layers - 1}) is not exported as a feature")
    return tuple(i + 1 if outputs else i for i in ids)


def flag(config: dict, key: str, where: str, default: bool = False) -> bool:
    value = config.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise UserError(f"{where}: '{key}' must be true or false, got {value!r:.40}")
    return value
