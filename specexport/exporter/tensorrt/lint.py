"""Will TensorRT parse this graph? A static lint of ONNX files against the rules of TensorRT's ONNX parser and its
KV-cache layer, with no TensorRT installed (`specexport check-trt`).

The rules come from onnx-tensorrt's `docs/operators.md` (TensorRT 10.15 edition), its Changelog, NVIDIA's
IKVCacheUpdateLayer and quantization pages (summarised in the project's reference/tensorrt_engines.md):

    opset        the default domain's opset is 9..24, and no node is of another domain (no com.microsoft ops; a
                 domain imported and unused is a warning)
    op           the op is in the parser's table, and came in a TensorRT version <= the target (10.15)
    attention    4-D Q/K/V and mask, no past_key/past_value/nonpad_kv_seqlen inputs, one output, no softcap or
                 qk_matmul_output_mode; a float mask has Q's type
    tensorscatter  mode linear, axis -2, 4-D cache and update
    kv-cache     a KV cache input (past_key_values.*, past_key*/past_value*) is written by a TensorScatter, has a
                 static sequence length (dim -2), and the TensorScatter writes the graph output of its alias name
                 (present.* for past_key_values.*, present* for past*) with the same shape
    precision    fp16 or bf16 compute (TensorRT 11 is strongly typed: an fp32 graph builds an fp32 engine); a
                 warning, not an error: the engine is valid, just not what the trt flavour is for
    dequantize   signed INT8/INT4/FP8/FP4 data, zero points absent or zero; INT4 in blocks of 64 or 128 along one
                 of the last two dims
    topk         a static K < 3840, sorted
    constant-axes  Reduce*, Squeeze/Unsqueeze axes and CumSum's axis are constants
    types        CumSum on float data, NonZero on FP32/FP16, EyeLike on static dims, RotaryEmbedding's INT64
                 position_ids, ScatterND without reduction
    if / loop    If branches output different names; a Loop with scan outputs has a constant trip count; the
                 bodies of If and Loop are linted too

What it cannot see: whether a fused attention kernel exists for the mask (TensorRT's IAttention is not
decomposable by default), tactic and memory limits, and every per-op type restriction beyond those above.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from specexport.errors import UserError

MIN_OPSET, MAX_OPSET = 9, 24
DEFAULT_TRT = "10.15"  # RMSNormalization, RotaryEmbedding and TensorScatter came in 10.15
TOPK_LIMIT = 3840  # TopK's K must be below this
INT4_BLOCKS = (64, 128)

# First TensorRT version whose ONNX parser takes the op ("10.0": in the 10.0 table, maybe earlier). From
# onnx-tensorrt docs/operators.md (10.15 edition: the ops marked Y) and docs/Changelog.md; Swish from 11.0's notes.
_SINCE_10_0 = """
Abs Acos Acosh Add And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool BatchNormalization Cast CastLike Ceil Celu
Clip Concat Constant ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DepthToSpace DequantizeLinear Div Dropout
Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements GatherND Gelu Gemm GlobalAveragePool
GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GridSample GroupNormalization GRU HardSigmoid HardSwish Hardmax
Identity If ImageScaler InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log
LogSoftmax Loop LRN LSTM LpNormalization LpPool MatMul Max MaxPool Mean MeanVarianceNormalization Min Mish Mod Mul
Neg NonMaxSuppression NonZero Not OneHot Or Pad ParametricSoftplus Pow PRelu QuantizeLinear RandomNormal
RandomNormalLike RandomUniform RandomUniformLike Range Reciprocal ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp
ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum ReduceSumSquare Relu Reshape Resize ReverseSequence RNN RoiAlign
Round ScaledTanh Scan Scatter ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax
Softplus Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh ThresholdedRelu Tile TopK Transpose Trilu
Unsqueeze Upsample Where Xor
"""
TRT_OPS = {**dict.fromkeys(_SINCE_10_0.split(), "10.0"), "DeformConv": "10.1", "BlackmanWindow": "10.4",
           "HammingWindow": "10.4", "HannWindow": "10.4", "STFT": "10.5", "Attention": "10.14",
           "RMSNormalization": "10.15", "RotaryEmbedding": "10.15", "TensorScatter": "10.15", "Swish": "11.0"}

_REDUCE = {"ReduceL1", "ReduceL2", "ReduceLogSum", "ReduceLogSumExp", "ReduceMax", "ReduceMean", "ReduceMin",
           "ReduceProd", "ReduceSum", "ReduceSumSquare"}
_FLOATS = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.BFLOAT16}
_DQ_TYPES = {TensorProto.INT8, TensorProto.INT4, TensorProto.FLOAT8E4M3FN, TensorProto.FLOAT4E2M1}
_CACHE_TYPES = _FLOATS | {TensorProto.INT32}
_KV_INPUT = re.compile(r"^past_key_values\.|^past_(key|value)")
_ATTENTION_EXTRA = ("past_key", "past_value", "nonpad_kv_seqlen")
_ATTENTION_OUTPUTS = ("Y", "present_key", "present_value", "qk_matmul_output")


@dataclass(frozen=True)
class Violation:
    file: str
    node: str  # the node's name ("(model)" for the model's own fields)
    op: str
    rule: str
    message: str
    warning: bool = False

    def line(self) -> str:
        level = "warning" if self.warning else "error"
        return f"{self.file}: {self.node} ({self.op}): {level} [{self.rule}] {self.message}"


@dataclass
class Report:
    files: list[str] = field(default_factory=list)
    nodes: int = 0
    violations: list[Violation] = field(default_factory=list)

    @property
    def errors(self) -> list[Violation]:
        return [v for v in self.violations if not v.warning]

    def summary(self) -> str:
        errors, warnings = len(self.errors), len(self.violations) - len(self.errors)
        verdict = "clean" if not errors else "TensorRT's ONNX parser would reject it"
        return (f"check-trt: {len(self.files)} graph(s), {self.nodes} nodes: {errors} error(s), {warnings} "
                f"warning(s): {verdict}")


def lint_path(path: Path, trt_version: str = DEFAULT_TRT) -> Report:
    """Every .onnx file of a bundle folder, or one .onnx file."""
    path = Path(path)
    files = sorted(path.glob("*.onnx")) if path.is_dir() else [path]
    report = Report()
    for file in files:
        try:
            model = onnx.load(str(file), load_external_data=False)
        except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends: not an ONNX model
            detail = str(e).splitlines()[0] if str(e) else "unreadable"
            raise UserError(f"{file.name} is not an ONNX model ({type(e).__name__}: {detail})") from None
        report.files.append(file.name)
        report.nodes += sum(1 for _ in _nodes(model.graph))
        report.violations += lint_model(model, file.name, trt_version, base_dir=str(file.parent))
    return report


def lint_model(model: onnx.ModelProto, file: str = "model.onnx", trt_version: str = DEFAULT_TRT,
               base_dir: str = "") -> list[Violation]:
    """The rules on one model (its external data is read only for the few constants a rule needs)."""
    found: list[Violation] = []
    for opset in model.opset_import:
        if opset.domain in ("", "ai.onnx") and not MIN_OPSET <= opset.version <= MAX_OPSET:
            found.append(Violation(file, "(model)", "-", "opset", f"opset {opset.version} is outside TensorRT's "
                                                                   f"{MIN_OPSET}..{MAX_OPSET}"))
    used = _domains(model.graph)
    unused = sorted(o.domain for o in model.opset_import if o.domain not in ("", "ai.onnx") and o.domain not in used)
    if unused:  # the nodes of a used one are errors, each
        found.append(Violation(file, "(model)", "-", "opset", f"imports domains no node uses ({', '.join(unused)}); "
                                                               "TensorRT ignores them", warning=True))
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # noqa: BLE001 - a graph the inference cannot follow is still linted on its declared types
        inferred = model
    linter = _Linter(file, _version(trt_version), base_dir, found)
    linter.graph(inferred.graph, Scope(), top=True)
    linter.precision()
    return found


@dataclass
class Scope:
    """What a (sub)graph sees: tensor types and shapes by name, and constant tensors by name."""

    types: dict = field(default_factory=dict)  # name -> onnx TypeProto.Tensor
    consts: dict = field(default_factory=dict)  # name -> TensorProto
    producers: dict = field(default_factory=dict)  # name -> the op type that outputs it

    def child(self) -> "Scope":
        return Scope(dict(self.types), dict(self.consts), dict(self.producers))


class _Linter:
    def __init__(self, file: str, version: tuple, base_dir: str, found: list):
        self.file, self.version, self.base_dir, self.found = file, version, base_dir, found
        self.fp32: list[onnx.NodeProto] = []  # compute nodes in fp32 (the precision rule, reported once)

    def bad(self, node, rule: str, message: str, warning: bool = False) -> None:
        self.found.append(Violation(self.file, node.name or "(unnamed)", node.op_type, rule, message, warning))

    # -- scopes ------------------------------------------------------------------------------
    def graph(self, graph: onnx.GraphProto, scope: Scope, top: bool = False) -> None:
        scope = scope.child()
        for value in list(graph.input) + list(graph.output) + list(graph.value_info):
            if value.type.HasField("tensor_type"):
                scope.types[value.name] = value.type.tensor_type
        for tensor in graph.initializer:
            scope.consts[tensor.name] = tensor
            scope.types.setdefault(tensor.name, onnx.helper.make_tensor_type_proto(tensor.data_type, tensor.dims)
                                   .tensor_type)
        for node in graph.node:
            scope.producers.update(dict.fromkeys(node.output, node.op_type))
            if node.op_type == "Constant" and node.domain in ("", "ai.onnx"):
                value = next((a.t for a in node.attribute if a.name == "value"), None)
                if value is not None:
                    scope.consts[node.output[0]] = value
        if top:
            self.cache(graph, scope)
        for node in graph.node:
            self.node(node, scope, top)
            for attr in node.attribute:
                for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                    self.graph(sub, scope)

    # -- per node ------------------------------------------------------------------------------
    def node(self, node, scope: Scope, top: bool) -> None:
        if node.domain not in ("", "ai.onnx"):
            self.bad(node, "opset", f"{node.domain} op: TensorRT parses the default domain only (an ONNX Runtime "
                                    "contrib op; build without the ORT optimizer, --flavour trt)")
            return
        since = TRT_OPS.get(node.op_type)
        if since is None:
            self.bad(node, "op", "not supported by TensorRT's ONNX parser")
            return
        if _version(since) > self.version:
            self.bad(node, "op", f"needs TensorRT >= {since} (target {'.'.join(map(str, self.version))})")
        check = getattr(self, f"op_{node.op_type}", None)
        if check is not None:
            check(node, scope, top)
        if node.op_type in _REDUCE and len(node.input) > 1 and node.input[1] and node.input[1] not in scope.consts:
            self.bad(node, "constant-axes", "axes must be an initializer")

    def op_Attention(self, node, scope, top):
        for k, name in enumerate(node.input[4:], start=4):
            if name:
                self.bad(node, "attention", f"input {_ATTENTION_EXTRA[k - 4]} ({name}) is unsupported: the mask must "
                                            "carry the cache's valid length, and the cache is written by TensorScatter")
        for k, name in enumerate(node.output[1:], start=1):
            if name:
                self.bad(node, "attention", f"output {_ATTENTION_OUTPUTS[k]} ({name}) is unsupported: one output only")
        for attr in node.attribute:
            if attr.name in ("softcap", "qk_matmul_output_mode") and (attr.f or attr.i):
                self.bad(node, "attention", f"attribute {attr.name} is unsupported")
        for k, what in enumerate(("Q", "K", "V", "mask")):
            rank = _rank(scope, node.input[k]) if len(node.input) > k and node.input[k] else None
            if rank is not None and rank != 4:
                self.bad(node, "attention", f"{what} ({node.input[k]}) is {rank}-D; TensorRT takes 4-D")
        q_type = _elem(scope, node.input[0])
        if len(node.input) > 3 and node.input[3]:
            mask_type = _elem(scope, node.input[3])
            if mask_type and q_type and mask_type not in (q_type, TensorProto.BOOL):
                self.bad(node, "attention", f"the mask is {_type_name(mask_type)} and Q {_type_name(q_type)}: an "
                                            "additive mask must have Q's type (or be bool)")
        if q_type == TensorProto.FLOAT:
            self.fp32.append(node)

    def op_TensorScatter(self, node, scope, top):
        attrs = {a.name: a for a in node.attribute}
        mode = attrs["mode"].s.decode() if "mode" in attrs else "linear"
        axis = attrs["axis"].i if "axis" in attrs else -2
        if mode != "linear":
            self.bad(node, "tensorscatter", f"mode {mode}: TensorRT's KV-cache update is linear only")
        if axis != -2:
            self.bad(node, "tensorscatter", f"axis {axis}: TensorRT requires axis -2")
        for k, what in ((0, "past_cache"), (1, "update")):
            rank = _rank(scope, node.input[k])
            if rank is not None and rank != 4:
                self.bad(node, "tensorscatter", f"{what} ({node.input[k]}) is {rank}-D; TensorRT takes 4-D")
        if not top:
            self.bad(node, "kv-cache", "a TensorScatter inside a subgraph: its cache must be a network input")

    def op_DequantizeLinear(self, node, scope, top):
        x_type = _elem(scope, node.input[0])
        if x_type is not None and x_type not in _DQ_TYPES:
            self.bad(node, "dequantize", f"{_type_name(x_type)} data: TensorRT dequantizes signed INT8, INT4, FP8 or "
                                         "FP4 (UINT4/UINT8 are not TensorRT quantized types)")
        if len(node.input) > 2 and node.input[2]:
            zp = scope.consts.get(node.input[2])
            if zp is None:
                self.bad(node, "dequantize", f"zero point {node.input[2]} is not a constant: it must be zero")
            elif np.any(self.array(zp).astype(np.int64) != 0):
                self.bad(node, "dequantize", f"zero point {node.input[2]} is not zero (TensorRT's quantization is "
                                             "symmetric)")
        if x_type in (TensorProto.INT4, TensorProto.UINT4):
            attrs = {a.name: a.i for a in node.attribute}
            block, rank = attrs.get("block_size", 0), _rank(scope, node.input[0])
            if block not in INT4_BLOCKS:
                what = "per-tensor or per-axis scales" if not block else f"block_size {block}"
                self.bad(node, "dequantize", f"int4 with {what}: TensorRT takes per-block scales, blocks of 64 or 128")
            elif rank is not None and (attrs.get("axis", 1) % rank) < rank - 2:
                self.bad(node, "dequantize", f"int4 blocks along axis {attrs.get('axis', 1)} of a {rank}-D tensor: the "
                                             "block dimension must be one of the last two")

    def op_TopK(self, node, scope, top):
        k = scope.consts.get(node.input[1]) if len(node.input) > 1 else None
        if k is None:
            self.bad(node, "topk", f"K ({node.input[1] if len(node.input) > 1 else '?'}) is computed at run time: "
                                   f"TensorRT needs K < {TOPK_LIMIT}, so it must be a constant this lint can read")
        elif int(self.array(k).reshape(-1)[0]) >= TOPK_LIMIT:
            self.bad(node, "topk", f"K = {int(self.array(k).reshape(-1)[0])}: TensorRT needs K < {TOPK_LIMIT} (cut "
                                   "to a smaller top-k first)")
        if any(a.name == "sorted" and a.i == 0 for a in node.attribute):
            self.bad(node, "topk", "sorted = 0: TensorRT needs sorted = 1")

    def op_MatMul(self, node, scope, top):
        weight = node.input[1]
        if (weight in scope.consts or scope.producers.get(weight) == "DequantizeLinear") and \
                (_elem(scope, node.input[0]) or _elem(scope, weight)) == TensorProto.FLOAT:
            self.fp32.append(node)

    op_Gemm = op_MatMul

    def op_Squeeze(self, node, scope, top):
        if len(node.input) > 1 and node.input[1] and node.input[1] not in scope.consts:
            self.bad(node, "constant-axes", "axes must be a constant")

    op_Unsqueeze = op_Squeeze

    def op_CumSum(self, node, scope, top):
        if node.input[1] not in scope.consts:
            self.bad(node, "constant-axes", "axis must be a build-time constant")
        data = _elem(scope, node.input[0])
        if data is not None and data not in _FLOATS:
            self.bad(node, "types", f"CumSum on {_type_name(data)}: TensorRT's takes FP32/FP16/BF16 only")

    def op_NonZero(self, node, scope, top):
        data = _elem(scope, node.input[0])
        if data is not None and data not in (TensorProto.FLOAT, TensorProto.FLOAT16):
            self.bad(node, "types", f"NonZero on {_type_name(data)}: TensorRT's takes FP32/FP16 only")

    def op_EyeLike(self, node, scope, top):
        shape = _shape(scope, node.input[0])
        if shape is None or any(not isinstance(d, int) for d in shape):
            self.bad(node, "types", "EyeLike needs an input of static dimensions in TensorRT")

    def op_RotaryEmbedding(self, node, scope, top):
        if len(node.input) > 3 and node.input[3]:
            positions = _elem(scope, node.input[3])
            if positions is not None and positions != TensorProto.INT64:
                self.bad(node, "types", f"position_ids are {_type_name(positions)}: TensorRT needs INT64")
        rank = _rank(scope, node.input[0])
        if rank == 3 and not any(a.name == "num_heads" and a.i for a in node.attribute):
            self.bad(node, "types", "a 3-D input needs the num_heads attribute")

    def op_ScatterND(self, node, scope, top):
        for attr in node.attribute:
            if attr.name == "reduction" and attr.s not in (b"", b"none"):
                self.bad(node, "types", f"reduction {attr.s.decode()}: TensorRT supports none only")

    def op_If(self, node, scope, top):
        branches = {a.name: a.g for a in node.attribute if a.HasField("g")}
        if {"then_branch", "else_branch"} <= set(branches):
            then = [o.name for o in branches["then_branch"].output]
            shared = set(then) & {o.name for o in branches["else_branch"].output}
            if shared:
                self.bad(node, "if", f"both branches output {sorted(shared)}: TensorRT needs different names")

    def op_Loop(self, node, scope, top):
        body = next((a.g for a in node.attribute if a.name == "body"), None)
        carried = len(node.input) - 2
        if body is not None and len(body.output) > 1 + carried and (not node.input[0] or node.input[0] not in scope.consts):
            self.bad(node, "loop", "scan outputs with a trip count computed at run time: TensorRT needs scan outputs "
                                   "of a static length")

    # -- whole graph ---------------------------------------------------------------------------
    def cache(self, graph: onnx.GraphProto, scope: Scope) -> None:
        """The KV cache rules: inputs written by TensorScatter in place, static S_max, aliased by name."""
        outputs = {o.name: o for o in graph.output}
        inputs = {i.name: i for i in graph.input}
        consumers: dict[str, list] = {}
        for node in graph.node:
            for k, name in enumerate(node.input):
                consumers.setdefault(name, []).append((node, k))
        for name in inputs:
            if not _KV_INPUT.match(name):
                continue
            users = consumers.get(name, [])
            for node, k in users:
                if not (node.op_type == "TensorScatter" and k == 0):
                    self.bad(node, "kv-cache", f"the cache input {name} feeds {node.op_type} (input {k}): TensorRT "
                                               "writes a cache in place only through TensorScatter")
        for node in graph.node:
            if node.op_type != "TensorScatter" or node.domain not in ("", "ai.onnx"):
                continue
            cache, out = node.input[0], node.output[0]
            if cache not in inputs:
                self.bad(node, "kv-cache", f"the cache {cache} is not a graph input (TensorRT's KV-cache update "
                                           "writes a network input in place)")
                continue
            dims = _shape(scope, cache)
            if dims is None or len(dims) < 2 or not isinstance(dims[-2], int):
                self.bad(node, "kv-cache", f"the cache {cache} has sequence length "
                                           f"{dims[-2] if dims and len(dims) >= 2 else '?'!r}: TensorRT needs a static S_max")
            kind = _elem(scope, cache)
            if kind is not None and kind not in _CACHE_TYPES:
                self.bad(node, "kv-cache", f"the cache is {_type_name(kind)}: TensorScatter takes FP32/FP16/BF16/INT32")
            if out not in outputs:
                self.bad(node, "kv-cache", f"{out} is not a graph output (it must alias {cache})")
            elif out not in _aliases(cache):
                self.bad(node, "kv-cache", f"{out} is not the alias name of {cache} ({' or '.join(_aliases(cache))})")
            elif _shape(scope, out) != dims:
                self.bad(node, "kv-cache", f"{out} is declared {_shape(scope, out)}, its cache {dims}: the aliased "
                                           "output must have the cache's static shape")

    def precision(self) -> None:
        if self.fp32:
            node = self.fp32[0]
            self.bad(node, "precision", f"fp32 compute ({len(self.fp32)} MatMul/Gemm/Attention nodes in fp32): "
                                        "TensorRT 11 is strongly typed, so this builds an fp32 engine; export fp16 or "
                                        "bf16 for TensorRT", warning=True)

    def array(self, tensor: TensorProto) -> np.ndarray:
        return numpy_helper.to_array(tensor, self.base_dir)


def _aliases(cache: str) -> tuple[str, ...]:
    """The output names that alias a cache input: present.* for past_key_values.*, present* for past*."""
    if cache.startswith("past_key_values."):
        return ("present." + cache[len("past_key_values."):],)
    return (cache.replace("past", "present", 1),)


def _elem(scope: Scope, name: str) -> int | None:
    t = scope.types.get(name)
    return t.elem_type if t is not None and t.elem_type else None


def _shape(scope: Scope, name: str) -> list | None:
    t = scope.types.get(name)
    if t is None or not t.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]


def _rank(scope: Scope, name: str) -> int | None:
    shape = _shape(scope, name)
    return None if shape is None else len(shape)


def _type_name(elem: int) -> str:
    return TensorProto.DataType.Name(elem)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("."))


def _nodes(graph: onnx.GraphProto):
    """Every node of a graph, its subgraphs' included."""
    for node in graph.node:
        yield node
        for attr in node.attribute:
            for sub in [attr.g] if attr.HasField("g") else list(attr.graphs):
                yield from _nodes(sub)


def _domains(graph: onnx.GraphProto) -> set[str]:
    return {node.domain for node in _nodes(graph)}
