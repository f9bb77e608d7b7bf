"""Build the target graph directly from the weights (no tracing).

One graph serves prefill, single-token decode and tree verification. Every step graph takes the step's compact
tree mask (`tree_mask [B, T, K]`, bool) and the past length (`past_len [B]`, the past is visible to every row) and
builds its additive attention bias from them inside the graph (`DecoderGraphBuilder.step_attention`). Three flavours:

- ``ort``: ONNX Runtime's fused contrib ops (GroupQueryAttention with an additive bias over
  past+new tokens, SkipSimplifiedLayerNormalization, RotaryEmbedding, DynamicQuantizeMatMul /
  MatMulNBits). The KV cache is one preallocated buffer per layer, bound as both past and present.
- ``onnx``: standard ONNX ops only (opset 24: RMSNormalization, RotaryEmbedding, TensorScatter into
  the preallocated cache, Attention with a mask and ``nonpad_kv_seqlen``), the portable form that
  the ONNX spec defines, validated on ONNX Runtime. Its bias spans the whole cache capacity.
- ``trt``: the standard ops TensorRT (>= 10.15) parses, under its rules (`specexport check-trt` proves them
  statically): Attention takes 4-D Q/K/V and the 4-D additive mask only (the mask hides the cache rows past the
  valid length, so no ``nonpad_kv_seqlen``); each layer's K and V caches ``[B, kv_heads, S_max, head_dim]`` are
  graph inputs with a static S_max (the graph's rotary table length: the bundle's context), written by
  TensorScatter (linear, axis -2) into the same-named ``present.*`` outputs that alias them; fp16 or bf16
  activations (TensorRT 11 is strongly typed), int4 as signed blocks of 64 with fp16 scales and no zero point;
  the fused acceptance is greedy only (sampling is accepted by the runtime: exporter/fused.py says why). fp32 is
  allowed for validation on ONNX Runtime's CPU provider.

Ragged rows (the ort flavour's step graphs): a batched step pads every sequence's tree to the widest, but the graph
computes the per-row work (norms, projections, MLP: nearly all of it) for the real rows only. `live_rows [R]`
names them (b * T + t) and `padded_rows [B, T]` maps each position of the padded layout to one of them;
attention runs in the padded layout, where a padding row repeats some real row, sees only itself (its tree mask)
and writes cache rows past its sequence's length, which nothing reads. A dense step passes every row.

Rotary: the ort flavour's GroupQueryAttention rotates Q and K itself at the step's `position_ids` (the tree's
depths after the past) and takes the packed QKV projection, so a layer has no Split or RotaryEmbedding nodes
(given `query_seqlens`, GQA honours every position id, a branching tree with no past included: validated);
the other flavours apply RoPE before attention with the same position ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from specexport.errors import UserError
from specexport.exporter import quant
from specexport.exporter.arch import Dims
from specexport.exporter.families import Family
from specexport.exporter.fused import INPUTS as ACCEPT_INPUTS
from specexport.exporter.fused import add_accept, add_batch_accept
from specexport.runtime import cpu, kernels

PRECISIONS = ("fp32", "int8", "int4", "fp16", "bf16")
FLAVOURS = ("ort", "onnx", "trt")
INT8_ROWS = ("blocks", "channel")  # GraphOptions.int8_rows: the per-row int8 kernels
SERVING_INT8 = "channel"  # the one `build --serving` takes (and its probe measures): exact in batches, cheap rows
TRT_PRECISIONS = ("fp16", "bf16", "int4", "fp32")  # fp32: the same structure, for validation on ORT's CPU provider
OPSET = 24

_FLOAT_TYPES = {"fp32": TensorProto.FLOAT, "fp16": TensorProto.FLOAT16, "bf16": TensorProto.BFLOAT16}


@dataclass(frozen=True)
class GraphOptions:
    precision: str = "fp32"
    flavour: str = "ort"
    aux_layers: tuple[int, ...] = ()  # export the input of these layers (EAGLE-3 features)
    fused_accept: bool = False  # verify in the graph: greedy or sampling acceptance of the step's tree (exporter/fused.py)
    # plain decoding's graph (ort): every step is a chain (prefill chunks, one token), so GroupQueryAttention's own
    # causal path replaces the tree mask's bias: the graph reads only tree_mask's shape (~15 nodes fewer per step)
    chain_only: bool = False
    # int8 weights of the ort flavour: 7 bits where this CPU's int8 kernels saturate (runtime/cpu.py)
    int8_bits: int = field(default_factory=cpu.int8_weight_bits)
    # int8 of the ort flavour with activations quantized per row, so that a row's logits do not depend on the other
    # rows of its call (docs/precision.md): "blocks" (8-bit MatMulNBits blocks of 32: quick one row at a time),
    # "channel" (per-channel weights, MatMulIntegerToFloat: cheap extra rows); "" per call (DynamicQuantizeMatMul)
    int8_rows: str = ""
    # int4 of the ort flavour in specexport's own kernel (runtime/kernels/rows4.c: MatMulRows4), whose extra rows
    # are cheap and whose rows are each quantized alone; compiled on the machine that loads the graph
    int4_rows: bool = False
    # attention of the ort flavour's real rows only, in specexport's own kernel (runtime/kernels/attention.c:
    # AttentionRows): no sequence pays for the widest one's rows, and a row's sums run in one order wherever its
    # tree puts it (no layout in lanes)
    attention_rows: bool = False

    def check(self, d: Dims) -> None:
        if self.precision not in PRECISIONS:
            raise UserError(f"unknown precision '{self.precision}'; choose from {', '.join(PRECISIONS)}")
        if self.flavour not in FLAVOURS:
            raise UserError(f"unknown graph flavour '{self.flavour}'; choose from {', '.join(FLAVOURS)}")
        if self.int8_rows and self.int8_rows not in INT8_ROWS:
            raise UserError(f"unknown --int8-rows kernel '{self.int8_rows}'; choose from {', '.join(INT8_ROWS)}")
        if self.int4_rows and (self.precision != "int4" or self.flavour != "ort"):
            raise UserError("--int4-rows is for --precision int4 of the ort flavour")
        if self.attention_rows and (why := self.attention_rows_unfit(d)):
            raise UserError(f"--attention-rows: {why}")
        if self.chain_only and self.flavour != "ort":
            raise UserError("chain-only step graphs are for the ort flavour (GroupQueryAttention's causal path)")
        if self.flavour == "trt" and self.precision not in TRT_PRECISIONS:
            raise UserError(f"the trt flavour takes precision fp16, bf16 or int4 (fp32 for validation), not "
                            f"{self.precision}")
        if self.flavour == "ort" and d.head_dim % 16:
            raise UserError(f"head_dim {d.head_dim}: ONNX Runtime's GroupQueryAttention (the ort flavour) takes multiples "
                            "of 16; build with --flavour onnx (standard Attention) instead")
        if self.flavour == "trt" and d.attn_softcap:
            raise UserError(f"{d.model_type}: attention logit soft-capping cannot be expressed in TensorRT's Attention "
                            "layer (no softcap); build the ort or onnx flavour")
        bad = [i for i in self.aux_layers if not 0 <= i < d.layers]
        if bad:
            raise UserError(f"aux layer indices {bad} out of range: the model has {d.layers} layers")

    def attention_rows_unfit(self, d: Dims) -> str | None:
        """Why this graph cannot take AttentionRows (runtime/kernels/attention.c), or None where it can."""
        if self.flavour != "ort" or self.compute_type != TensorProto.FLOAT:
            return "specexport's attention kernel is for the ort flavour with fp32 activations (fp32, int8, int4)"
        if d.sinks or any(d.window(i) for i in range(d.layers)):
            return (f"{d.model_type} has attention sinks or sliding-window layers, which specexport's attention kernel "
                    "does not take")
        return None

    @property
    def compute_type(self) -> int:
        """Element type of activations and KV cache."""
        if self.flavour == "trt" and self.precision == "int4":
            return TensorProto.FLOAT16  # TensorRT's int4 is weight-only: the activations are fp16
        return _FLOAT_TYPES.get(self.precision, TensorProto.FLOAT)

    @property
    def kv_dtype(self) -> str:
        """The KV cache's element type, by its precision name."""
        return {v: k for k, v in _FLOAT_TYPES.items()}[self.compute_type]


def _to_compute(array: np.ndarray, elem_type: int) -> onnx.TensorProto:
    if elem_type == TensorProto.FLOAT:
        return numpy_helper.from_array(array.astype(np.float32))
    if elem_type == TensorProto.FLOAT16:
        return numpy_helper.from_array(array.astype(np.float16))
    # bfloat16: round-to-nearest-even of the top 16 bits of fp32
    bits = array.astype(np.float32).view(np.uint32)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
    tensor = TensorProto()
    tensor.data_type = TensorProto.BFLOAT16
    tensor.dims.extend(array.shape)
    tensor.raw_data = rounded.tobytes()
    return tensor


def make_model(graph: onnx.GraphProto) -> onnx.ModelProto:
    """A model of `graph` with the opsets and IR version every specexport graph uses (com.microsoft and specexport's
    kernels only where a node uses them: a standard graph imports no other domain)."""
    opsets = [helper.make_opsetid("", OPSET)]
    for domain in sorted(domains(graph) & {"com.microsoft", kernels.DOMAIN}):
        opsets.append(helper.make_opsetid(domain, 1))
    model = helper.make_model(graph, opset_imports=opsets, producer_name="specexport")
    model.ir_version = 11
    return model


def domains(graph: onnx.GraphProto) -> set[str]:
    """The operator domains of a graph's nodes, its subgraphs' included."""
    found = set()
    for node in graph.node:
        found.add(node.domain)
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                found |= domains(sub)
    return found


class ExternalData:
    """Initializers written to the graph's external data file as the builder makes them, so that the model in memory
    holds only their names and offsets (a streaming export never holds the whole graph). Tensors under 1 KiB stay in
    the proto; those of 1 MiB and more start at a multiple of 4096 bytes (ONNX Runtime memory-maps aligned data).

    Example: `DecoderGraphBuilder(..., store=ExternalData(folder / "target.onnx.data"))`, then
    `save_graph(proto, "target", ...)` writes the small proto beside it."""

    THRESHOLD, LARGE, ALIGN = 1024, 1 << 20, 4096

    def __init__(self, path: Path):
        self.path, self.file, self.offset = Path(path), None, 0

    def put(self, tensor: onnx.TensorProto) -> onnx.TensorProto:
        data = tensor.raw_data
        if len(data) < self.THRESHOLD:
            return tensor
        if self.file is None:
            self.file = open(self.path, "wb")  # noqa: SIM115 - closed by close(), after the last initializer
        if len(data) >= self.LARGE and self.offset % self.ALIGN:
            pad = self.ALIGN - self.offset % self.ALIGN
            self.file.write(b"\0" * pad)
            self.offset += pad
        self.file.write(data)
        # a new message: clearing raw_data would leave its bytes in the tensor's protobuf arena until the graph is
        # saved, the whole model's worth by the last layer
        stub = onnx.TensorProto(name=tensor.name, dims=tensor.dims, data_type=tensor.data_type,
                                data_location=TensorProto.EXTERNAL)
        for key, value in (("location", self.path.name), ("offset", str(self.offset)), ("length", str(len(data)))):
            entry = stub.external_data.add()
            entry.key, entry.value = key, value
        self.offset += len(data)
        return stub

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class _Graph:
    """Minimal node/initializer accumulator with unique names; initializers go to `store` as they come, if given."""

    def __init__(self, elem_type: int, prefix: str = "", store: ExternalData | None = None):
        self.elem_type = elem_type
        self.prefix = prefix  # a subgraph's names start with it: names are unique across the whole model
        self.store = store
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._names: dict[str, tuple] = {}  # initializer name -> shape
        self._count = 0

    def has(self, name: str) -> bool:
        return name in self._names

    def subgraph(self, name: str) -> "_Graph":
        """An empty graph for the body of an If or Loop node (it may use this graph's names)."""
        return _Graph(self.elem_type, prefix=f"{self.prefix}{name}.", store=self.store)

    def const(self, name: str, array: np.ndarray, compute: bool = False) -> str:
        name = self.prefix + name
        if name in self._names:  # a weight used twice (the LM head by the target and Medusa heads)
            if self._names[name] != tuple(array.shape):
                raise ValueError(f"initializer {name} defined twice with different shapes")
            return name
        tensor = _to_compute(array, self.elem_type) if compute else numpy_helper.from_array(array)
        tensor.name = name
        return self.add(tensor)

    def add(self, tensor: onnx.TensorProto) -> str:
        self._names[tensor.name] = tuple(tensor.dims)
        self.initializers.append(self.store.put(tensor) if self.store is not None else tensor)
        return tensor.name

    def op(self, op_type: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", **attrs):
        self._count += 1
        name = f"{self.prefix}{op_type}_{self._count}"
        if isinstance(outputs, int):
            outputs = [f"{name}_{k}" for k in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=name, domain=domain, **attrs))
        return outputs[0] if len(outputs) == 1 else outputs

    def name(self, value: str, name: str) -> str:
        """Give the last node's output `value` (read by no node yet) the name `name`, a graph output's: an Identity
        would copy it (ONNX Runtime keeps one whose output other nodes read too: the logits' copy cost ~0.4 ms a
        call of 16 sequences on the 2-core CPU)."""
        node = self.nodes[-1]
        node.output[list(node.output).index(value)] = name
        return name


class GraphExtension(Protocol):
    """What a speculation method adds to the target graph (Medusa's heads, EAGLE's features): nodes appended after
    the final norm and, with the fused acceptance, after it; returns the graph outputs it adds."""

    def add(self, builder: "DecoderGraphBuilder", final: str, flat: str, accepted_row: str | None) -> list: ...


class DecoderGraphBuilder:
    """Builds a decoder's step graph (the target's; the same blocks make a draft's) from its weights."""

    def __init__(self, spec: Family, dims: Dims, weights: Mapping[str, np.ndarray], options: GraphOptions,
                 rope: tuple[np.ndarray, np.ndarray] | dict[str, tuple[np.ndarray, np.ndarray]],
                 store: ExternalData | None = None):
        options.check(dims)
        self.spec, self.d, self.w, self.opt = spec, dims, weights, options
        self.g = _Graph(options.compute_type, store=store)
        self.rope = rope if isinstance(rope, dict) else {"default": rope}  # table name (Dims.rope) -> (cos, sin)
        self.ort, self.trt = options.flavour == "ort", options.flavour == "trt"
        self.capacity = next(iter(self.rope.values()))[0].shape[0]  # the trt flavour's static S_max
        self.biases: dict[int, str] = {}  # window (0: full) -> the step's attention bias (step_attention)
        self.ragged = False  # build(): the step graph's real rows only (module docstring); other graphs' blocks pad
        self._int8_rows: dict[str, tuple[str, str]] = {}  # an input tensor -> its per-row int8 codes and scales
        self._row_positions = ""  # AttentionRows' position ids of the real rows [1, R], made by its first layer

    # -- building blocks -------------------------------------------------------------------
    def linear(self, x: str, name: str, w: np.ndarray, bias: np.ndarray | None = None) -> str:
        """y = x @ w.T + bias for a PyTorch-layout weight w [out, in]."""
        g, p = self.g, self.opt.precision
        out_dim, in_dim = w.shape
        b = g.const(f"{name}.bias", bias, compute=True) if bias is not None else ""
        if p == "int8":
            if self.ort and self.opt.int8_rows == "channel":  # per-channel weights, each row quantized in the graph
                q, scale = quant.int8_per_channel(w, self.opt.int8_bits)
                xq, x_top = self._rows_int8(x)  # x ~= (xq - 128) * x_top / 127: the 1/127 goes in the weight scales
                y = g.op("MatMulIntegerToFloat", [xq, g.const(f"{name}.qweight", q), x_top,
                                                  g.const(f"{name}.scale", scale / 127), "int8.zero"],
                         domain="com.microsoft")
                return g.op("Add", [y, b]) if b else y
            if self.ort and self.opt.int8_rows:  # blocks of 32; a row's activations quantized alone, in the kernel
                packed = quant.matmul_nbits(w, bits=8)
                inputs = [x] + [g.const(f"{name}.{k}", v) for k, v in packed.items()] + ["", b]
                return g.op("MatMulNBits", inputs, domain="com.microsoft", K=in_dim, N=out_dim, bits=8,
                            block_size=quant.INT4_BLOCK, accuracy_level=4)
            q, scale = quant.int8_per_channel(w, self.opt.int8_bits if self.ort else 8)
            if self.ort:
                return g.op("DynamicQuantizeMatMul", [x, g.const(f"{name}.qweight", q), g.const(f"{name}.scale", scale),
                                                      "", b], domain="com.microsoft")
            wd = g.op("DequantizeLinear", [g.const(f"{name}.qweight", q), g.const(f"{name}.scale", scale)], axis=1)
            y = g.op("MatMul", [x, wd])
        elif p == "int4":
            if self.ort and self.opt.int4_rows and not in_dim % quant.INT4_BLOCK:
                inputs = [x] + [g.const(f"{name}.{k}", v) for k, v in quant.rows4(w).items()]
                y = g.op("MatMulRows4", inputs, domain=kernels.DOMAIN, K=in_dim, N=out_dim)
                return g.op("Add", [y, b]) if b else y
            if self.ort:  # --int4-rows' projections whose inputs MatMulRows4 does not take: 8-bit blocks, whose rows
                # are alone on every CPU measured (int4's are not everywhere: exporter/row_invariance.py)
                bits = 8 if self.opt.int4_rows else 4
                packed = quant.matmul_nbits(w, bits=bits)
                inputs = [x] + [g.const(f"{name}.{k}", v) for k, v in packed.items()] + ["", b]
                return g.op("MatMulNBits", inputs, domain="com.microsoft", K=in_dim, N=out_dim, bits=bits,
                            block_size=quant.INT4_BLOCK, accuracy_level=4)
            y = g.op("MatMul", [x, self._qdq_int4_signed(name, w) if self.trt else self._qdq_int4(name, w)])
        else:
            y = g.op("MatMul", [x, g.const(f"{name}.weight", np.ascontiguousarray(w.T), compute=True)])
        return g.op("Add", [y, b]) if b else y

    def _rows_int8(self, x: str) -> tuple[str, str]:
        """x quantized for `--int8-rows channel`, each row with its own scale: (codes uint8 about 128, max |x| per
        row [.., 1]), made once per tensor (q/k/v's and gate/up's inputs are shared). The weight scales carry the
        1/127, so five ops: Abs, ReduceMax, Max (a zero row stays zero), Div, QuantizeLinear.

        Why per row: DynamicQuantizeMatMul takes one scale for the whole call, so a row's result would depend on
        the other rows of its step. Example: rows [1, -2] and [0.5, 0.25] get scales 2/127 and 0.5/127, whatever
        else is in the call; the integer products are exact, so the kernel's tiling cannot change a row's bits."""
        if x in self._int8_rows:
            return self._int8_rows[x]
        g = self.g
        if not g.has("int8.zero"):
            g.add(numpy_helper.from_array(np.array(128, np.uint8), "int8.zero"))
            g.const("int8.step", np.array(1 / 127, np.float32))
            g.const("int8.tiny", np.array(1e-30, np.float32))
            g.const("int8.last", np.array([-1], np.int64))
        top = g.op("Max", [g.op("ReduceMax", [g.op("Abs", [x]), "int8.last"], keepdims=1), "int8.tiny"])
        codes = g.op("QuantizeLinear", [g.op("Div", [x, top]), "int8.step", "int8.zero"])  # 1..255: no clipping
        self._int8_rows[x] = (codes, top)
        return self._int8_rows[x]

    def _qdq_int4(self, name: str, w: np.ndarray) -> str:
        """Blockwise int4 DequantizeLinear (opset 21+) -> float [in, out]: TensorRT's weight-only int4."""
        g = self.g
        in_dim = w.shape[1]
        if in_dim % quant.INT4_BLOCK:
            raise UserError(f"int4 needs input dims divisible by {quant.INT4_BLOCK}; {name} has {in_dim}")
        if g.has(f"{name}.qweight"):  # already built (a shared LM head)
            return g.op("DequantizeLinear", [f"{name}.qweight", f"{name}.scale", f"{name}.zero"], axis=0,
                        block_size=quant.INT4_BLOCK)
        q, scale, zero = quant.int4_blocks(w)
        # ONNX packs 4-bit data over the whole flattened tensor; per-row packing is wrong for an odd last dim
        qt = helper.make_tensor(f"{name}.qweight", TensorProto.UINT4, q.T.shape, quant.pack_nibbles(q.T.reshape(-1)).tobytes(), raw=True)
        zt = helper.make_tensor(f"{name}.zero", TensorProto.UINT4, zero.T.shape, quant.pack_nibbles(zero.T.reshape(-1)).tobytes(), raw=True)
        g.add(qt)
        g.add(zt)
        s = g.const(f"{name}.scale", np.ascontiguousarray(scale.T))
        return g.op("DequantizeLinear", [qt.name, s, zt.name], axis=0, block_size=quant.INT4_BLOCK)

    def _qdq_int4_signed(self, name: str, w: np.ndarray) -> str:
        """TensorRT's weight-only int4: signed symmetric blocks of 64 along the input dim (axis 0 of [in, out]), the
        scales in the compute type (the DequantizeLinear's output type), no zero point."""
        g, block = self.g, quant.TRT_INT4_BLOCK
        if w.shape[1] % block:
            raise UserError(f"int4 for TensorRT needs input dims divisible by {block}; {name} has {w.shape[1]}")
        if not g.has(f"{name}.qweight"):  # else already built (a shared LM head)
            q, scale = quant.int4_symmetric_blocks(w, block)
            nibbles = quant.pack_nibbles((q.T & 0x0F).astype(np.uint8).reshape(-1))
            g.add(helper.make_tensor(f"{name}.qweight", TensorProto.INT4, q.T.shape, nibbles.tobytes(), raw=True))
            g.const(f"{name}.scale", np.ascontiguousarray(scale.T), compute=True)
        return g.op("DequantizeLinear", [f"{name}.qweight", f"{name}.scale"], axis=0, block_size=block)

    def norm(self, x: str, residual: str | None, weight: np.ndarray, name: str) -> tuple[str, str]:
        """RMSNorm(x + residual) -> (normed, new residual stream); LayerNorm where the family has it (Dims.layer_norm),
        with the bias `{name}_bias` where the weights have one."""
        g, eps = self.g, self.d.rms_eps
        wname = g.const(name, weight, compute=True)
        if self.d.layer_norm:
            bias = self.w.get(f"{name}_bias")
            bname = g.const(f"{name}_bias", bias if bias is not None else np.zeros_like(weight), compute=True)
            if self.ort and residual is not None:
                out = g.op("SkipLayerNormalization", [x, residual, wname, bname], outputs=4, domain="com.microsoft",
                           epsilon=eps)
                return out[0], out[3]
            stream = x if residual is None else g.op("Add", [residual, x])
            return g.op("LayerNormalization", [stream, wname, bname], axis=-1, epsilon=eps, stash_type=1), stream
        if self.ort:
            if residual is None:
                return g.op("SimplifiedLayerNormalization", [x, wname], axis=-1, epsilon=eps), x
            out = g.op("SkipSimplifiedLayerNormalization", [x, residual, wname], outputs=4, domain="com.microsoft", epsilon=eps)
            return out[0], out[3]
        stream = x if residual is None else g.op("Add", [residual, x])
        return g.op("RMSNormalization", [stream, wname], axis=-1, epsilon=eps, stash_type=1), stream

    def mlp(self, h: str, prefix: str, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> str:
        """Gated MLP, down(act(gate(h)) * up(h)), with gate and up as one matmul (measured faster on CPU than two)."""
        g, w = self.g, self.w
        bias = np.concatenate([w[prefix + "gate_bias"], w[prefix + "up_bias"]]) if prefix + "gate_bias" in w else None
        gate_up = self.linear(h, prefix + "gate_up", np.concatenate([gate, up]), bias)
        sizes = g.const(prefix + "mlp.split", np.array([gate.shape[0]] * 2, np.int64))
        gate_x, up_x = g.op("Split", [gate_up, sizes], outputs=2, axis=-1)
        act = g.op("Mul", [self.activation(gate_x), up_x])
        return self.linear(act, prefix + "down", down, w.get(prefix + "down_bias"))

    def moe(self, h: str, prefix: str) -> str:
        """A mixture-of-experts MLP (Dims.experts) whose cost grows with the experts each token is routed to, not
        with their number. ort: ONNX Runtime's MoE op (QMoE with int4 or int8 experts); the other flavours: the same
        routing in standard ops, each expert run on the rows routed to it (NonZero, Gather, ScatterND). The router
        stays in the compute type at every precision: quantizing it would change which experts a token takes.

        Example: Mixtral's 8 experts, top 2, renormalized: softmax(router(h)), its top 2 rescaled to sum to 1, the
        two experts' SwiGLU MLPs weighted by them and summed."""
        g, w, d = self.g, self.w, self.d
        flat = g.op("Reshape", [h, g.const("moe.rows", np.array([-1, d.hidden], np.int64))])
        router = g.const(prefix + "router.weight", np.ascontiguousarray(w[prefix + "router"].T), compute=True)
        logits = g.op("MatMul", [flat, router])
        if prefix + "router_bias" in w:
            logits = g.op("Add", [logits, g.const(prefix + "router.bias", w[prefix + "router_bias"], compute=True)])
        out = self._moe_op(flat, logits, prefix) if self.ort else self._moe_standard(flat, logits, prefix)
        return g.op("Reshape", [out, g.op("Shape", [h])])

    def routing(self, logits: str) -> str:
        """Each row's weights over the experts [N, E] (fp32), k of them nonzero: the top k of the router's softmax
        (renormalized where Dims.renormalize), or Phi-MoE's sparsemixer."""
        g, d = self.g, self.d
        if self.opt.compute_type != TensorProto.FLOAT:
            logits = g.op("Cast", [logits], to=TensorProto.FLOAT)
        if d.sparsemixer:
            return self._sparsemixer(logits)
        probs = g.op("Softmax", [logits], axis=-1)
        top, index = g.op("TopK", [probs, g.const("moe.k", np.array([d.top_k], np.int64))], outputs=2, axis=-1)
        if d.renormalize:
            top = g.op("Div", [top, g.op("ReduceSum", [top, g.const("moe.last", np.array([-1], np.int64))])])
        return g.op("ScatterElements", [g.op("Sub", [probs, probs]), index, top], axis=1)

    def _sparsemixer(self, scores: str) -> str:
        """Phi-MoE's sparsemixer in eval mode: twice, the best remaining expert, weighted by the softmax over the
        remaining logits within 2 * jitter_eps (relative to max(|logit|, best)) of the best one."""
        g, d = self.g, self.d
        last = g.const("moe.last", np.array([-1], np.int64))
        far_off, minus_inf = g.const("moe.eps2", np.array(2 * d.sparsemixer, np.float32)), g.const(
            "moe.minus_inf", np.array([[-np.inf]], np.float32))
        magnitude, remaining, routing = g.op("Abs", [scores]), scores, g.op("Sub", [scores, scores])
        for _ in range(2):
            top = g.op("ReduceMax", [remaining, last], keepdims=1)
            best = g.op("ArgMax", [remaining], axis=-1, keepdims=1)
            far = g.op("Greater", [g.op("Div", [g.op("Sub", [top, scores]), g.op("Max", [magnitude, top])]), far_off])
            gates = g.op("Softmax", [g.op("Where", [far, minus_inf, remaining])], axis=-1)
            weight = g.op("GatherElements", [gates, best], axis=1)
            routing = g.op("ScatterElements", [routing, best, weight], axis=1)
            remaining = g.op("ScatterElements", [remaining, best, g.op("Expand", [minus_inf, g.op("Shape", [best])])],
                             axis=1)
        return routing

    def _moe_op(self, h: str, logits: str, prefix: str) -> str:
        """ONNX Runtime's MoE / QMoE: gate and up interleaved in one matrix per expert (swiglu_fusion 1). The op
        routes by softmax and top k itself; another router's weights r go in as log(r), whose softmax is r / sum(r),
        and the output is scaled back by sum(r)."""
        g, w, d, p = self.g, self.w, self.d, prefix + "experts."
        scale = None
        if d.sparsemixer:
            routing = self.routing(logits)
            scale = g.op("ReduceSum", [routing, g.const("moe.last", np.array([-1], np.int64))])
            logits, scale = g.op("Log", [routing]), self._to_compute(scale)
            logits = self._to_compute(logits)
        gate, up, down = w[p + "gate"], w[p + "up"], w[p + "down"]
        fc1 = [np.stack([gate[e], up[e]], axis=1).reshape(2 * d.expert_dim, d.hidden) for e in range(d.experts)]
        fc1_bias = (np.stack([w[p + "gate_bias"], w[p + "up_bias"]], axis=2).reshape(d.experts, -1)
                    if p + "gate_bias" in w else None)
        biases = [g.const(p + "fc1.bias", fc1_bias, compute=True) if fc1_bias is not None else "",
                  g.const(p + "fc2.bias", w[p + "down_bias"], compute=True) if p + "down_bias" in w else ""]
        alpha, beta, limit = d.swiglu
        attrs = {"k": d.top_k, "activation_type": "swiglu", "swiglu_fusion": 1, "activation_alpha": alpha,
                 "activation_beta": beta, "normalize_routing_weights": int(d.renormalize and not d.sparsemixer)}
        if limit:
            attrs["swiglu_limit"] = limit
        if self.opt.precision in ("int4", "int8"):
            bits = 4 if self.opt.precision == "int4" else 8
            if bits == 4:
                attrs["block_size"] = quant.qmoe_block(d.hidden, d.expert_dim)
            block = attrs.get("block_size", 0)  # quantized an expert at a time: the fp32 transients stay one expert's
            (q1, s1), (q2, s2) = quant.qmoe_experts(fc1, bits, block), quant.qmoe_experts(down, bits, block)
            inputs = [h, logits, g.const(p + "fc1.q", q1), g.const(p + "fc1.scale", s1), biases[0],
                      g.const(p + "fc2.q", q2), g.const(p + "fc2.scale", s2), biases[1]]
            out = g.op("QMoE", inputs, domain="com.microsoft", expert_weight_bits=bits, **attrs)
        else:
            inputs = [h, logits, g.const(p + "fc1", np.stack(fc1), compute=True), biases[0],
                      g.const(p + "fc2", down, compute=True), biases[1]]
            out = g.op("MoE", inputs, domain="com.microsoft", **attrs)
        return out if scale is None else g.op("Mul", [out, scale])

    def _to_compute(self, x: str) -> str:
        et = self.opt.compute_type
        return x if et == TensorProto.FLOAT else self.g.op("Cast", [x], to=et)

    def _moe_standard(self, h: str, logits: str, prefix: str) -> str:
        """The MoE in standard ops: routing weights as a dense [N, E] matrix with k nonzeros a row, then per expert
        its rows (NonZero), its MLP on them, and their weighted outputs scattered back and summed."""
        g, w, d, p = self.g, self.w, self.d, prefix + "experts."
        flat, routing = h, self._to_compute(self.routing(logits))  # [N, hidden], [N, E]
        out = g.op("Sub", [flat, flat])
        last = g.const("moe.unsqueeze", np.array([-1], np.int64))
        for e in range(d.experts):
            weight = g.op("Gather", [routing, g.const(f"moe.expert.{e}", np.array(e, np.int64))], axis=1)  # [N]
            rows = g.op("Reshape", [g.op("NonZero", [weight]), last])
            x = g.op("Gather", [flat, rows], axis=0)
            bias = (np.concatenate([w[p + "gate_bias"][e], w[p + "up_bias"][e]]) if p + "gate_bias" in w else None)
            gate_up = self.linear(x, f"{p}{e}.gate_up", np.concatenate([w[p + "gate"][e], w[p + "up"][e]]), bias)
            sizes = g.const("moe.split", np.array([d.expert_dim] * 2, np.int64))
            gate, up = g.op("Split", [gate_up, sizes], outputs=2, axis=-1)
            y = self.linear(self.gated(gate, up), f"{p}{e}.down", w[p + "down"][e],
                            w[p + "down_bias"][e] if p + "down_bias" in w else None)
            y = g.op("Mul", [y, g.op("Unsqueeze", [g.op("Gather", [weight, rows], axis=0), last])])
            out = g.op("Add", [out, g.op("ScatterND", [g.op("Sub", [flat, flat]), g.op("Unsqueeze", [rows, last]), y])])
        return out

    def gated(self, gate: str, up: str) -> str:
        """An expert's gate (Dims.swiglu): SiLU(g) * u, or clamp(g, max=l) * sigmoid(a g) * (clamp(u, -l, l) + b)."""
        g, (alpha, beta, limit) = self.g, self.d.swiglu
        if (alpha, beta, limit) == (1.0, 0.0, 0.0):
            return g.op("Mul", [self.activation(gate), up])
        c = lambda name, v: g.const(f"swiglu.{name}", np.array(v, np.float32), compute=True)  # noqa: E731
        if limit:
            gate = g.op("Clip", [gate, "", c("limit", limit)])
            up = g.op("Clip", [up, c("neg_limit", -limit), c("limit", limit)])
        glu = g.op("Mul", [gate, g.op("Sigmoid", [g.op("Mul", [gate, c("alpha", alpha)])])])
        return g.op("Mul", [g.op("Add", [up, c("beta", beta)]), glu])

    def activation(self, x: str) -> str:
        """The MLP's activation (Dims.activation): SiLU, GELU (exact or tanh, ONNX's Gelu), ReLU."""
        kind, g = self.d.activation, self.g
        if kind == "silu":
            return g.op("Mul", [x, g.op("Sigmoid", [x])])
        if kind == "relu":
            return g.op("Relu", [x])
        return g.op("Gelu", [x], approximate="tanh" if kind == "gelu_tanh" else "none")

    def head_norm(self, x: str, weight: np.ndarray, name: str, heads: int) -> str:
        """RMSNorm of q or k before RoPE: over each head_dim slice of x [B, T, heads*hd] (Qwen3, Gemma 3), or over
        the whole projection (OLMo 2: the weight spans every head)."""
        g, hd = self.g, self.d.head_dim
        if weight.shape[0] != hd:
            return self.norm(x, None, weight, name)[0]
        split = g.op("Reshape", [x, g.const(f"{name}.shape", np.array([0, 0, heads, hd], np.int64))])
        normed, _ = self.norm(split, None, weight, name)
        return g.op("Reshape", [normed, g.const(f"{name}.flat", np.array([0, 0, heads * hd], np.int64))])

    # -- the graph ---------------------------------------------------------------------------
    def build(self, extensions: tuple[GraphExtension, ...] = (), on_layer=lambda i: None) -> onnx.ModelProto:
        """final hidden (`final`) -> logits of the selected rows; with fused_accept, the accepted rows and the bonus
        token; then each extension's outputs."""
        d, g, w = self.d, self.g, self.w
        et = self.opt.compute_type
        inputs, outputs = self.step_io(d.layers)
        outputs[:0] = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["rows", d.vocab]),
                       helper.make_tensor_value_info("hidden_states", et, ["batch", "seq", d.hidden])]
        outputs[2:2] = [helper.make_tensor_value_info(f"layer_input.{i}", et, ["batch", "seq", d.hidden])
                        for i in self.opt.aux_layers]
        attn_args = self.step_attention()
        self.ragged = self.ort  # ragged rows: per-row ops on the R real rows only
        if self.ragged:
            inputs[5:5] = [helper.make_tensor_value_info("live_rows", TensorProto.INT64, ["live"]),
                           helper.make_tensor_value_info("padded_rows", TensorProto.INT64, ["batch", "seq"])]
        padded = (lambda x: g.op("Gather", [x, "padded_rows"], axis=0)) if self.ragged else (lambda x: x)  # noqa: E731

        embed = g.const("embed", w["embed"], compute=True)
        x = g.op("Gather", [embed, "input_ids"])
        if d.embed_scale != 1.0:
            x = g.op("Mul", [x, g.const("embed.scale", np.array(d.embed_scale, np.float32), compute=True)])
        if self.ragged:  # [live, hidden] from here on, but for attention
            x = self.real_rows(x, d.hidden)
        stream, branch = x, None  # the residual stream, and the last block's output still to be added to it
        for i in range(d.layers):
            p = f"layers.{i}."
            stream, h = self.block_input(stream, branch, p + "attn_norm")
            if i in self.opt.aux_layers:
                g.op("Identity", [padded(stream)], outputs=[f"layer_input.{i}"])
            attn = self.attention(i, h, attn_args)
            branch = self.block_output(self.linear(attn, p + "o", w[p + "o"], w.get(p + "o_bias")), p + "attn_post_norm")
            if not d.parallel:  # else the MLP reads the attention's input, and both outputs join the stream
                stream, h = self.block_input(stream, branch, p + "mlp_norm")
            ffn = self.moe(h, p) if d.moe(i) else self.mlp(h, p, w[p + "gate"], w[p + "up"], w[p + "down"])
            ffn = self.block_output(ffn, p + "mlp_post_norm")
            branch = g.op("Add", [branch, ffn]) if d.parallel else ffn
            on_layer(i)
        final, last = self.norm(branch, stream, w["norm"], "norm")
        self.last_stream = lambda: padded(last)  # the last layer's output before the final norm (MTP's feature)
        final = padded(final)  # a ragged graph's Gather names its output; others' norm keeps its own name
        final = g.name(final, "hidden_states") if self.ragged else g.op("Identity", [final], outputs=["hidden_states"])
        flat = g.op("Reshape", [final, g.const("flat_hidden", np.array([-1, d.hidden], np.int64))])
        logits = self.lm_head(g.op("Gather", [flat, "logits_indices"], axis=0))
        if et != TensorProto.FLOAT:
            logits = g.op("Cast", [logits], to=TensorProto.FLOAT)
        logits = self.logit_scales(logits)
        g.name(logits, "logits")
        row = None
        if self.opt.fused_accept:  # greedy only for TensorRT: the runtime accepts sampling (exporter/fused.py)
            if not self.trt:
                inputs += [helper.make_tensor_value_info(name, t, shape) for name, t, shape in ACCEPT_INPUTS]
            _, _, row, top = add_accept(g, "logits", sampling=not self.trt,
                                        vocab_size=None if self.trt else d.vocab)
            outputs += [helper.make_tensor_value_info("accept_rows", TensorProto.INT64, ["accepted"]),
                        helper.make_tensor_value_info("bonus_token", TensorProto.INT64, [1])]
            outputs += add_batch_accept(g, top)  # the batched engine's greedy acceptance, every sequence at once
        for extension in extensions:
            outputs += extension.add(self, final, flat, row)
        if g.store is not None:
            g.store.close()
        return make_model(helper.make_graph(g.nodes, "target", inputs, outputs, initializer=g.initializers))

    def step_io(self, layers: int, extra: tuple = ()) -> tuple[list, list]:
        """The inputs every step graph takes (ids, `extra`, positions, tree mask, past lengths, the rows to
        project) and the KV cache of `layers` layers, bound as past inputs and present outputs (trt: a static
        length)."""
        et, cap = self.opt.compute_type, self.capacity if self.trt else "capacity"
        inputs = [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]), *extra,
            helper.make_tensor_value_info("position_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("tree_mask", TensorProto.BOOL, ["batch", "seq", "mask_cols"]),
            helper.make_tensor_value_info("past_len", TensorProto.INT32, ["batch"]),
            helper.make_tensor_value_info("logits_indices", TensorProto.INT64, ["rows"]),
        ]
        outputs = []
        for i in range(layers):
            for kv in ("key", "value"):
                shape = ["batch", self.d.kv_heads, cap, self.d.head_dim]
                inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kv}", et, shape))
                outputs.append(helper.make_tensor_value_info(f"present.{i}.{kv}", et, shape))
        return inputs, outputs

    def step_attention(self) -> dict[str, str]:
        """What every layer's attention takes, computed once per step from `tree_mask` [B, T, K] (K >= T) and
        `past_len` [B]: the lengths (`seq`: T, an int64 scalar; ort: GQA's seqlens_k, total length and query
        lengths, int32; onnx/trt: where the step writes its K/V and, onnx, the valid cache length, int64); the
        additive attention bias [B, 1, T, W] of full-attention layers is `self.biases[0]` (a sliding window's is made
        from it by `bias`).

        The mask covers the last K columns before the step's end: start = past_len + T - K (K = T: the step's own
        tokens; K > T: tree nodes a draft wrote by earlier calls, right after the past). Column c is visible to row
        i when c < start, or when 0 <= c - start < K and tree_mask[i, c - start]. W: past + T (ort's GQA, which
        ignores a row's columns past its own end), the cache capacity otherwise (static for trt), where the
        columns past the row's end are hidden. One GatherElements over [visible | mask rows (| hidden)] at each
        column's clipped offset, standard ops only: a step pays ~20 small nodes for it, not one per layer. A
        chain-only graph (plain decoding) builds no bias: the bias is "" and GQA masks causally by itself."""
        g = self.g
        ints = TensorProto.INT32 if self.ort else TensorProto.INT64  # GQA's lengths are int32
        num = lambda name, v: g.const(f"mask.{name}", np.array(v, np.int32 if self.ort else np.int64))  # noqa: E731
        i64 = lambda name, v: g.const(f"mask.{name}.i64", np.array(v, np.int64))  # noqa: E731
        shape = g.op("Shape", ["tree_mask"])
        seq64 = g.op("Gather", [shape, i64("t", 1)], axis=0)  # scalar
        cols = g.op("Gather", [shape, i64("k", 2)], axis=0)
        if self.ort:
            seq, cols, past = g.op("Cast", [seq64], to=ints), g.op("Cast", [cols], to=ints), "past_len"
        else:
            seq, past = seq64, g.op("Cast", ["past_len"], to=ints)
        one, zero = num("one", 1), num("zero", 0)
        end = g.op("Add", [past, seq])  # [B]: past + T
        if self.ort:
            width = g.op("ReduceMax", [end], keepdims=0)
            lengths = {"seqlens_k": g.op("Sub", [end, one]), "total": width, "query_seqlens": g.op("Sub", [end, past])}
        elif self.trt:  # the mask alone says which cache rows are valid
            width, lengths = i64("capacity", self.capacity), {"write_at": past}
        else:
            width = g.op("Gather", [g.op("Shape", ["past_key_values.0.key"]), i64("two", 2)], axis=0)
            lengths = {"write_at": past, "kv_len": end}
        lengths["seq"] = seq64
        self._width, self._past = width, past
        if self.opt.chain_only:  # GQA's causal path: row i sees the past and the step's rows up to i, no bias
            self.biases = {0: ""}
            return lengths
        before = g.op("Sub", [end, g.op("Add", [cols, one])])  # [B]: start - 1
        rel = g.op("Sub", [g.op("Range", [zero, width, one]), g.op("Unsqueeze", [before, i64("axis1", [1])])])
        last = cols if self.ort else g.op("Add", [cols, one])  # the hidden column (ort: any, GQA ignores them)
        index = g.op("Min", [g.op("Max", [rel, zero]), last])  # [B, W]: 0 before the mask, 1..K in it, K+1 after
        rows = g.op("Concat", [g.op("Slice", [shape, i64("axis0", [0]), i64("two1", [2])]), i64("unit", [1])], axis=0)
        index = g.op("Expand", [g.op("Unsqueeze", [index, i64("axis1", [1])]), rows])  # [B, T, W]
        visible, hidden = self._bias_values()
        ext = g.op("Pad", [g.op("Where", ["tree_mask", visible, hidden]), i64("pad_before", [0, 0, 1, 0, 0, 0]), visible])
        if not self.ort:
            ext = g.op("Pad", [ext, i64("pad_after", [0, 0, 0, 0, 0, 1]), hidden])
        self._bias3 = g.op("GatherElements", [ext, index], axis=2)  # [B, T, W]
        self.biases = {0: g.op("Unsqueeze", [self._bias3, i64("axis1", [1])])}
        return lengths

    def _bias_values(self) -> tuple[str, str]:
        hidden = np.finfo(np.float16).min if self.g.elem_type == TensorProto.FLOAT16 else -1e9  # finite in every type
        return (self.g.const("mask.visible", np.array(0.0, np.float32), compute=True),
                self.g.const("mask.hidden", np.array(hidden, np.float32), compute=True))

    def bias(self, window: int) -> str:
        """The attention bias of a layer with a sliding `window` (0: full attention): the full bias with the columns
        at or before position - window hidden too (transformers' window: a row sees `window` positions, its own
        included). A column's position is its index in the past and its row's position_ids in the step (exact for
        every target step; a draft's earlier tree nodes, K > T, count at their column index). Made once per
        window and step."""
        if window in self.biases:
            return self.biases[window]
        g = self.g
        i64 = lambda name, v: g.const(f"mask.{name}.i64", np.array(v, np.int64))  # noqa: E731
        width = g.op("Cast", [self._width], to=TensorProto.INT64)
        columns = g.op("Range", [i64("zero", 0), width, i64("one", 1)])  # [W]
        if self.opt.chain_only:  # a chain's positions are its columns
            col_pos, base = g.op("Unsqueeze", [columns, i64("axis0", [0])]), self._bias_values()[0]
        else:
            past = g.op("Unsqueeze", [g.op("Cast", [self._past], to=TensorProto.INT64), i64("axis1", [1])])  # [B, 1]
            rel = g.op("Sub", [columns, past])  # [B, W]: the column's row in the step
            last = g.op("Sub", [g.op("Gather", [g.op("Shape", ["position_ids"]), i64("t", 1)], axis=0), i64("one", 1)])
            at = g.op("Min", [g.op("Max", [rel, i64("zero", 0)]), last])
            stepped = g.op("GatherElements", ["position_ids", at], axis=1)
            col_pos = g.op("Where", [g.op("Less", [rel, i64("zero", 0)]), columns, stepped])
            base = self._bias3
        reach = g.op("Sub", ["position_ids", i64(f"window{window}", window)])  # [B, T]
        far = g.op("LessOrEqual", [g.op("Unsqueeze", [col_pos, i64("axis1", [1])]),
                                   g.op("Unsqueeze", [reach, i64("axis2", [2])])])  # [B, T, W]
        bias = g.op("Where", [far, self._bias_values()[1], base])
        self.biases[window] = g.op("Unsqueeze", [bias, i64("axis1", [1])])
        return self.biases[window]

    def rope_tables(self, name: str) -> tuple[str, str]:
        """The cos/sin initializers of RoPE table `name` (Dims.rope)."""
        cos, sin = self.rope[name]
        prefix = "rope" if name == "default" else f"rope.{name}"
        return self.g.const(f"{prefix}.cos", cos, compute=True), self.g.const(f"{prefix}.sin", sin, compute=True)

    def real_rows(self, x: str, width: int) -> str:
        """A ragged step's real rows [R, width] of x [B, T, width] (`live_rows`)."""
        flat = self.g.op("Reshape", [x, self.g.const(f"ragged.{width}", np.array([-1, width], np.int64))])
        return self.g.op("Gather", [flat, "live_rows"], axis=0)

    def block_input(self, stream: str, branch: str | None, norm: str) -> tuple[str, str]:
        """(the residual stream with `branch` added, the block's input): the stream pre-normed where the family has
        the block's pre-norm `norm`, else the stream itself (OLMo 2's post-norm layout)."""
        if norm in self.w:
            normed, stream = self.norm(stream if branch is None else branch, None if branch is None else stream,
                                       self.w[norm], norm)
            return stream, normed
        stream = stream if branch is None else self.g.op("Add", [stream, branch])
        return stream, stream

    def block_output(self, y: str, norm: str) -> str:
        """A block's output as added to the stream: post-normed (Gemma 2/3, OLMo 2), times the residual scale
        (Granite)."""
        if norm in self.w:
            y, _ = self.norm(y, None, self.w[norm], norm)
        if self.d.residual_scale != 1.0:
            scale = self.g.const("residual.scale", np.array(self.d.residual_scale, np.float32), compute=True)
            y = self.g.op("Mul", [y, scale])
        return y

    def logit_scales(self, logits: str) -> str:
        """fp32 logits divided by the family's scaling (Granite), then soft-capped: tanh(l / c) * c (Gemma 2)."""
        g, d = self.g, self.d
        if d.logits_scaling != 1.0:
            logits = g.op("Div", [logits, g.const("logits.scaling", np.array(d.logits_scaling, np.float32))])
        if d.final_softcap:
            cap = g.const("logits.softcap", np.array(d.final_softcap, np.float32))
            logits = g.op("Mul", [g.op("Tanh", [g.op("Div", [logits, cap])]), cap])
        return logits

    def lm_head(self, rows: str) -> str:
        """Logits of hidden rows [n, hidden] (compute type); the weights are created once and shared."""
        g, d = self.g, self.d
        bias = self.w.get("lm_head_bias")
        if self.opt.precision in _FLOAT_TYPES and d.tie_embeddings:
            embed = "embed" if g.has("embed") else g.const("embed", self.w["embed"], compute=True)
            inputs = [rows, embed] + ([g.const("lm_head.bias", bias, compute=True)] if bias is not None else [])
            return g.op("Gemm", inputs, transB=1)  # share the embedding table, no transposed copy
        return self.linear(rows, "lm_head", self.w["lm_head"], bias)

    def _attention_rows(self, i: int, q: str, k: str, v: str) -> str:
        """Layer i's attention of the real rows q, k, v [1, R, ...] in AttentionRows (runtime/kernels/attention.c),
        rotated first at their positions; the output [R, q_size], the cache written in place."""
        d, g = self.d, self.g
        rope = d.rope(i)
        if rope:
            if not self._row_positions:
                flat = g.op("Reshape", ["position_ids", g.const("rows.flat", np.array([1, -1], np.int64))])
                self._row_positions = g.op("Gather", [flat, "live_rows"], axis=1)  # [1, R]: once a step
            cos, sin = self.rope_tables(rope)
            partial = {"rotary_embedding_dim": d.rotary_dim} if d.rotary_dim else {}
            partial.update({"interleaved": 1} if d.rope_interleaved else {})
            q = g.op("RotaryEmbedding", [q, cos, sin, self._row_positions], num_heads=d.heads, **partial)
            k = g.op("RotaryEmbedding", [k, cos, sin, self._row_positions], num_heads=d.kv_heads, **partial)
        y, _, _ = g.op("AttentionRows", [q, k, v, "live_rows", "tree_mask", "past_len", f"past_key_values.{i}.key",
                                         f"past_key_values.{i}.value"],
                       outputs=[f"attn_{i}", f"present.{i}.key", f"present.{i}.value"], domain=kernels.DOMAIN,
                       num_heads=d.heads, kv_num_heads=d.kv_heads, scale=float(d.attn_scale or 0.0),
                       softcap=float(d.attn_softcap or 0.0), causal=int(self.opt.chain_only))
        return g.op("Reshape", [y, g.const("rows.out", np.array([-1, d.q_size], np.int64))])

    def _sink_row(self, i: int, keys: str, values: str, bias: str, kv_len: str | None) -> tuple:
        """Attention sinks in the standard Attention op, which has no sink input: a zero key and value row ahead of
        the cache, whose bias column is the head's sink (q . 0 = 0), so exp(sink) joins each row's softmax
        denominator and adds nothing to its output. (keys, values, bias [B, heads, T, 1 + W], kv_len + 1)."""
        g, d, p = self.g, self.d, f"layers.{i}."
        two, one = g.const("sink.two", np.array([2], np.int64)), g.const("sink.one", np.array([1], np.int64))
        zero, three = g.const("sink.zero", np.array([0], np.int64)), g.const("sink.three", np.array([3], np.int64))
        row = g.op("Slice", [keys, zero, one, two])  # [B, kv_heads, 1, hd]
        row = g.op("Sub", [row, row])
        keys, values = (g.op("Concat", [row, t], axis=2) for t in (keys, values))
        sinks = g.const(p + "sinks", self.w[p + "sinks"].reshape(1, d.heads, 1, 1), compute=True)
        column = g.op("Slice", [bias, zero, one, three])  # [B, 1, T, 1]
        column = g.op("Add", [g.op("Sub", [column, column]), sinks])  # [B, heads, T, 1]
        heads = g.op("Sub", [sinks, sinks])  # [1, heads, 1, 1] zeros: the bias per head
        bias = g.op("Concat", [column, g.op("Add", [bias, heads])], axis=-1)
        return keys, values, bias, (g.op("Add", [kv_len, one]) if kv_len else None)

    def attention(self, i: int, h: str, lengths: dict[str, str], kv_source: str | None = None) -> str:
        """Layer i's attention of rows `h`; `kv_source`: the rows its keys and values are projected from, where not
        `h` (a DFlash draft's context rows)."""
        d, g, w = self.d, self.g, self.w
        p = f"layers.{i}."
        qkv_b = np.concatenate([w[p + "q_bias"], w[p + "k_bias"], w[p + "v_bias"]]) if p + "q_bias" in w else None
        if kv_source is None:
            qkv = self.linear(h, p + "qkv", np.concatenate([w[p + "q"], w[p + "k"], w[p + "v"]]), qkv_b)
        else:
            q_b, kv_b = (None, None) if qkv_b is None else (qkv_b[:d.q_size], qkv_b[d.q_size:])
            qkv = g.op("Concat", [self.linear(h, p + "q", w[p + "q"], q_b),
                                  self.linear(kv_source, p + "kv", np.concatenate([w[p + "k"], w[p + "v"]]), kv_b)],
                       axis=-1)
        rows = self.ragged and self.opt.attention_rows
        if rows:  # the real rows only, as [1, R, qkv]
            qkv = g.op("Unsqueeze", [qkv, g.const("rows.axis0", np.array([0], np.int64))])
        elif self.ragged:  # attention in the step's padded layout [B, T, qkv] (a padding row repeats a real row)
            qkv = g.op("Gather", [qkv, "padded_rows"], axis=0)
        past_k, past_v = f"past_key_values.{i}.key", f"past_key_values.{i}.value"
        present_k, present_v = f"present.{i}.key", f"present.{i}.value"
        rope, bias = d.rope(i), self.bias(d.window(i))
        partial = {"rotary_embedding_dim": d.rotary_dim} if d.rotary_dim else {}
        partial.update({"interleaved": 1} if d.rope_interleaved else {})
        scales = {k: v for k, v in (("scale", d.attn_scale), ("softcap", d.attn_softcap)) if v}
        # GQA rotates itself unless the rotary part's half is not a multiple of 8 (its kernel's rule)
        gqa_rotary = self.ort and bool(rope) and (d.rotary_dim or d.head_dim) // 2 % 8 == 0
        if self.ort and p + "q_norm" not in w and (gqa_rotary or not rope) and not rows:  # GQA: the packed projection
            q, k, v = qkv, "", ""
        else:
            sizes = g.const(p + "qkv.split", np.array([d.q_size, d.kv_size, d.kv_size], np.int64))
            q, k, v = g.op("Split", [qkv, sizes], outputs=3, axis=-1)
            if p + "q_norm" in w:
                q = self.head_norm(q, w[p + "q_norm"], p + "q_norm", d.heads)
                k = self.head_norm(k, w[p + "k_norm"], p + "k_norm", d.kv_heads)
        if rows:
            return self._attention_rows(i, q, k, v)
        if self.ort:  # GQA rotates Q and K itself at `position_ids` (past length + depth; query_seqlens makes it use them all)
            if rope and not gqa_rotary:
                cos, sin = self.rope_tables(rope)
                q = g.op("RotaryEmbedding", [q, cos, sin, "position_ids"], num_heads=d.heads, **partial)
                k = g.op("RotaryEmbedding", [k, cos, sin, "position_ids"], num_heads=d.kv_heads, **partial)
            cos, sin = self.rope_tables(rope) if gqa_rotary else ("", "")
            sinks = g.const(p + "sinks", w[p + "sinks"], compute=True) if d.sinks else ""
            inputs = [q, k, v, past_k, past_v, lengths["seqlens_k"], lengths["total"], cos, sin, "position_ids", bias,
                      sinks] + [""] * 4 + [lengths["query_seqlens"]]
            out, _, _ = g.op("GroupQueryAttention", inputs, outputs=[f"attn_{i}", present_k, present_v], domain="com.microsoft",
                             num_heads=d.heads, kv_num_heads=d.kv_heads, do_rotary=int(gqa_rotary), causal=1,
                             rotary_interleaved=int(d.rope_interleaved), **scales)
            return self.real_rows(out, d.q_size) if self.ragged else out
        heads = []
        for t, n in ((q, d.heads), (k, d.kv_heads), (v, d.kv_heads)):
            split = g.op("Reshape", [t, g.const(f"{t}.shape", np.array([0, 0, n, d.head_dim], np.int64))])
            heads.append(g.op("Transpose", [split], perm=[0, 2, 1, 3]))  # [B, n, T, hd]
        q4, k4 = heads[0], heads[1]
        if rope:
            cos, sin = self.rope_tables(rope)
            q4 = g.op("RotaryEmbedding", [q4, cos, sin, "position_ids"], **partial)
            k4 = g.op("RotaryEmbedding", [k4, cos, sin, "position_ids"], **partial)
        scatter = {"axis": -2, "mode": "linear"} if self.trt else {"axis": 2}  # TensorRT's KVCacheUpdate: -2 only
        g.op("TensorScatter", [past_k, k4, lengths["write_at"]], outputs=[present_k], **scatter)
        g.op("TensorScatter", [past_v, heads[2], lengths["write_at"]], outputs=[present_v], **scatter)
        # trt: over all S_max rows, the mask hiding those past the valid length (TensorRT takes no nonpad_kv_seqlen)
        keys, values, kv_len = present_k, present_v, lengths.get("kv_len")
        if d.sinks:
            keys, values, bias, kv_len = self._sink_row(i, present_k, present_v, bias, kv_len)
        extra = [] if self.trt else ["", "", kv_len]
        y = g.op("Attention", [q4, keys, values, bias] + extra, **scales)
        y = g.op("Transpose", [y], perm=[0, 2, 1, 3])
        return g.op("Reshape", [y, g.const(f"attn_{i}.shape", np.array([0, 0, d.q_size], np.int64))])
