"""Expert layouts that transformers converts at load, converted here one tensor at a time, so that a streamed export
reads a mixture of experts' checkpoint as it is published and still sees the names and values transformers' model
holds (arch.weight_table's names).

- Per-expert tensors (Mixtral, Phi-MoE, Qwen3-MoE publish one matrix per expert and projection, families.ExpertFiles):
  a layer's gate and up matrices stacked into one [E, 2I, hidden] `gate_up_proj` (gate rows, then up rows), its
  down matrices into one [E, hidden, I] `down_proj`, the router renamed, as transformers' conversion mapping does.
- MXFP4 experts (GPT-OSS as OpenAI publishes it): `{gate_up,down}_proj_blocks` (two e2m1 codes a byte, low nibble
  first) and `_scales` (one e8m0 power of two per block of 32 inputs), dequantized to the fp32 [E, in, out] tensor
  transformers' Mxfp4Config(dequantize=True) holds; every e2m1 value times a power of two is exact in bf16 and fp32,
  so the values are transformers' to the bit.

Example: `ConvertedExperts(SafetensorsSource(folder), family, dims).get("model.layers.0.mlp.experts.down_proj")` is
Mixtral's layer-0 `w2` matrices stacked, [8, 4096, 14336] fp32.
"""

from __future__ import annotations

import numpy as np

from specexport.errors import UserError
from specexport.exporter.arch import Dims
from specexport.exporter.families import Family

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)
MXFP4_BLOCK, SCALE_BIAS = 32, 127


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The fp32 [E, in, out] weight of MXFP4 blocks [E, out, in / 32, 16] and scales [E, out, in / 32]."""
    experts, outputs, groups, half = blocks.shape
    out = np.empty((experts, groups * 2 * half, outputs), np.float32)
    for e in range(experts):  # an expert at a time: the transients stay one expert's
        codes = np.stack([blocks[e] & 0x0F, blocks[e] >> 4], axis=-1).reshape(outputs, groups, 2 * half)
        values = np.ldexp(E2M1[codes], scales[e].astype(np.int32)[..., None] - SCALE_BIAS)
        out[e] = values.reshape(outputs, -1).T
    return out


class ConvertedExperts:
    """A source (weights.SafetensorsSource) whose mixture-of-experts tensors are served in transformers' fused
    names and layout, converted from the per-expert or MXFP4 tensors the checkpoint holds; every other tensor as
    it is. A layer whose checkpoint lacks one of an expert's tensors is one line naming it."""

    def __init__(self, source, family: Family, dims: Dims):
        self.source, moe = source, family.experts
        stored = source.shapes()
        self._made: dict[str, tuple] = {}  # our fused name -> (how, the checkpoint names it is made of)
        for i in (i for i in range(dims.layers) if dims.moe(i)):
            p = f"model.layers.{i}."
            for fused, parts in ((moe.gate_up, ("gate", "up")), (moe.down, ("down",))):
                if p + fused in stored:
                    continue
                if p + fused + "_blocks" in stored:
                    self._made[p + fused] = ("mxfp4", (p + fused + "_blocks", p + fused + "_scales"))
                elif moe.files is not None:
                    names = [[p + getattr(moe.files, part).format(e=e) for e in range(dims.experts)] for part in parts]
                    self._made[p + fused] = ("stack", names)
            if moe.files is not None and p + moe.files.router + ".weight" in stored:
                self._made[p + moe.router + ".weight"] = ("rename", (p + moe.files.router + ".weight",))
        self._shapes = dict(stored)
        for name, (how, parts) in self._made.items():
            flat = [n for group in parts for n in (group if how == "stack" else [group])]
            missing = [n for n in flat if n not in stored]
            if missing:
                raise UserError(f"missing weight '{missing[0]}' for {family.model_type}")
            if how == "stack":  # an expert's matrix in another shape than expert 0's
                for group in parts:
                    odd = next((n for n in group if tuple(stored[n]) != tuple(stored[group[0]])), None)
                    if odd:
                        raise UserError(f"weight '{odd}' has shape {tuple(stored[odd])}, expected "
                                        f"{tuple(stored[group[0]])}")
            for n in flat:
                del self._shapes[n]
            self._shapes[name] = self._shape(how, parts, stored)

    @staticmethod
    def _shape(how: str, parts, stored: dict) -> tuple:
        if how == "rename":
            return tuple(stored[parts[0]])
        if how == "mxfp4":
            experts, outputs, groups, half = stored[parts[0]]
            return experts, groups * 2 * half, outputs
        rows = sum(stored[group[0]][0] for group in parts)
        return (len(parts[0]), rows, *stored[parts[0][0]][1:])

    def shapes(self) -> dict[str, tuple]:
        return self._shapes

    def get(self, name: str) -> np.ndarray:
        if name not in self._made:
            return self.source.get(name)
        how, parts = self._made[name]
        if how == "rename":
            return self.source.get(parts[0])
        if how == "mxfp4":
            return mxfp4_dequantize(self.source.raw(parts[0]), self.source.raw(parts[1]))
        out = np.empty(self._shapes[name], np.float32)
        row = 0
        for group in parts:  # gate's rows, then up's, an expert at a time
            for e, part in enumerate(group):
                tensor = self.source.get(part)
                out[e, row:row + tensor.shape[0]] = tensor
            row += tensor.shape[0]
        return out
