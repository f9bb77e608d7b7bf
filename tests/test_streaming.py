"""Exports that never hold the whole model: weights read a tensor at a time from the safetensors shards (a mixture of
experts' per-expert and MXFP4 tensors converted a layer at a time, exporter/layouts.py) or a GGUF file, and written
to the graph's external data as they are made (exporter/weights.py, graph.ExternalData), and a validation reference
that holds one layer's weights at a time (exporter/layerwise.py). What they write is what the whole-model path
writes."""


import numpy as np
import onnx
import pytest
import torch
import transformers
from conftest import save_folder, tiny_model
from onnx import numpy_helper
from test_families import FAMILIES as KINDS
from transformers import DynamicCache

from specexport.errors import UserError
from specexport.exporter import layerwise, sources
from specexport.exporter.export import ExportOptions, export_bundle
from specexport.exporter.graph import GraphOptions
from specexport.exporter.layerwise import layerwise_model
from specexport.exporter.save import Checkpoint, write_graph
from specexport.exporter.weights import GGUFSource, SafetensorsSource

GEMMA2 = dict(hidden_size=96, intermediate_size=160, num_attention_heads=3, num_key_value_heads=1, head_dim=32,
              query_pre_attn_scalar=20, sliding_window=8)
# mixtures of experts as save_pretrained writes them: the published per-expert tensors (GPT-OSS: fused)
FAMILIES = {"llama": ("llama", {}), "gemma2": ("gemma2", GEMMA2),
            "cohere2": ("cohere2", dict(pad_token_id=None, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"])),
            **{kind: KINDS[kind] for kind in ("mixtral", "qwen3_moe", "phimoe", "gpt_oss")}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def folder(request, tmp_path_factory):
    model_type, kwargs = FAMILIES[request.param]
    return save_folder(tiny_model(model_type, **kwargs), tmp_path_factory.mktemp(request.param))


def streamed(path) -> Checkpoint:
    """The checkpoint at `path` read a tensor at a time, as a build reads it (it must stream)."""
    source = sources.resolve(str(path))
    config = sources.load_config(source)
    weights = sources.stream_source(source, config)
    assert weights is not None, f"{path} does not stream"
    return Checkpoint.of_source(weights, config)


def initializers(path):
    return {t.name: numpy_helper.to_array(t, str(path.parent)) for t in onnx.load(str(path)).graph.initializer}


def same_graphs(whole, checkpoint: Checkpoint, precision: str, tmp_path) -> None:
    """The same nodes and bit-identical initializers from a streamed checkpoint as from the loaded model."""
    graph = GraphOptions(precision=precision)
    for name, target in (("whole", whole), ("streamed", checkpoint)):
        (tmp_path / name).mkdir()
        write_graph(target, "target", graph, 128, tmp_path / name, quiet=True)
    a, b = initializers(tmp_path / "whole" / "target.onnx"), initializers(tmp_path / "streamed" / "target.onnx")
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    nodes = [[(n.op_type, list(n.input)) for n in onnx.load(str(tmp_path / x / "target.onnx"), load_external_data=False)
              .graph.node] for x in ("whole", "streamed")]
    assert nodes[0] == nodes[1]


@pytest.mark.parametrize("precision", ["fp32", "int4", "int8"])
def test_a_streamed_graph_is_the_whole_models(folder, precision, tmp_path):
    whole, _ = sources.load_model(sources.resolve(str(folder)))
    same_graphs(whole, streamed(folder), precision, tmp_path)


def test_the_layerwise_reference_is_the_whole_model(folder):
    """transformers' forward with a layer's weights at a time: the same logits to the bit, a cache and a batch too;
    no weight stays behind."""
    config = transformers.AutoConfig.from_pretrained(folder)
    whole = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    lw = layerwise_model(streamed(folder).source, config)
    ids = torch.randint(3, config.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    caches = DynamicCache(), DynamicCache()
    with torch.no_grad():
        for piece in (ids, ids[:, :3]):
            want, got = (m(input_ids=piece, cache=c, use_cache=True).logits for m, c in zip((whole, lw), caches))
            assert torch.equal(want, got)
    assert all(p.is_meta for p in lw.parameters())
    assert torch.equal(layerwise.module_weight(lw, "lm_head."), layerwise.module_weight(whole, "lm_head."))


def test_a_build_validated_layerwise_reports_what_the_whole_reference_does(folder, tmp_path, monkeypatch):
    """The export's validation against the layer-wise reference (what a model too big to hold gets): the same
    numbers as against the whole model."""
    options = ExportOptions(graph=GraphOptions(precision="fp32"), max_context=128)
    whole = export_bundle(str(folder), tmp_path / "whole", options, quiet=True)["numerics"]
    monkeypatch.setattr(layerwise, "WHOLE_REFERENCE_BYTES", 0)
    streamed = export_bundle(str(folder), tmp_path / "layerwise", options, quiet=True)["numerics"]
    assert streamed == whole


def test_int4_agreement_against_the_layerwise_reference(tmp_path, monkeypatch):
    """A quantized build's agreement check, layer-wise: scored on the prompts' own tokens (no generation)."""
    folder = save_folder(tiny_model("llama"), tmp_path / "llama")
    monkeypatch.setattr(layerwise, "WHOLE_REFERENCE_BYTES", 0)
    numerics = export_bundle(str(folder), tmp_path / "b", ExportOptions(graph=GraphOptions(precision="int4"),
                                                                        max_context=128), quiet=True)["numerics"]
    assert numerics["agreement_text"].startswith("the prompts' own tokens")
    assert 0.5 < numerics["agreement"]["top1_agreement_t1"] <= 1.0


PEAK_BUILD = """
import sys
from pathlib import Path
from specexport.exporter.export import ExportOptions, export_bundle
from specexport.exporter.graph import GraphOptions
options = ExportOptions(graph=GraphOptions(precision="fp32"), max_context=128, validate=False)
export_bundle(sys.argv[1], Path(sys.argv[2]) / "warm", options, quiet=True)  # imports, caches
start = int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak from here
export_bundle(sys.argv[1], Path(sys.argv[2]) / "bundle", options, quiet=True)
print(int(open("/proc/self/status").read().split("VmHWM:")[1].split()[0]) - start)
"""


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_getaffinity"), reason="Linux's /proc peak RSS")
def test_peak_memory_does_not_grow_with_the_layers(tmp_path):
    """A build of 16 layers peaks no higher than one of 2 (the graph written, fp32, no optimization or validation:
    the steps that read the whole graph back). 14 more layers are 154 MB of fp32 weights: a build that held them
    (the model, or the graph's initializers) peaks that much higher (the exporter before streaming: 460 MB); the
    margin is a quarter of it (measured: within 3 MB). Each build runs in a process of its own, so that what the
    tests before it left in this one's heap does not count."""
    import subprocess
    import sys

    shape = dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=2)
    peaks = {}
    for layers in (2, 16):
        folder = save_folder(tiny_model("llama", num_hidden_layers=layers, **shape), tmp_path / f"m{layers}")
        assert SafetensorsSource.usable(folder)
        out = tmp_path / f"b{layers}"
        run = subprocess.run([sys.executable, "-c", PEAK_BUILD, str(folder), str(out)], capture_output=True, text=True,
                             timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        peaks[layers] = int(run.stdout.split()[-1])
    weights_kb = 14 * 4 * (4 * 512 * 512 // 4 * 2 + 2 * 512 * 128 + 3 * 512 * 1408) // 1024
    assert peaks[16] - peaks[2] < weights_kb / 4, (peaks, weights_kb)


def test_a_self_draft_of_a_streamed_target_is_streamed_too(tmp_path, monkeypatch):
    """`--draft-model self:1` of a streamed checkpoint: its graph read from the target's first layer's tensors, the
    same initializers as from the loaded model, validated against the layer-wise draft with the same numbers."""
    from conftest import method_export

    folder = save_folder(tiny_model("gemma2", **GEMMA2), tmp_path / "gemma2")
    options = ExportOptions(graph=GraphOptions(precision="int4"), max_context=128,
                            **method_export("draft", draft_model="self:1"))
    loaded = sources.load_model(sources.resolve(str(folder)))
    whole = export_bundle(str(folder), tmp_path / "whole", options, quiet=True, loaded=loaded)
    monkeypatch.setattr(layerwise, "WHOLE_REFERENCE_BYTES", 0)
    streamed = export_bundle(str(folder), tmp_path / "streamed", options, quiet=True)
    a = initializers(tmp_path / "whole" / whole["graphs"]["draft"]["file"])
    b = initializers(tmp_path / "streamed" / streamed["graphs"]["draft"]["file"])
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert streamed["numerics"]["draft"]["cases"] == whole["numerics"]["draft"]["cases"]


def test_only_the_shards_transformers_loads_are_read(tmp_path):
    """A folder beside its model.safetensors holding another *.safetensors (Mistral's consolidated.safetensors, in
    Mistral's own names) streams the model's file only; an index names the shards."""
    from safetensors.torch import save_file

    folder = save_folder(tiny_model("llama"), tmp_path / "llama")
    save_file({"layers.0.attention.wq.weight": torch.zeros(4, 4)}, folder / "consolidated.safetensors")
    source = SafetensorsSource(folder)
    assert "layers.0.attention.wq.weight" not in source.shapes()
    streamed(folder)
    (folder / "model.safetensors").rename(folder / "model-00001-of-00001.safetensors")
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {"%s": "model-00001-of-00001.safetensors"}}'
                                                         % "model.embed_tokens.weight")
    assert "model.norm.weight" in SafetensorsSource(folder).shapes()


@pytest.mark.parametrize("precision", ["fp32", "int4"])
def test_a_gguf_streams_as_transformers_converts_it(tiny_folder, tmp_path, precision):
    """A Llama GGUF (q/k rows permuted as llama.cpp's converter writes them) read a tensor at a time: the graph
    transformers' whole load gives, bit for bit."""
    from test_sources import write_gguf

    whole, _ = sources.load_model(sources.resolve(str(tiny_folder)))
    path = write_gguf(whole, tiny_folder / "tokenizer.json", tmp_path / "tiny.gguf")
    checkpoint = streamed(path)
    assert isinstance(checkpoint.source, GGUFSource)
    same_graphs(sources.load_model(sources.resolve(str(path)))[0], checkpoint, precision, tmp_path)


def test_the_real_gguf_dequantizes_to_transformers_values():
    """SmolLM2's published Q4_1 GGUF (Q8_0 embedding, Q4_1 and F32 layers): every weight as transformers' load
    holds it, to the bit."""
    source = sources.resolve("smollm2-135m")
    checkpoint = streamed(source.path)
    whole, _ = sources.load_model(source)
    state = whole.state_dict()
    theirs, ours = checkpoint.weights(), Checkpoint.of_model(whole).weights()
    assert len(ours) == len(theirs) > 100
    for name in ours:
        assert np.array_equal(theirs[name], ours[name]), name
    assert torch.equal(torch.from_numpy(checkpoint.source.get("model.layers.3.self_attn.k_proj.weight")),
                       state["model.layers.3.self_attn.k_proj.weight"])


def test_mxfp4_experts_stream_dequantized(tmp_path):
    """GPT-OSS as published (MXFP4 expert blocks and scales) read a layer at a time: the graph transformers'
    dequantizing load gives, bit for bit."""
    from test_mxfp4 import write_mxfp4_folder

    model_type, kwargs = KINDS["gpt_oss"]
    folder = write_mxfp4_folder(tiny_model(model_type, **kwargs), tmp_path / "mxfp4")
    whole, _ = sources.load_model(sources.resolve(str(folder)))
    same_graphs(whole, streamed(folder), "int4", tmp_path)


def test_a_missing_expert_is_one_line(tmp_path):
    """A per-expert checkpoint that lacks one expert's matrix is refused by that matrix's name, before any work."""
    from safetensors.torch import load_file, save_file

    model_type, kwargs = KINDS["mixtral"]
    folder = save_folder(tiny_model(model_type, **kwargs), tmp_path / "mixtral")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.5.w3.weight"]
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    source = sources.resolve(str(folder))
    with pytest.raises(UserError, match=r"missing weight 'model\.layers\.1\.block_sparse_moe\.experts\.5\.w3\.weight' "
                                        "for mixtral"):
        sources.stream_source(source, sources.load_config(source))


def test_a_draft_model_streams_beside_its_target(tmp_path, monkeypatch):
    """`--draft-model FOLDER` of a streamed target: neither model is ever loaded whole (a reference too big to hold
    is layer-wise), and the draft graph is the one the whole-model path writes."""
    from conftest import method_export

    target = save_folder(tiny_model("llama", num_hidden_layers=3), tmp_path / "target")
    draft = save_folder(tiny_model("llama", num_hidden_layers=1, intermediate_size=64), tmp_path / "d")
    options = ExportOptions(graph=GraphOptions(precision="int4"), max_context=128,
                            **method_export("draft", draft_model=str(draft)))
    whole = export_bundle(str(target), tmp_path / "whole", options, quiet=True,
                          loaded=sources.load_model(sources.resolve(str(target))))
    monkeypatch.setattr(layerwise, "WHOLE_REFERENCE_BYTES", 0)

    def no_whole_load(source):
        raise AssertionError(f"{source.name} was loaded whole")

    monkeypatch.setattr(sources, "load_model", no_whole_load)
    result = export_bundle(str(target), tmp_path / "streamed", options, quiet=True)
    a = initializers(tmp_path / "whole" / whole["graphs"]["draft"]["file"])
    b = initializers(tmp_path / "streamed" / result["graphs"]["draft"]["file"])
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    assert result["numerics"]["draft"]["cases"] == whole["numerics"]["draft"]["cases"]
