"""What a build will need, said before any work: the bundle's bytes on disk (the target graph twice while ONNX
Runtime writes its optimized copy beside the raw one) and the memory its heaviest step peaks at (building streams the
weights; ONNX Runtime's optimization and validation hold the graph; validation's reference is the whole fp32 model or
one layer at a time). Estimates from the shapes alone, within about a quarter.

Example: `estimate(dims, GraphOptions(precision="int4"), optimize=True, validate=True, whole_reference=False)` for
Llama-3-8B's shape: about 10 GB of disk and 6 GB of memory.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from specexport.errors import UserError
from specexport.exporter.arch import Dims

GB = 1e9


@dataclass(frozen=True)
class Estimate:
    disk: float  # bytes written at the peak (the staging folder)
    memory: float  # resident bytes at the heaviest step

    def line(self, free: float) -> str:
        return (f"needs about {self.disk / GB:.1f} GB of disk ({free / GB:.0f} GB free there) and "
                f"{self.memory / GB:.1f} GB of memory")


def _linear_bytes(graph) -> float:
    """Bytes per weight of a projection at the graph's precision (scales and zero points included)."""
    if graph.precision == "int4":
        return 0.5 + (2 / 64 if graph.flavour == "trt" else 4.5 / 32)
    return {"int8": 1.0, "fp16": 2.0, "bf16": 2.0}.get(graph.precision, 4.0)


def _layer_params(d: Dims, i: int) -> int:
    attention = d.hidden * (2 * d.q_size + 2 * d.kv_size)
    mlp = d.experts * (3 * d.hidden * d.expert_dim + d.hidden) if d.moe(i) else 3 * d.hidden * d.intermediate
    return attention + mlp


def fp32_bytes(d: Dims) -> int:
    """The model's weights in fp32 (what a whole transformers reference holds)."""
    embed = d.vocab * d.hidden
    return 4 * (embed * (1 if d.tie_embeddings else 2) + sum(_layer_params(d, i) for i in range(d.layers)))


def whole_reference(streamed: bool, d: Dims) -> bool:
    """Whether validation loads the whole fp32 model (else the layer-wise one): always for a checkpoint that was not
    streamed, else while its fp32 weights stay within layerwise.WHOLE_REFERENCE_BYTES."""
    from specexport.exporter.layerwise import WHOLE_REFERENCE_BYTES

    return not streamed or fp32_bytes(d) <= WHOLE_REFERENCE_BYTES


def estimate(d: Dims, graph, optimize: bool, validate: bool, whole_reference: bool) -> Estimate:
    compute = 2.0 if graph.precision in ("fp16", "bf16") or (graph.flavour == "trt" and graph.precision == "int4") \
        else 4.0
    embed = d.vocab * d.hidden
    layers = sum(_layer_params(d, i) for i in range(d.layers))
    head = 0 if d.tie_embeddings and graph.precision in ("fp32", "fp16", "bf16") else embed
    graph_bytes = embed * compute + (layers + head) * _linear_bytes(graph)
    largest_layer = max(_layer_params(d, i) for i in range(d.layers)) * 4
    building = 3 * embed * 4 + 2 * largest_layer  # the fp32 embedding or head and its transients, one layer's
    ort = 1.2 * graph_bytes if (optimize or validate) else 0
    reference = 0
    if validate:
        reference = fp32_bytes(d) if whole_reference else 2 * max(embed * 4, largest_layer)
    return Estimate(disk=graph_bytes * (2 if optimize else 1), memory=max(building, ort + reference))


def check_disk(output: Path, need: Estimate) -> float:
    """The free bytes where the bundle goes; one line when they cannot hold it."""
    where = Path(output).resolve()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need.disk:
        raise UserError(f"not enough disk for the bundle at {output}: it needs about {need.disk / GB:.1f} GB, "
                        f"{free / GB:.1f} GB are free there")
    return free
