"""Graphs into a bundle folder: build a decoder's graph from a transformers model, save it, describe it for the
manifest; and the export's context that a speculation method's plan writes its own graphs with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import onnx
from onnx import TensorProto
from tqdm import tqdm

from specexport.exporter.arch import (
    dims_from_config,
    extract_weights,
    longrope_policy,
    rope_rows,
    rope_tables,
    spec_for,
)
from specexport.exporter.graph import DecoderGraphBuilder, GraphOptions


@dataclass
class ExportContext:
    """What an export has in hand once the target is loaded (the method plans' write_graphs and validate get it)."""

    source: object  # sources.ModelSource
    dims: object  # arch.Dims of the target
    model: object  # the transformers target, fp32, eval
    tokenizer: object
    folder: Path  # the staging folder the bundle is written into
    graph: GraphOptions  # the export's precision and flavour (plain outputs)
    max_context: int
    quiet: bool
    step: Callable[[str], None]  # announces a progress step


def decoder_builder(model, graph: GraphOptions, max_context: int) -> DecoderGraphBuilder:
    """A graph builder over a transformers decoder's weights and its rotary tables (one per RoPE table its layers
    use)."""
    spec, dims = spec_for(model.config.model_type), dims_from_config(model.config).within(max_context)
    rows = rope_rows(max_context, graph.flavour)
    names = {dims.rope(i) for i in range(dims.layers)} - {""} or {"default"}
    rope = {name: rope_tables(*model_inv_freq(model, name, max_context), rows) for name in sorted(names)}
    weights = extract_weights(spec, dims, model.state_dict(), model.config)
    return DecoderGraphBuilder(spec, dims, weights, graph, rope)


def model_inv_freq(model, name: str, max_context: int) -> tuple:
    """(inverse frequencies, attention scaling) of a transformers decoder's RoPE table `name` ("default", or a
    layer type where the config gives RoPE per type), as its rotary module initialized them; LongRoPE's long
    factors where the bundle's context needs them (arch.longrope_policy)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rotary, prefix = model.model.rotary_emb, "" if name == "default" else f"{name}_"
    inv = getattr(rotary, f"{prefix}original_inv_freq", None)
    inv = getattr(rotary, f"{prefix}inv_freq") if inv is None else inv  # original: before any dynamic update
    scaling = float(getattr(rotary, f"{prefix}attention_scaling"))
    if longrope_policy(model.config, max_context) == "long":
        original = model.config.rope_parameters["original_max_position_embeddings"]
        inv, scaling = ROPE_INIT_FUNCTIONS["longrope"](model.config, None, seq_len=original + 1)
    return inv.detach().float().numpy(), float(scaling)


def write_graph(model, name: str, graph: GraphOptions, max_context: int, folder: Path, quiet: bool,
                extensions: tuple = ()) -> dict:
    """`name`.onnx, the step graph of a transformers decoder (with a method's extensions); its manifest entry."""
    builder = decoder_builder(model, graph, max_context)
    with tqdm(total=builder.d.layers, desc=name, unit="layer", disable=quiet, leave=False) as bar:
        proto = builder.build(extensions, on_layer=lambda i: bar.update(1))
    return save_graph(proto, name, graph, builder.d, folder)


def save_graph(proto, name: str, graph: GraphOptions, dims, folder: Path) -> dict:
    """Save `name`.onnx (weights in `name`.onnx.data); returns its manifest entry."""
    onnx.save(proto, folder / f"{name}.onnx", save_as_external_data=True, location=f"{name}.onnx.data",
              size_threshold=1024)
    return {
        "file": f"{name}.onnx",
        "flavour": graph.flavour,
        "layers": dims.layers,
        "kv_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "kv_dtype": graph.kv_dtype,
        "kv_capacity": _static_capacity(proto),  # the trt flavour's fixed cache length; None: any capacity
        "aux_layers": list(graph.aux_layers),
        "fused_accept": graph.fused_accept,
        "chain_only": graph.chain_only,
        "inputs": _io(proto.graph.input),
        "outputs": _io(proto.graph.output),
    }


def _static_capacity(proto) -> int | None:
    """The cache length fixed in the graph (dim 2 of its first past KV input), if it is a number."""
    for value in proto.graph.input:
        if value.name.startswith("past_key_values."):
            dim = value.type.tensor_type.shape.dim[2]
            return dim.dim_value if dim.HasField("dim_value") else None
    return None


def _io(values) -> list[dict]:
    return [
        {
            "name": v.name,
            "dtype": TensorProto.DataType.Name(v.type.tensor_type.elem_type).lower(),
            "shape": [dim.dim_param or dim.dim_value for dim in v.type.tensor_type.shape.dim],
        }
        for v in values
    ]
