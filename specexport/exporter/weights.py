"""Weights one tensor at a time, so that an export never holds the whole model.

A source serves checkpoint tensors by name: `SafetensorsSource` reads them from a Hugging Face folder's safetensors
shards (memory-mapped, converted to fp32 one at a time), `GGUFSource` from a GGUF file (each tensor dequantized as
it is read, in transformers' names and layout), `StateDictSource` from a model already in memory (a checkpoint
transformers had to convert whole, a `self:N` draft, the tests' tiny models). `TableWeights` maps a source
onto our names (arch.weight_table), strictly, and keeps only the layer being built.

Example: `TableWeights(family, dims, config, SafetensorsSource(folder))["layers.3.q"]` is layer 3's q_proj as an fp32
[q_size, hidden] array, read from whichever shard holds it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from specexport.errors import UserError
from specexport.exporter import hub
from specexport.exporter.arch import Dims, weight_table
from specexport.exporter.families import Family

# a buffer some old checkpoints saved; MTP layers (MiMo's, Qwen3-Next's), which --method mtp reads (drafts/mtp.py)
_IGNORED = re.compile(r"rotary_emb\.inv_freq$|^(model\.mtp_layers|mtp)\.")


INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"


def shard_files(folder: Path) -> list[Path]:
    """The weights transformers loads from a folder: the shards its index names, else model.safetensors (not any
    other *.safetensors there: Mistral's repositories also hold consolidated.safetensors, in Mistral's own names)."""
    folder = Path(folder)
    if (folder / INDEX).is_file():
        return [folder / name for name in hub.index_shards(folder / INDEX)]
    return [folder / SINGLE] if (folder / SINGLE).is_file() else []


class SafetensorsSource:
    """The tensors of a folder's safetensors shards (shard_files), read on demand (headers only at open)."""

    def __init__(self, folder: Path):
        from safetensors import safe_open

        self.folder = Path(folder)
        self._shard: dict[str, Path] = {}
        self._shapes: dict[str, tuple] = {}
        for file in shard_files(self.folder):
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    self._shard[name] = file
                    self._shapes[name] = tuple(f.get_slice(name).get_shape())

    @staticmethod
    def usable(folder: Path) -> bool:
        """A folder whose weights are safetensors shards, all there (sources names a missing one at load)."""
        files = shard_files(folder)
        return bool(files) and all(f.is_file() for f in files)

    def shapes(self) -> dict[str, tuple]:
        return self._shapes

    def get(self, name: str) -> np.ndarray:
        """One tensor in fp32. The shard is mapped for this read only: a mapping kept open would keep every page
        read so far resident (and counted in the process's memory) until the whole checkpoint was."""
        from safetensors import safe_open

        with safe_open(self._shard[name], framework="pt") as f:  # numpy has no bf16: torch converts
            return f.get_tensor(name).float().numpy()

    def raw(self, name: str) -> np.ndarray:
        """One tensor as stored (MXFP4's uint8 blocks and scales)."""
        from safetensors import safe_open

        with safe_open(self._shard[name], framework="np") as f:
            return f.get_tensor(name)


class GGUFSource:
    """The tensors of a GGUF file under transformers' names, each dequantized to fp32 when read, exactly as
    transformers' GGUF loader converts it (its name map and its per-architecture tensor processor: Llama's q/k rows
    un-permuted, Gemma's norms less 1); tensors transformers does not load (Llama 3's rope_freqs) are left out.

    Only architectures whose processor converts one tensor at a time are served (`None` from `open`); a mixture of
    experts' GGUF, whose processor splits and merges tensors, is converted whole by transformers.
    """

    def __init__(self, path: Path, reader, processor, names: dict[str, str]):
        self.path, self._reader, self._processor = Path(path), reader, processor
        self._tensors = {names[t.name]: t for t in reader.tensors if t.name in names}

    @classmethod
    def open(cls, path: Path, config) -> "GGUFSource | None":
        import torch
        import transformers
        from gguf import GGUFReader
        from transformers import modeling_gguf_pytorch_utils as hf_gguf

        reader = GGUFReader(path)
        architecture = str(hf_gguf.read_field(reader, "general.architecture")[0])
        kind = hf_gguf.TENSOR_PROCESSORS.get(architecture, hf_gguf.TensorProcessor)
        if kind not in (hf_gguf.TensorProcessor, hf_gguf.LlamaTensorProcessor, hf_gguf.Gemma2TensorProcessor):
            return None
        processor = kind(config=config.to_dict())
        with torch.device("meta"):
            skeleton = transformers.AutoModelForCausalLM.from_config(config)
        return cls(path, reader, processor, hf_gguf.get_gguf_hf_weights_map(skeleton, processor))

    def shapes(self) -> dict[str, tuple]:
        return {name: tuple(int(n) for n in reversed(t.shape)) for name, t in self._tensors.items()}

    def get(self, name: str) -> np.ndarray:
        from gguf import dequantize

        tensor = self._tensors[name]
        weights = dequantize(tensor.data, tensor.tensor_type)
        weights = self._processor.process(weights=weights, name=tensor.name).weights
        return np.ascontiguousarray(weights, dtype=np.float32)


class StateDictSource:
    """A model's state dict (torch tensors), served one fp32 array at a time."""

    def __init__(self, state_dict: dict):
        self.state_dict = state_dict

    def shapes(self) -> dict[str, tuple]:
        return {name: tuple(t.shape) for name, t in self.state_dict.items()}

    def get(self, name: str) -> np.ndarray:
        return self.state_dict[name].detach().float().cpu().numpy()


class FirstLayers:
    """A source's tensors without those of layers `n` and up: a `self:N` draft's (the target's first N layers, its
    final norm and LM head)."""

    def __init__(self, source, n: int):
        self.source, self.n = source, n

    def shapes(self) -> dict[str, tuple]:
        return {k: v for k, v in self.source.shapes().items()
                if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= self.n)}

    def get(self, name: str) -> np.ndarray:
        return self.source.get(name)


def _layer(name: str) -> str | None:
    match = re.match(r"layers\.(\d+)\.", name)
    return match.group(0) if match else None


class TableWeights(Mapping):
    """Our weights by our names (arch.weight_table), read from `source` on first use and kept while their layer is
    being built: asking for another layer's weight drops the last layer's. Checked strictly up front, from the
    shapes alone: a missing, unexpected or misshapen tensor is one line. Norm weights come with the family's offset
    folded in (Gemma's 1 + w, in fp32 as transformers computes it); a tied LM head is the embedding."""

    def __init__(self, family: Family, dims: Dims, config, source):
        self.family, self.source = family, source
        self.table = weight_table(family, dims, config)
        if dims.tie_embeddings:
            self.table["lm_head"] = self.table["embed"]
        shapes = source.shapes()
        expected = {hf for hf, _, _ in self.table.values()} | ({"lm_head.weight"} if dims.tie_embeddings else set())
        unexpected = sorted(k for k in shapes if k not in expected and not _IGNORED.search(k))
        if unexpected:
            raise UserError(f"unexpected weights for {family.model_type}: {', '.join(unexpected[:5])}")
        for hf, shape, _ in self.table.values():
            if hf not in shapes:
                raise UserError(f"missing weight '{hf}' for {family.model_type}")
            if tuple(shapes[hf]) != shape:
                raise UserError(f"weight '{hf}' has shape {tuple(shapes[hf])}, expected {shape}")
        self._layer, self._kept = None, {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.table:
            raise KeyError(name)
        layer = _layer(name)
        if layer != self._layer:
            self._layer, self._kept = layer, {}
        if name not in self._kept:
            hf, _, part = self.table[name]
            array = part.of(self.source.get(hf))
            if self.family.norm_offset and (name == "norm" or name.endswith("_norm")):
                array = array + np.float32(self.family.norm_offset)
            self._kept[name] = array
        return self._kept[name]

    def __contains__(self, name) -> bool:  # Mapping's would read the tensor
        return name in self.table

    def __iter__(self):
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)

    def release(self) -> None:
        """Drop the weights kept for the last layer asked for."""
        self._layer, self._kept = None, {}




def extract_weights(family: Family, d: Dims, state_dict: dict, config=None) -> dict[str, np.ndarray]:
    """All our weights from a PyTorch state dict, checked strictly (TableWeights, held whole)."""
    return dict(TableWeights(family, d, config, StateDictSource(state_dict)))
