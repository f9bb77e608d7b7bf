"""Graphs into a bundle folder: build a decoder's graph from its checkpoint (streamed a layer at a time) or a
transformers model, save it, describe it for the manifest; and the export's context that a speculation method's plan
writes its own graphs with."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import onnx
from onnx import TensorProto
from tqdm import tqdm

from specexport.exporter import budget
from specexport.exporter.arch import dims_from_config, longrope_policy, rope_rows, rope_tables, spec_for
from specexport.exporter.graph import DecoderGraphBuilder, ExternalData, GraphOptions
from specexport.exporter.layerwise import layerwise_model
from specexport.exporter.weights import StateDictSource, TableWeights
from specexport.runtime import kernels


@dataclass(frozen=True)
class Checkpoint:
    """What a decoder's graphs are built from, without the model in memory: its config, its weights by checkpoint
    name (weights.SafetensorsSource, one tensor at a time, or a StateDictSource) and its rotary module (the inverse
    frequencies transformers computes from the config alone)."""

    config: object
    source: object
    rotary: object

    @classmethod
    def of_model(cls, model) -> "Checkpoint":
        """A transformers model in memory (a GGUF or MXFP4 checkpoint it dequantized, a draft, the tests' models)."""
        return cls(model.config, StateDictSource(model.state_dict()), model.model.rotary_emb)

    @classmethod
    def of_source(cls, source, config) -> "Checkpoint":
        """A checkpoint read a tensor at a time (sources.stream_source)."""
        return cls(config, source, rotary_module(config))

    def weights(self) -> TableWeights:
        """The target's weights by our names, strictly checked against the checkpoint's names and shapes."""
        config = self.config
        return TableWeights(spec_for(config.model_type), dims_from_config(config), config, self.source)


def rotary_module(config):
    """transformers' rotary embedding of a config's family, built on the CPU from the config alone (the model's own
    class, found on a weightless skeleton), so RoPE tables are the model's to the bit."""
    import torch
    import transformers

    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    return type(skeleton.model.rotary_emb)(config=config)


@dataclass
class ExportContext:
    """What an export has in hand once the target is open (the method plans' write_graphs and validate get it)."""

    source: object  # sources.ModelSource
    dims: object  # arch.Dims of the target
    checkpoint: Checkpoint  # the target's config and weights, read a tensor at a time
    tokenizer: object
    folder: Path  # the staging folder the bundle is written into
    graph: GraphOptions  # the export's precision and flavour (plain outputs)
    max_context: int
    quiet: bool
    step: Callable[[str], None]  # announces a progress step
    loaded: object = None  # the transformers target, fp32, eval, once something needed it whole
    _layerwise: object = None  # the layer-wise reference, once validation needed it

    @property
    def model(self):
        """The transformers target, loaded whole on first use (a `self:N` draft)."""
        if self.loaded is None:
            from specexport.exporter import sources

            self.loaded, _ = sources.load_model(self.source)
        return self.loaded

    @property
    def reference(self):
        """Validation's transformers reference: the whole model, or, for a streamed checkpoint whose fp32 weights
        pass layerwise.WHOLE_REFERENCE_BYTES (budget.whole_reference), the layer-wise one (the same forward, a layer's weights at a time)."""
        streamed = self.loaded is None and not isinstance(self.checkpoint.source, StateDictSource)
        if budget.whole_reference(streamed, self.dims):
            return self.model
        if self._layerwise is None:
            self._layerwise = layerwise_model(self.checkpoint.source, self.checkpoint.config)
        return self._layerwise


def decoder_builder(checkpoint: Checkpoint, graph: GraphOptions, max_context: int,
                    store: ExternalData | None = None) -> DecoderGraphBuilder:
    """A graph builder over a checkpoint's weights (read as each layer is built) and its rotary tables (one per RoPE
    table its layers use); `store`: the initializers go to its file as they are made."""
    config = checkpoint.config
    spec, dims = spec_for(config.model_type), dims_from_config(config).within(max_context)
    rows = rope_rows(max_context, graph.flavour)
    names = {dims.rope(i) for i in range(dims.layers)} - {""} or {"default"}
    rope = {name: rope_tables(*rope_inv_freq(checkpoint.rotary, config, name, max_context), rows)
            for name in sorted(names)}
    return DecoderGraphBuilder(spec, dims, checkpoint.weights(), graph, rope, store)


def rope_inv_freq(rotary, config, name: str, max_context: int) -> tuple:
    """(inverse frequencies, attention scaling) of a transformers rotary module's RoPE table `name` ("default", or a
    layer type where the config gives RoPE per type), as it initialized them; LongRoPE's long factors where the
    bundle's context needs them (arch.longrope_policy)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    prefix = "" if name == "default" else f"{name}_"
    inv = getattr(rotary, f"{prefix}original_inv_freq", None)
    inv = getattr(rotary, f"{prefix}inv_freq") if inv is None else inv  # original: before any dynamic update
    scaling = float(getattr(rotary, f"{prefix}attention_scaling"))
    if longrope_policy(config, max_context) == "long":
        original = config.rope_parameters["original_max_position_embeddings"]
        inv, scaling = ROPE_INIT_FUNCTIONS["longrope"](config, None, seq_len=original + 1)
    return inv.detach().float().numpy(), float(scaling)


def write_graph(target, name: str, graph: GraphOptions, max_context: int, folder: Path, quiet: bool,
                extensions: tuple = ()) -> dict:
    """`name`.onnx, the step graph of a decoder (a Checkpoint, or a transformers model) with a method's extensions,
    its weights streamed into `name`.onnx.data layer by layer; its manifest entry."""
    checkpoint = target if isinstance(target, Checkpoint) else Checkpoint.of_model(target)
    store = ExternalData(Path(folder) / f"{name}.onnx.data")
    builder = decoder_builder(checkpoint, graph, max_context, store)
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
        **({"kernels": used} if (used := _kernels(proto.graph)) else {}),  # compiled at load
    }


def _kernels(graph) -> list[str]:
    """The manifest names of specexport's own kernels a graph's nodes use (runtime/kernels.OPS)."""
    return sorted({kernels.OPS[n.op_type] for n in graph.node if n.domain == kernels.DOMAIN})


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
