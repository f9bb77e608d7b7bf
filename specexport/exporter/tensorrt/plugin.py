"""The tree acceptance kernel (exporter/tensorrt/accept.py) as a TensorRT plugin: sampled steps accepted inside the
engine, so a C++ service needs no Python at inference.

WRITTEN TO THE DOCUMENTED `tensorrt.plugin` API AND NEVER RUN: no GPU or TensorRT was on the machines this was
written on. What was checked there: the kernel against `runtime.verify` (Triton's interpreter), and that it
compiles to PTX for sm_90 whose entry takes exactly the arguments below (tests/test_trt_accept.py).

The plugin `specexport::tree_accept` has a shape/type descriptor (`@trtp.register`) and an ahead-of-time
implementation (`@trtp.aot_impl`): at engine build Triton compiles the kernel to PTX for the build GPU, and
TensorRT bakes the PTX and its launch (one program of 128 threads per batch row) into the plan. Kernel arguments,
in TensorRT's AOT order: the six inputs, five int32 sizes taken from the input shapes, the three outputs.
Needs TensorRT >= 10.9 (AOT Python plugins) and triton at build time, neither at run time. The PTX targets the
build GPU's architecture (sm_90a on H100/H200), so a plan built with hardware compatibility would not move to
another architecture with this plugin in it; its PTX ISA is capped at what the build machine's driver loads.

How the engine builder (exporter/tensorrt/build.py) wires it, after parsing a target graph that has `logits` (the trt
flavour's greedy graph, exported without fused sampling) and before building:

    from specexport.exporter.tensorrt import plugin as trt_plugin       # imports nothing heavy until called
    outputs = trt_plugin.add_tree_accept(network, "logits")
    # each optimization profile: the plugin's inputs, beside the graph's own
    for name, (lo, opt, hi) in trt_plugin.input_shapes(tokens=(1, opt_t, max_t), vocab=V).items():
        profile.set_shape(name, lo, opt, hi)

`add_tree_accept` adds four network inputs, which the runtime feeds on every call (`verify.fused_inputs` gives the
last three for a step; `greedy_inputs` when greedy; on prefill calls the outputs are ignored):

    accept_parents  [1, rows] int32     the step's tree over the rows `logits` holds (their parents; -1 for the root
                                         and for rows that are no nodes); rows <= 64
    sample_q        [1, q_rows, V] f32  q_rows = rows (sampled drafts) or 0 (deterministic candidates)
    sample_u        [1, rows, slots] f32
    sample_params   [1, 4] f32          temperature, top_k, top_p, without-replacement flag

and marks three outputs: `accept_rows` [1, rows] int32 (the accepted rows, root first, then -1), `accept_len` [1]
int32, `bonus_token` [1] int32. The tree's tokens are the last `rows` of `input_ids`, so `logits_indices` must
select the step's last rows in order (every row of a verify step). The runtime then copies only these three
outputs to the host and commits the accepted rows.
"""

import functools
from typing import Tuple

from specexport.errors import UserError

PLUGIN_ID = "specexport::tree_accept"
NEW_INPUTS = ("accept_parents", "sample_q", "sample_u", "sample_params")


def add_tree_accept(network, logits: str, tokens: str = "input_ids") -> list:
    """Add the plugin layer after the network output `logits` ([rows, V] of batch 1, or [1, rows, V]), with the
    tree's tokens from the network input `tokens` ([1, N] int64 or int32, N >= rows); add its inputs (NEW_INPUTS)
    and mark its outputs (trt_accept.OUTPUTS). Returns the three output tensors."""
    try:
        import triton  # noqa: F401
    except ImportError:
        raise UserError("sampling acceptance in a TensorRT engine compiles its kernel with triton at build time: "
                        "pip install 'specexport[triton]'") from None
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from specexport.exporter.tensorrt.accept import OUTPUTS

    register()
    given = {network.get_output(i).name: network.get_output(i) for i in range(network.num_outputs)}
    given |= {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
    missing = [name for name in (logits, tokens) if name not in given]
    if missing:
        raise UserError(f"the network has no tensor {missing[0]} for the tree acceptance plugin")
    scores, ids = given[logits], given[tokens]
    vocab = scores.shape[-1]
    if len(scores.shape) == 2:  # the graph's selected rows of batch 1
        shuffle = network.add_shuffle(scores)
        shuffle.reshape_dims = (1, -1, vocab)
        scores = shuffle.get_output(0)
    if ids.dtype != trt.int32:
        ids = network.add_cast(ids, trt.int32).get_output(0)
    shapes = {"accept_parents": (trt.int32, (1, -1)), "sample_q": (trt.float32, (1, -1, vocab)),
              "sample_u": (trt.float32, (1, -1, -1)), "sample_params": (trt.float32, (1, 4))}
    added = {name: network.add_input(name, dtype, shape) for name, (dtype, shape) in shapes.items()}
    layer = network.add_plugin(trtp.op.specexport.tree_accept(ids, added["accept_parents"], scores, added["sample_q"],
                                                              added["sample_u"], added["sample_params"]), aot=True)
    layer.name = PLUGIN_ID
    outputs = []
    for i, name in enumerate(OUTPUTS):
        tensor = layer.get_output(i)
        tensor.name = name
        network.mark_output(tensor)
        outputs.append(tensor)
    return outputs


def input_shapes(tokens: tuple[int, int, int], vocab: int) -> dict[str, tuple[tuple, tuple, tuple]]:
    """(min, opt, max) shapes of the plugin's inputs for an optimization profile whose steps verify
    tokens = (min, opt, max) rows: draft rows 0 (candidates) up to every row, uniform slots 1 up to rows."""
    low, opt, high = tokens
    return {"accept_parents": ((1, low), (1, opt), (1, high)),
            "sample_q": ((1, 0, vocab), (1, opt, vocab), (1, high, vocab)),
            "sample_u": ((1, low, 1), (1, opt, opt), (1, high, high)),
            "sample_params": ((1, 4), (1, 4), (1, 4))}


@functools.cache
def register() -> None:
    """Register the plugin's descriptor and AOT implementation with TensorRT (once per process)."""
    import tensorrt as trt
    import tensorrt.plugin as trtp

    from specexport.exporter.tensorrt import accept as trt_accept

    dtypes = {trt.float32: "fp32", trt.float16: "fp16", trt.bfloat16: "bf16"}

    @trtp.register(PLUGIN_ID)
    def describe(accept_tokens: trtp.TensorDesc, accept_parents: trtp.TensorDesc, logits: trtp.TensorDesc,
                 sample_q: trtp.TensorDesc, sample_u: trtp.TensorDesc, sample_params: trtp.TensorDesc
                 ) -> Tuple[trtp.TensorDesc, trtp.TensorDesc, trtp.TensorDesc]:
        batch, rows = logits.shape_expr[0], logits.shape_expr[1]
        return (trtp.from_shape_expr((batch, rows), dtype=trt.int32), trtp.from_shape_expr((batch,), dtype=trt.int32),
                trtp.from_shape_expr((batch,), dtype=trt.int32))

    @trtp.aot_impl(PLUGIN_ID)
    def compile_kernel(accept_tokens: trtp.TensorDesc, accept_parents: trtp.TensorDesc, logits: trtp.TensorDesc,
                       sample_q: trtp.TensorDesc, sample_u: trtp.TensorDesc, sample_params: trtp.TensorDesc,
                       outputs: Tuple[trtp.TensorDesc], tactic: int
                       ) -> Tuple[str, str, trtp.KernelLaunchParams, trtp.SymExprs]:
        if logits.dtype not in dtypes:
            raise UserError(f"the tree acceptance plugin takes fp32, fp16 or bf16 logits, not {logits.dtype}")
        name, ptx, shared = trt_accept.compile_ptx(dtypes[logits.dtype], ptx_version=driver_ptx_version())
        launch = trtp.KernelLaunchParams()
        launch.grid_x = logits.shape_expr[0]
        launch.block_x = trt_accept.NUM_WARPS * 32
        launch.shared_mem = shared
        sizes = (logits.shape_expr[1], logits.shape_expr[2], sample_u.shape_expr[2], sample_q.shape_expr[1],
                 accept_tokens.shape_expr[1])  # trt_accept.SIZES: T, V, S, Q_ROWS, N
        return name, ptx, launch, trtp.SymIntExprs.from_tuple([trtp.SymInt32(size) for size in sizes])


def driver_ptx_version() -> int | None:
    """The newest PTX ISA this machine's CUDA driver loads (as Triton numbers it: 87 = 8.7), or None when there is
    no driver to ask. Triton's own ptxas may be newer than the driver that TensorRT hands the PTX to."""
    import ctypes

    from triton.backends.nvidia.compiler import ptx_get_version

    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int()
    if cuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return ptx_get_version(f"{version.value // 1000}.{version.value % 1000 // 10}")
