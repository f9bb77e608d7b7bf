"""Tokenizer: tiny tokenizers built in memory, saved as an HF folder, loaded back."""

import json
import os

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from specexport.errors import UserError
from specexport.runtime.tokenizer import StreamDecoder, Tokenizer, find_stop

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = ["hello world", "the quick brown fox jumps over the lazy dog", "héllo wörld", "hello there, how are you?"]
TEXTS = [
    "hello world",
    "héllo 世界 🙂",
    "the lazy fox, 🙂🙂 über alles",
    "<|im_start|>user\nhi 世界<|im_end|>",
    "",
]

# Multi-line on purpose: only trim_blocks + lstrip_blocks give the output below.
CHATML = """{% for message in messages %}
    {% if message['role'] not in ['system', 'user', 'assistant'] %}
        {{ raise_exception('unknown role: ' + message['role']) }}
    {% endif %}
<|im_start|>{{ message['role'] }}
{{ message['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 世界"}]


def byte_level_bpe() -> Backend:
    """A GPT-2/SmolLM2-style byte-level BPE; CJK and emoji split into single-byte tokens."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 5, trainer)
    return backend


def llama_style_bpe() -> Backend:
    """A Llama-2-style SentencePiece BPE with byte fallback: '▁' marks spaces, the first is stripped."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for piece in ["▁", "h", "e", "l", "o", "w", "r", "d", "é", "▁h", "ll", "▁w", "or"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("l", "l"), ("▁", "w"), ("o", "r")]
    backend = Backend(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<s>", "</s>"])
    return backend


def save(folder, backend, config=None, generation_config=None, template=None):
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    if template is not None:
        (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return folder


@pytest.fixture
def chatml(tmp_path) -> Tokenizer:
    config = {
        "eos_token": {"content": "<|im_end|>", "special": True},
        "bos_token": None,
        "chat_template": CHATML,
    }
    return Tokenizer.from_dir(save(tmp_path / "chatml", byte_level_bpe(), config))


def stream(tokenizer, ids, skip_special_tokens=True):
    decoder = StreamDecoder(tokenizer, skip_special_tokens)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


# --- encode / decode ---------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(chatml, text):
    ids = chatml.encode(text)
    assert chatml.decode(ids, skip_special_tokens=False) == text


def test_special_tokens_are_single_ids_and_skipped(chatml):
    ids = chatml.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == chatml.token_to_id("<|im_start|>") and ids[-1] == chatml.token_to_id("<|im_end|>")
    assert chatml.decode(ids) == "user\nhi"


def test_add_bos_token_from_config(tmp_path):
    template = "{{ bos_token }}{{ messages[0]['content'] }}"
    config = {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": template}
    tok = Tokenizer.from_dir(save(tmp_path, llama_style_bpe(), config))
    assert tok.encode("hello")[0] == 1
    assert tok.encode("hello", add_special_tokens=False)[0] != 1
    # the template already starts with BOS: encoding the chat adds no second one
    ids = tok.encode_chat([{"role": "user", "content": "hello"}])
    assert ids[0] == 1 and ids.count(1) == 1
    assert tok.decode(ids) == "hello"


def test_add_bos_token_false_removes_it(tmp_path):
    backend = llama_style_bpe()
    with_bos = Tokenizer.from_dir(save(tmp_path / "a", backend, {"bos_token": "<s>", "add_bos_token": True}))
    without = Tokenizer.from_dir(save(tmp_path / "b", backend, {"bos_token": "<s>", "add_bos_token": False}))
    assert with_bos.encode("hello") == [1] + without.encode("hello")


# --- chat templates ----------------------------------------------------------------------


def test_chat_template_renders_like_transformers(chatml):
    assert chatml.has_chat_template
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nhéllo 世界<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert chatml.apply_chat_template(CHAT) == expected
    assert chatml.apply_chat_template(CHAT, add_generation_prompt=False) == expected.removesuffix(
        "<|im_start|>assistant\n"
    )
    ids = chatml.encode_chat(CHAT)
    assert chatml.decode(ids, skip_special_tokens=False) == expected
    assert ids.count(chatml.token_to_id("<|im_start|>")) == 3


def test_raise_exception_is_a_user_error(chatml):
    with pytest.raises(UserError, match="unknown role: robot"):
        chatml.apply_chat_template([{"role": "robot", "content": "beep"}])


def test_template_file_tojson_and_special_tokens(tmp_path):
    config = {"bos_token": "<s>", "eos_token": "</s>", "chat_template": "ignored: the .jinja file wins"}
    template = "{{ bos_token }}{{ messages | tojson }}{{ eos_token }}{{ pad_token }}"
    tok = Tokenizer.from_dir(save(tmp_path, llama_style_bpe(), config, template=template))
    rendered = tok.apply_chat_template([{"role": "user", "content": "a<b & 'c' 世界"}])
    # no HTML escaping, non-ASCII kept, unset special tokens render as nothing
    assert rendered == '<s>[{"role": "user", "content": "a<b & \'c\' 世界"}]</s>'


def test_template_extra_variables(tmp_path):
    config = {"chat_template": "{% if enable_thinking %}think{% else %}answer{% endif %}"}
    tok = Tokenizer.from_dir(save(tmp_path, byte_level_bpe(), config))
    assert tok.apply_chat_template([], enable_thinking=True) == "think"
    assert tok.apply_chat_template([]) == "answer"


def test_named_templates_use_default(tmp_path):
    config = {"chat_template": [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "plain"}]}
    assert Tokenizer.from_dir(save(tmp_path, byte_level_bpe(), config)).apply_chat_template([]) == "plain"


def test_no_chat_template(tmp_path):
    tok = Tokenizer.from_dir(save(tmp_path, byte_level_bpe()))
    assert not tok.has_chat_template
    with pytest.raises(UserError, match="no chat template"):
        tok.apply_chat_template(CHAT)


def test_bad_template_fails_at_load(tmp_path):
    with pytest.raises(UserError, match="does not parse"):
        Tokenizer.from_dir(save(tmp_path, byte_level_bpe(), {"chat_template": "{% for m in messages %}"}))


@pytest.mark.parametrize("template", ["{{ messages.__class__.__mro__ }}", "{{ messages.append(1) }}"])
def test_template_is_sandboxed_and_immutable(tmp_path, template):
    tok = Tokenizer.from_dir(save(tmp_path, byte_level_bpe(), {"chat_template": template}))
    with pytest.raises(UserError, match="unsafe"):
        tok.apply_chat_template(CHAT)


# --- end of sequence ---------------------------------------------------------------------


def test_eos_from_config(chatml):
    assert chatml.eos_token_ids == {chatml.token_to_id("<|im_end|>")}


@pytest.mark.parametrize("generation_eos", [[0, 2], 0])
def test_eos_from_generation_config(tmp_path, generation_eos):
    config = {"eos_token": "<|im_end|>"}
    tok = Tokenizer.from_dir(save(tmp_path, byte_level_bpe(), config, {"eos_token_id": generation_eos}))
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.token_to_id("<|im_end|>") == 2
    assert tok.eos_token_ids == {0, 2}


def test_no_eos_anywhere(tmp_path):
    assert Tokenizer.from_dir(save(tmp_path, byte_level_bpe())).eos_token_ids == set()


# --- streaming ---------------------------------------------------------------------------


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_stream_equals_full_decode_byte_level(chatml, text, skip_special_tokens):
    ids = chatml.encode(text)
    pieces = stream(chatml, ids, skip_special_tokens)
    assert "".join(pieces) == chatml.decode(ids, skip_special_tokens)
    assert not any("\ufffd" in piece for piece in pieces)
    assert pieces[-1] == ""  # nothing left over once every character is complete


def test_stream_holds_back_split_characters(chatml):
    ids = chatml.encode("🙂")
    assert len(ids) == 4  # four UTF-8 bytes, four tokens
    assert stream(chatml, ids) == ["", "", "", "🙂", ""]


@pytest.mark.parametrize("text", ["hello world", "héllo world 世界 🙂", "world hello  wé"])
def test_stream_equals_full_decode_llama_style(tmp_path, text):
    tok = Tokenizer.from_dir(save(tmp_path, llama_style_bpe(), {"bos_token": "<s>", "add_bos_token": True}))
    ids = tok.encode(text)
    pieces = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)


def test_a_long_stream_is_final_piece_by_piece(chatml):
    """Over a long output every piece is final as it comes (nothing left for flush), and the pieces are the text."""
    text = "hello world, naïve café 🙂 " * 100
    ids = chatml.encode(text)
    decoder = StreamDecoder(chatml)
    pieces = [decoder.push(i) for i in ids]
    assert "".join(pieces) == text and decoder.flush() == ""


def test_flush_returns_an_unfinished_character(chatml):
    ids = chatml.encode("hi 🙂")[:-1]  # cut inside the emoji
    pieces = stream(chatml, ids)
    assert "".join(pieces) == chatml.decode(ids) and pieces[-1].endswith("\ufffd")


# --- stop strings ------------------------------------------------------------------------


def test_find_stop():
    assert find_stop("hello<|im_end|>more", ["<|im_end|>"]) == 5
    assert find_stop("abc STOP def END", ["END", "STOP"]) == 4
    assert find_stop("aaab", ["ab", "aab"]) == 1
    assert find_stop("hello", ["bye"]) is None
    assert find_stop("hello", []) is None
    assert find_stop("hello", [""]) is None


# --- errors ------------------------------------------------------------------------------


def test_missing_tokenizer_json(tmp_path):
    with pytest.raises(UserError, match="no tokenizer.json") as err:
        Tokenizer.from_dir(tmp_path / "nowhere")
    assert "\n" not in str(err.value)


def test_unreadable_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(UserError, match="cannot read") as err:
        Tokenizer.from_dir(tmp_path)
    assert "\n" not in str(err.value)


def test_unreadable_config(tmp_path):
    save(tmp_path, byte_level_bpe())
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(UserError, match="tokenizer_config.json") as err:
        Tokenizer.from_dir(tmp_path)
    assert "\n" not in str(err.value)


# --- the real SmolLM2 tokenizer ----------------------------------------------------------


@pytest.mark.real
@pytest.mark.skipif(not os.environ.get("SPECEXPORT_REAL_TOKENIZER_DIR"), reason="set SPECEXPORT_REAL_TOKENIZER_DIR")
def test_real_tokenizer():
    tok = Tokenizer.from_dir(os.environ["SPECEXPORT_REAL_TOKENIZER_DIR"])
    assert tok.eos_token_ids
    if tok.has_chat_template:
        rendered = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
        assert "Hi" in rendered and tok.decode(tok.encode_chat([{"role": "user", "content": "Hi"}]), False) == rendered
    for text in TEXTS[:3] + ["def f(x):\n    return x ** 2  # ✓ naïve café"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert "".join(stream(tok, ids)) == text
