"""The engine on a tiny exported bundle: greedy decoding equals transformers, and the loop's edges."""

import numpy as np
import pytest
import torch

from specexport.errors import UserError
from specexport.exporter.export import ExportOptions, export_bundle
from specexport.runtime import generate as generate_module
from specexport.runtime.generate import Engine
from specexport.runtime.sampling import SamplingParams

MAX_CONTEXT = 64
PROMPTS = ["hello there", "the cat sat on the mat", "x", "def f(n):\n    return n * 2\n"]


@pytest.fixture(scope="module")
def bundle(tiny_folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("bundles") / "tiny-fp32"
    manifest = export_bundle(str(tiny_folder), out, ExportOptions(max_context=MAX_CONTEXT), quiet=True)
    assert manifest["numerics"]["max_abs_diff"] < 1e-4
    return out


@pytest.fixture(scope="module")
def engine(bundle):
    return Engine.load(bundle, threads=1)


@pytest.fixture(scope="module")
def hf_model(tiny_folder):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # generate exactly max_new_tokens, as stop_ids=() does here
    return model


def hf_greedy(model, ids, n):
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


def stop_from(text):
    """Two consecutive characters from the middle of `text`, neither a U+FFFD (random-model text is mostly
    stray bytes, whose replacement characters are not stable while a multi-byte sequence is incomplete)."""
    for i in range(len(text) // 3, len(text) - 1):
        pair = text[i:i + 2]
        if "\ufffd" not in pair:
            return pair
    pytest.fail(f"no usable pair in {text!r}")


# ---- greedy equals transformers -----------------------------------------------------------------


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_equals_transformers_generate(engine, hf_model, prompt):
    ids = engine.encode(prompt, chat=False)
    result = engine.generate(ids, max_new_tokens=24, stop_ids=())
    assert result.tokens == hf_greedy(hf_model, ids, 24)
    assert result.stop_reason == "length"
    assert len(set(result.tokens)) > 3  # a real continuation, not one token repeated


def test_chat_prompt_equals_transformers(engine, hf_model):
    """A text prompt goes through the chat template, as transformers' apply_chat_template does."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(engine.bundle.manifest["model"]["source"])
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi there"}], add_generation_prompt=True, tokenize=False)
    ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
    assert engine.encode("hi there") == ids
    assert engine.generate("hi there", max_new_tokens=12, stop_ids=()).tokens == hf_greedy(hf_model, ids, 12)


def test_stats(engine):
    result = engine.generate("hello", max_new_tokens=10, stop_ids=())
    s = result.stats
    assert s.prompt_tokens == len(engine.encode("hello"))
    assert (s.new_tokens, s.steps, s.accept_lengths, s.tau) == (10, 9, [1] * 9, 1.0)
    assert 0 < s.ttft_s <= s.seconds and s.tokens_per_s > 0
    assert set(s.as_dict()) == {"prompt_tokens", "new_tokens", "steps", "ttft_s", "seconds", "tokens_per_s", "tau",
                               "drafted", "accepted", "accept_histogram"}


# ---- stopping -----------------------------------------------------------------------------------


def test_eos_stops_and_is_kept(engine):
    ids = engine.encode("hello there", chat=False)
    full = engine.generate(ids, max_new_tokens=20, stop_ids=()).tokens
    eos = full[5]
    result = engine.generate(ids, max_new_tokens=20, stop_ids=(eos,))
    assert result.stop_reason == "eos"
    assert result.tokens == full[:full.index(eos) + 1]


def test_default_stop_ids_are_the_tokenizers_eos(engine):
    assert engine.tokenizer.eos_token_ids == {1}


def test_stop_string_cuts_text_and_stream_joins(engine):
    prompt = "the cat sat on the mat"
    pieces = []
    full = engine.generate(prompt, max_new_tokens=40, stop_ids=(), chat=False, on_text=pieces.append)
    assert "".join(pieces) == full.text
    assert full.text == engine.tokenizer.decode(full.tokens)

    stop = stop_from(full.text)
    pieces = []
    cut = engine.generate(prompt, max_new_tokens=40, stop_ids=(), chat=False, stop=("never-appears", stop),
                          on_text=pieces.append)
    assert cut.stop_reason == "stop_string"
    assert cut.text == full.text[:full.text.index(stop)]
    assert "".join(pieces) == cut.text
    assert stop not in "".join(pieces)
    assert cut.tokens == full.tokens[:len(cut.tokens)] and len(cut.tokens) < len(full.tokens)


def test_stop_string_that_never_appears(engine):
    result = engine.generate("x", max_new_tokens=15, stop_ids=(), stop=("\u2603\u2603\u2603",))
    assert result.stop_reason == "length" and len(result.tokens) == 15


# ---- sampling -----------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible(engine):
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=123)
    first = engine.generate("hello", max_new_tokens=20, sampling=params, stop_ids=())
    again = engine.generate("hello", max_new_tokens=20, sampling=params, stop_ids=())
    assert first.tokens == again.tokens and first.text == again.text
    other = engine.generate("hello", max_new_tokens=20, sampling=SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7),
                            stop_ids=())
    assert other.tokens != first.tokens


def test_temperature_differs_from_greedy(engine):
    greedy = engine.generate("hello", max_new_tokens=16, stop_ids=()).tokens
    sampled = [engine.generate("hello", max_new_tokens=16, stop_ids=(), sampling=SamplingParams(temperature=1.0, seed=s)).tokens
               for s in range(4)]
    assert any(tokens != greedy for tokens in sampled)


def test_tiny_temperature_is_greedy(engine):
    greedy = engine.generate("hello", max_new_tokens=12, stop_ids=()).tokens
    assert engine.generate("hello", max_new_tokens=12, stop_ids=(), sampling=SamplingParams(temperature=1e-4, seed=0)).tokens == greedy


# ---- the context limit --------------------------------------------------------------------------


def test_max_new_tokens_beyond_the_context(engine):
    ids = list(range(10, 60))  # 50 tokens; 14 left
    result = engine.generate(ids, max_new_tokens=100, stop_ids=())
    assert (result.stop_reason, len(result.tokens)) == ("context", MAX_CONTEXT - 50)
    exact = engine.generate(ids, max_new_tokens=14, stop_ids=())
    assert (exact.stop_reason, exact.tokens) == ("length", result.tokens)  # asking for exactly what fits


def test_prompt_one_short_of_the_context(engine):
    result = engine.generate(list(range(3, 3 + MAX_CONTEXT - 1)), max_new_tokens=5, stop_ids=())
    assert (result.stop_reason, len(result.tokens)) == ("context", 1)


@pytest.mark.parametrize("length", [MAX_CONTEXT, MAX_CONTEXT + 30])
def test_prompt_too_long(engine, length):
    with pytest.raises(UserError, match=f"the prompt has {length} tokens; this bundle's context limit is {MAX_CONTEXT}"):
        engine.generate([5] * length, max_new_tokens=4)


def test_long_text_prompt_too_long(engine):
    with pytest.raises(UserError, match="context limit is 64"):
        engine.generate("a b c d e f g h i j k l m n o p q r s t u v w x y z " * 3)


@pytest.mark.parametrize("n", [0, -3])
def test_max_new_tokens_must_be_positive(engine, n):
    with pytest.raises(UserError, match=f"max_new_tokens must be >= 1, got {n}"):
        engine.generate("hello", max_new_tokens=n)


def test_bad_prompts(engine):
    with pytest.raises(UserError, match="the prompt is empty"):
        engine.generate([], max_new_tokens=3)
    with pytest.raises(UserError, match="the prompt is empty"):
        engine.generate("", max_new_tokens=3, chat=False)
    with pytest.raises(UserError, match="token ids must be in 0..258"):
        engine.generate([5, 259], max_new_tokens=3)
    with pytest.raises(UserError, match="--depth applies to eagle, eagle3.* bundles; this one is 'none'"):
        engine.configure(depth=3)


# ---- prefill ------------------------------------------------------------------------------------


def calls(engine, monkeypatch):
    """Record the number of new tokens of every target call."""
    sizes, forward = [], engine.target.forward

    def spy(cache, ids, *args, **kwargs):
        sizes.append(ids.shape[1])
        return forward(cache, ids, *args, **kwargs)

    monkeypatch.setattr(engine.target, "forward", spy)
    return sizes


def test_prefill_chunking_gives_identical_tokens(engine, monkeypatch):
    ids = engine.encode(PROMPTS[1], chat=False)
    assert len(ids) == 21
    whole = engine.generate(ids, max_new_tokens=16, stop_ids=())
    sizes = calls(engine, monkeypatch)
    monkeypatch.setattr(generate_module, "PREFILL_CHUNK", 5)
    chunked = engine.generate(ids, max_new_tokens=16, stop_ids=())
    assert sizes == [5, 5, 5, 5, 1] + [1] * 15
    assert chunked.tokens == whole.tokens


def test_first_token_alone_gives_identical_tokens(engine, monkeypatch):
    ids = engine.encode(PROMPTS[3], chat=False)
    whole = engine.generate(ids, max_new_tokens=12, stop_ids=())
    sizes = calls(engine, monkeypatch)
    monkeypatch.setattr(engine, "first_token_alone", True)
    monkeypatch.setattr(generate_module, "PREFILL_CHUNK", 8)
    alone = engine.generate(ids, max_new_tokens=12, stop_ids=())
    rest = len(ids) - 1
    assert sizes[:1 + -(-rest // 8)] == [1] + [8] * (rest // 8) + ([rest % 8] if rest % 8 else [])
    assert alone.tokens == whole.tokens


def test_prefill_logits_match_transformers(engine, hf_model):
    ids = engine.encode(PROMPTS[0], chat=False)
    cache = engine.target.new_cache(len(ids))
    logits = engine.prefill(cache, ids)
    assert cache.length == len(ids)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0, -1].numpy()
    np.testing.assert_allclose(logits, ref, atol=1e-4)


def test_plain_bundles_verify_chains_only_and_accept_on_the_host(bundle, tmp_path):
    """Plain decoding's target graph (ort) is chain-only with the acceptance left to the runtime (the tests above
    show it equals transformers); a manifest that pairs such a graph with a speculative method is refused."""
    import json
    import shutil

    from specexport.bundle import load_bundle

    target = load_bundle(bundle).manifest["graphs"]["target"]
    assert target["chain_only"] and not target["fused_accept"]
    copy = tmp_path / "mislabelled"
    shutil.copytree(bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["method"] = {"name": "ngram", "draft_length": 4, "max_ngram": 3, "min_ngram": 2, "max_matches": 1}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="verifies chains only"):
        Engine.load(copy, threads=1, verify=False)
