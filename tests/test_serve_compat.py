"""`specexport serve` for clients written for vLLM, SGLang or llama-server: request fields it does not know accepted
and named (X-Specexport-Ignored-Fields, the log) or, with --strict, refused; fields it knows but cannot honour refused
by name; CORS for the origins given; --chat-template and chat_template_kwargs; /tokenize, /detokenize, /version;
[DONE] after an error event; prompt_tokens_details.cached_tokens; the client's own X-Request-Id. A real server in a
subprocess on loopback (tests/served.py) over the tiny n-gram bundle, the official `openai` client where it fits,
raw HTTP for the rest."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from served import SPECEXPORT, Served, wait_for

import specexport
from specexport.runtime.generate import Engine
from specexport.runtime.prefix import PrefixStore
from specexport.runtime.sampling import SamplingParams
from specexport.runtime.tokenizer import Tokenizer
from specexport.serve import fields, protocol

openai = pytest.importorskip("openai")

MODEL = "tiny-ngram"
ORIGIN = "https://app.example.com"
IGNORED = fields.IGNORED_HEADER.lower()  # as `call` and `events` give the headers
# A chat template with a variable (Qwen3's enable_thinking, as chat_template_kwargs sets it), one that fails when
# asked (`fail`), and one a wrong value breaks (`count`). Each message ends with <|im_end|>, a special token: prompts
# are cut after it (runtime/prefix.py), so a long system prompt is kept for the next request that begins with it.
TEMPLATE = ("{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}"
            "{% if fail is defined %}{{ raise_exception('the template was asked to fail') }}{% endif %}"
            "{% if count is defined %}{{ count + 1 }}{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|im_end|>{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")
# `specexport serve` whose generations fail at their second step's tokens while a fault file exists: a stream that
# fails after its first events, whatever this machine's speed.
FAULTY = """
import os, sys
from specexport.cli import main
from specexport.runtime import generate

fault, emit = os.environ["SPECEXPORT_TEST_FAULT"], generate.Output.emit


def faulty_emit(self, tokens, scores=None):
    if self.tokens and os.path.exists(fault):
        raise RuntimeError("injected fault")
    return emit(self, tokens, scores)


generate.Output.emit = faulty_emit
sys.argv[0] = "specexport"
sys.exit(main())
"""


@pytest.fixture(scope="module")
def bundle(tiny_ngram_bundle):
    return tiny_ngram_bundle


@pytest.fixture(scope="module")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("templates") / "chat.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def server(bundle, template_file):
    """Lenient (the default), with CORS for ORIGIN and the chat template above."""
    with Served(bundle, "--max-batch", "2", "--threads", "1", "--chat-template", template_file,
                "--allowed-origins", f"{ORIGIN}, http://localhost:5173") as served:
        yield served
        assert served.stop() == 0


@pytest.fixture(scope="module")
def strict(bundle):
    """--strict, no CORS, the bundle's own template."""
    with Served(bundle, "--max-batch", "1", "--threads", "1", "--strict") as served:
        yield served
        assert served.stop() == 0


def client(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0, timeout=120)


def call(served, path, body=None, headers=None, method="POST"):
    """(status, headers with lower-case names, parsed JSON or text) of one request over a fresh connection."""
    parts = urlsplit(served.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    sent = {"Content-Type": "application/json"} if data is not None else {}
    connection.request(method, path, body=data, headers={**sent, **(headers or {})})
    response = connection.getresponse()
    text = response.read().decode()
    connection.close()
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = text
    return response.status, {k.lower(): v for k, v in response.getheaders()}, parsed


def events(served, path, body, headers=None):
    """(status, headers, the data lines of a streamed response, in order)."""
    parts = urlsplit(served.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    connection.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json",
                                                                      **(headers or {})})
    response = connection.getresponse()
    lines = [line.decode().strip() for line in response]
    connection.close()
    return response.status, {k.lower(): v for k, v in response.getheaders()}, \
        [line[6:] for line in lines if line.startswith("data: ")]


def logged(served, rid: str) -> dict:
    """The access-log line of request `rid` (written when its response has ended, read by a thread: waited for)."""
    return wait_for(lambda: next((x for x in served.access_log() if x["request_id"] == rid), None),
                    f"the access-log line of {rid}")


def chat(content, **extra):
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0,
            **extra}


def is_error(answer, status_type: str, param) -> bool:
    return (set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}
            and answer["error"]["type"] == status_type and answer["error"]["param"] == param
            and bool(answer["error"]["message"]))


# ---- the fields, checked on their own ------------------------------------------------------------------------------


def test_each_field_is_supported_neutral_a_hint_or_unknown():
    base = {"messages": [{"role": "user", "content": "hi"}]}
    # hints: any value of their type; neutral values; unknown fields: accepted and named, in order
    job = protocol.chat_request({**base, "cache_prompt": False, "spaces_between_special_tokens": False, "user": "u",
                                 "metadata": {"k": "v"}, "store": True, "parallel_tool_calls": True, "priority": 3,
                                 "repetition_penalty": 1, "min_p": 0, "skip_special_tokens": True, "n_probs": 0,
                                 "mirostat": 0, "mirostat_tau": 4.0, "stream_options": {"include_obfuscation": True},
                                 "my_flag": 1, "n ": 1, "guided_json": None, "stream_options_x": {}})
    assert job.ignored == ("my_flag", "n ", "stream_options_x")
    # supported: min_p, logit_bias, ignore_eos, and min_tokens where nothing can end the generation before it
    job = protocol.chat_request({**base, "temperature": 0.7, "min_p": 0.3, "logit_bias": {"7": -100, "3": 2.5},
                                 "ignore_eos": True, "min_tokens": 8, "repetition_penalty": 1.2,
                                 "frequency_penalty": 0.5, "presence_penalty": -1})
    assert job.ignored == () and job.ignore_eos and job.sampling == SamplingParams(
        temperature=0.7, min_p=0.3, logit_bias=((3, 2.5), (7, -100.0)), repetition_penalty=1.2, frequency_penalty=0.5,
        presence_penalty=-1.0, min_tokens=8)
    refused = {"repeat_penalty": 1.1,
               "skip_special_tokens": False, "include_stop_str_in_output": True, "guided_json": 7,
               "response_format": {"type": "xml"}, "n": 20, "echo": True,
               "continue_final_message": True, "chat_template": "{{ messages }}", "grammar": ["root ::= x"],
               "typical_p": 0.9, "dry_multiplier": 0.8, "mirostat": 2, "reasoning_format": "deepseek",
               "use_beam_search": True, "prompt_logprobs": 1, "n_predict": 64}
    for name, value in refused.items():
        with pytest.raises(protocol.ApiError) as e:
            protocol.chat_request({**base, name: value})
        assert e.value.status == 400 and e.value.param == name, (name, e.value.message)
    for name, value in {"min_p": "high", "cache_prompt": "yes", "priority": 1.5, "mirostat_tau": [1]}.items():
        with pytest.raises(protocol.ApiError, match=f"{name} must be") as e:
            protocol.chat_request({**base, "temperature": 0, name: value})
        assert e.value.param == name
    with pytest.raises(protocol.ApiError) as e:  # strict: today's 400 for the first unknown field
        protocol.chat_request({**base, "cache_prompt": True, "my_flag": 1}, strict=True)
    assert e.value.param == "my_flag" and "unrecognized request argument: my_flag" in e.value.message
    with pytest.raises(protocol.ApiError) as e:
        protocol.completion_request({"prompt": "x", "stream_options": {"include_usage": True, "extra": 1}},
                                    strict=True)
    assert e.value.param == "stream_options"
    assert protocol.completion_request({"prompt": "x", "stream_options": {"extra": 1}}).ignored == \
        ("stream_options.extra",)
    assert protocol.completion_request({"prompt": "x", "add_special_tokens": True}).prompts == ["x"]


def test_new_fields_bad_values_name_the_parameter():
    base = {"messages": [{"role": "user", "content": "hi"}]}
    for extra, param in [({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
                         ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
                         ({"add_generation_prompt": "no"}, "add_generation_prompt"),
                         ({"stop_token_ids": [1, -2]}, "stop_token_ids"), ({"stop_token_ids": 5}, "stop_token_ids"),
                         ({"stop_token_ids": list(range(100))}, "stop_token_ids"),
                         ({"stream_options": {"include_obfuscation": "no"}}, "stream_options"),
                         ({"stream_options": {"continuous_usage_stats": True}}, "stream_options"),
                         ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice")]:
        with pytest.raises(protocol.ApiError) as e:
            protocol.chat_request({**base, **extra})
        assert e.value.status == 400 and e.value.param == param, (extra, e.value.message)
    for body, param in [({"prompt": "x", "messages": []}, "prompt"), ({}, "prompt"), ({"prompt": 5}, "prompt"),
                        ({"prompt": "x", "return_token_strs": 1}, "return_token_strs"),
                        ({"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": 3},
                         "chat_template_kwargs"),
                        ({"prompt": "x", "continue_final_message": True}, "continue_final_message")]:
        with pytest.raises(protocol.ApiError) as e:
            protocol.tokenize_request(body)
        assert e.value.param == param, (body, e.value.message)
    with pytest.raises(protocol.ApiError) as e:
        protocol.detokenize_request({"tokens": [1, "2"]})
    assert e.value.param == "tokens"


def test_ignored_names_make_a_safe_header():
    assert fields.named(["min_p", "a.b"]) == "min_p, a.b"
    assert fields.named(["bad\r\nSet-Cookie: x"]) == '"bad\\r\\nSet-Cookie: x"'
    assert fields.named([f"f{i}" for i in range(20)]).endswith("f15, and 4 more")


# ---- a real server: the official client, raw HTTP ------------------------------------------------------------------


def test_unknown_fields_are_named_and_strict_refuses_them(server, strict):
    extra = {"min_p": 0.1, "cache_prompt": True, "my_app_field": {"x": 1}, "spaces_between_special_tokens": True}
    raw = client(server).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=4, temperature=0,
        extra_body=extra)
    assert raw.headers[IGNORED] == "my_app_field"  # min_p at temperature 0 and the hints: no
    answer = raw.parse()
    assert answer.usage.completion_tokens >= 1 and raw.headers["x-request-id"].startswith("req-")
    line = logged(server, raw.headers["x-request-id"])  # (written after the warning: the lines come in order)
    assert line["status"] == 200 and line["ignored_fields"] == "my_app_field"
    assert sum("request fields ignored" in x and "my_app_field" in x for x in server.lines) == 1
    again = client(server).chat.completions.with_raw_response.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2, extra_body={"my_app_field": 2})
    assert logged(server, again.headers["x-request-id"])["ignored_fields"] == "my_app_field"
    assert sum("request fields ignored" in x and "my_app_field" in x for x in server.lines) == 1  # warned once
    status, headers, lines = events(server, "/v1/completions", {"prompt": "abc", "max_tokens": 3, "stream": True,
                                                                "my_app_field": 1, "n_keep": 4})
    assert status == 200 and headers[IGNORED] == "my_app_field" and lines[-1] == "[DONE]"
    status, headers, _ = call(server, "/v1/completions", {"prompt": "abc", "max_tokens": 2})
    assert status == 200 and IGNORED not in headers

    with pytest.raises(openai.BadRequestError) as e:  # --strict: today's 400, by name
        client(strict).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello there"}],
                                               max_tokens=4, temperature=0, extra_body=extra)
    assert e.value.param == "my_app_field" and "unrecognized request argument" in e.value.body["message"]
    texts = [client(strict).chat.completions.create(  # the fields it knows are taken alike: no-ops here
        model=MODEL, messages=[{"role": "user", "content": "hello there"}], max_tokens=4, temperature=0,
        extra_body=known).choices[0].message.content for known in ({"min_p": 0.1, "cache_prompt": True}, {})]
    assert texts[0] == texts[1]
    for served in (server, strict):  # a field it knows but cannot honour: refused by name, strict or not
        with pytest.raises(openai.BadRequestError) as e:
            client(served).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=4, temperature=0.7,
                                                   extra_body={"typical_p": 0.9})
        assert e.value.param == "typical_p" and "not supported" in e.value.body["message"]


BAD = [  # (what, path, body, headers, param): each a 400 in OpenAI's error shape naming the parameter
    ("chat_template_kwargs not an object", "/v1/chat/completions", chat("x", chat_template_kwargs="yes"), {},
     "chat_template_kwargs"),
    ("chat_template_kwargs setting messages", "/v1/chat/completions", chat("x", chat_template_kwargs={"messages": 1}),
     {}, "chat_template_kwargs"),
    ("a template error", "/v1/chat/completions", chat("x", chat_template_kwargs={"fail": True}), {}, "messages"),
    ("a template's TypeError", "/v1/chat/completions", chat("x", chat_template_kwargs={"count": "two"}), {},
     "messages"),
    ("chat_template in the request", "/v1/chat/completions", chat("x", chat_template="{{ messages }}"), {},
     "chat_template"),
    ("add_generation_prompt not a boolean", "/v1/chat/completions", chat("x", add_generation_prompt=1), {},
     "add_generation_prompt"),
    ("stop_token_ids past the vocabulary", "/v1/completions", {"prompt": "x", "stop_token_ids": [100000]}, {},
     "stop_token_ids"),
    ("stop_token_ids not ids", "/v1/completions", {"prompt": "x", "stop_token_ids": ["a"]}, {}, "stop_token_ids"),
    ("min_p past 1", "/v1/completions", {"prompt": "x", "min_p": 1.5}, {}, "min_p"),
    ("logit_bias not an object", "/v1/completions", {"prompt": "x", "logit_bias": [1, 2]}, {}, "logit_bias"),
    ("logit_bias: a word for a key", "/v1/completions", {"prompt": "x", "logit_bias": {"the": 5}}, {}, "logit_bias"),
    ("logit_bias: a negative id", "/v1/completions", {"prompt": "x", "logit_bias": {"-3": 5}}, {}, "logit_bias"),
    ("logit_bias past 100", "/v1/completions", {"prompt": "x", "logit_bias": {"3": 101}}, {}, "logit_bias"),
    ("logit_bias not a number", "/v1/completions", {"prompt": "x", "logit_bias": {"3": "up"}}, {}, "logit_bias"),
    ("logit_bias past the vocabulary", "/v1/chat/completions", chat("x", logit_bias={"100000": 1}), {},
     "logit_bias"),
    ("ignore_eos not a boolean", "/v1/completions", {"prompt": "x", "ignore_eos": 1}, {}, "ignore_eos"),
    ("frequency_penalty past 2", "/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, {}, "frequency_penalty"),
    ("presence_penalty not a number", "/v1/chat/completions", chat("x", presence_penalty="no"), {},
     "presence_penalty"),
    ("repetition_penalty 0", "/v1/completions", {"prompt": "x", "repetition_penalty": 0}, {}, "repetition_penalty"),
    ("min_tokens past max_tokens", "/v1/completions", {"prompt": "x", "min_tokens": 5, "max_tokens": 4}, {},
     "min_tokens"),
    ("min_tokens negative", "/v1/completions", {"prompt": "x", "min_tokens": -1, "ignore_eos": True}, {},
     "min_tokens"),
    ("min_p not a number", "/v1/completions", {"prompt": "x", "temperature": 0, "min_p": "x"}, {}, "min_p"),
    ("skip_special_tokens false", "/v1/completions", {"prompt": "x", "skip_special_tokens": False}, {},
     "skip_special_tokens"),
    ("cache_prompt not a boolean", "/v1/completions", {"prompt": "x", "cache_prompt": "yes"}, {}, "cache_prompt"),
    ("continuous usage", "/v1/completions", {"prompt": "x", "stream": True,
                                            "stream_options": {"continuous_usage_stats": True}}, {}, "stream_options"),
    ("tokenize: neither", "/tokenize", {"model": MODEL}, {}, "prompt"),
    ("tokenize: add_special_tokens", "/tokenize", {"prompt": "x", "add_special_tokens": "no"}, {},
     "add_special_tokens"),
    ("tokenize: a template error", "/tokenize", {"messages": [{"role": "user", "content": "x"}],
                                                 "chat_template_kwargs": {"fail": 1}}, {}, "messages"),
    ("detokenize: not ids", "/detokenize", {"tokens": "abc"}, {}, "tokens"),
    ("detokenize: past the vocabulary", "/detokenize", {"tokens": [1, 99999]}, {}, "tokens"),
    ("X-Request-Id with a space", "/v1/completions", {"prompt": "x", "max_tokens": 1}, {"X-Request-Id": "a b"},
     "X-Request-Id"),
    ("X-Request-Id too long", "/version", None, {"X-Request-Id": "x" * 129}, "X-Request-Id"),
]


def test_new_fields_bad_values_are_400s_by_name(server):
    for what, path, body, headers, param in BAD:
        status, _, answer = call(server, path, body, headers, method="GET" if body is None else "POST")
        assert status == 400 and is_error(answer, "invalid_request_error", param), (what, status, answer)
    for path, body in [("/tokenize", {"model": "gpt-9", "prompt": "x"}), ("/detokenize", {"model": "gpt-9",
                                                                                         "tokens": [5]})]:
        status, _, answer = call(server, path, body)
        assert status == 404 and is_error(answer, "not_found_error", "model")
    assert not any("Traceback" in line for line in server.lines)


def test_cors_preflight_and_responses(server, strict):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    status, headers, _ = call(server, "/v1/chat/completions", None, preflight, method="OPTIONS")
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= {h.strip().lower() for h in
                                                  headers["access-control-allow-headers"].split(",")}
    status, headers, _ = call(server, "/v1/chat/completions", None, {**preflight, "Origin": "http://localhost:5173"},
                              method="OPTIONS")
    assert status == 200 and headers["access-control-allow-origin"] == "http://localhost:5173"
    status, headers, _ = call(server, "/v1/chat/completions", None, {**preflight, "Origin": "https://evil.example"},
                              method="OPTIONS")
    assert status == 400 and "access-control-allow-origin" not in headers  # the browser stops there
    status, headers, answer = call(server, "/v1/chat/completions", chat("hi"), {"Origin": ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "x-request-id" in headers["access-control-expose-headers"].lower()
    # the default: no CORS at all (a preflight is a method this path does not take)
    status, headers, answer = call(strict, "/v1/chat/completions", None, preflight, method="OPTIONS")
    assert status == 405 and "access-control-allow-origin" not in headers
    status, headers, _ = call(strict, "/v1/models", None, {"Origin": ORIGIN}, method="GET")
    assert status == 200 and "access-control-allow-origin" not in headers


def test_chat_template_and_its_kwargs(server, bundle):
    api = client(server)

    def prompt_tokens(**extra):
        return api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                           temperature=0, **extra).usage.prompt_tokens

    plain, thinking = prompt_tokens(), prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    off = prompt_tokens(extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert plain == thinking and off == plain + len("/no_think ")  # byte-level tokens: one per character
    ended = prompt_tokens(extra_body={"add_generation_prompt": False})
    assert ended == plain - len("assistant:")
    status, _, answer = call(server, "/tokenize", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                                   "chat_template_kwargs": {"enable_thinking": False}})
    tokenizer = Tokenizer.from_dir(bundle)
    assert status == 200 and answer["count"] == off
    assert tokenizer.decode(answer["tokens"], skip_special_tokens=False) == \
        "/no_think user: hi<|im_end|>assistant:"


def test_bad_chat_template_files_are_one_line_before_the_load(bundle, tmp_path):
    broken, empty, failing = tmp_path / "broken.jinja", tmp_path / "empty.jinja", tmp_path / "failing.jinja"
    broken.write_text("{% for m in messages %}{{ m['content'] }", encoding="utf-8")
    empty.write_text("  \n", encoding="utf-8")
    failing.write_text("{{ messages + 1 }}", encoding="utf-8")
    for args, line in [(["--chat-template", broken], f"--chat-template {broken}: chat template does not parse"),
                       (["--chat-template", tmp_path / "missing.jinja"], "no such file"),
                       (["--chat-template", empty], "the file is empty"),
                       (["--chat-template", failing], "fails on a one-message chat: TypeError"),
                       (["--allowed-origins", "app.example.com"], "--allowed-origins: 'app.example.com' is not an "
                                                                  "origin")]:
        result = subprocess.run([SPECEXPORT, "serve", bundle, "--port", "0", *map(str, args)], capture_output=True,
                                text=True, timeout=120)
        assert result.returncode == 1 and "Traceback" not in result.stderr and "KV cache" not in result.stderr, \
            result.stderr
        last = result.stderr.strip().splitlines()
        assert len(last) == 1 and last[0].startswith("Error: ") and line in last[0], result.stderr


def test_tokenize_detokenize_and_version(server, bundle):
    tokenizer = Tokenizer.from_dir(bundle)
    status, headers, answer = call(server, "/tokenize", {"model": MODEL, "prompt": "the cat sat", "my_field": 1})
    ids = tokenizer.encode("the cat sat")
    assert status == 200 and answer == {"count": len(ids), "max_model_len": 256, "tokens": ids}
    assert headers[IGNORED] == "my_field"
    status, _, answer = call(server, "/tokenize", {"prompt": "the cat", "add_special_tokens": False,
                                                   "return_token_strs": True})
    assert answer["tokens"] == tokenizer.encode("the cat", add_special_tokens=False)
    assert answer["token_strs"] == [tokenizer.backend.id_to_token(i) for i in answer["tokens"]]
    long = "word " * 400  # past the context: counted, not refused (its count is what a client asks)
    assert call(server, "/tokenize", {"prompt": long})[2]["count"] == len(tokenizer.encode(long))
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    status, _, answer = call(server, "/tokenize", {"messages": messages})
    usage = client(server).chat.completions.create(model=MODEL, messages=messages, max_tokens=1,
                                                   temperature=0).usage
    assert status == 200 and answer["count"] == usage.prompt_tokens  # what the chat request computes
    status, _, back = call(server, "/detokenize", {"model": MODEL, "tokens": answer["tokens"]})
    assert status == 200 and back == {"prompt": "system: be brief<|im_end|>user: hello<|im_end|>assistant:"}
    assert call(server, "/detokenize", {"tokens": []})[2] == {"prompt": ""}
    status, _, answer = call(server, "/version", None, method="GET")
    assert status == 200 and answer == {"version": specexport.__version__}


def test_tokenization_needs_the_api_key(bundle):
    with Served(bundle, "--threads", "1", "--max-batch", "1", "--api-key", "k3y") as served:
        for path, body in [("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [5]})]:
            assert call(served, path, body)[0] == 401
            assert call(served, path, body, {"Authorization": "Bearer k3y"})[0] == 200
        assert call(served, "/version", None, method="GET")[0] == 200  # as /health: open
        assert served.stop() == 0


def test_stop_token_ids(server, bundle):
    engine = Engine.load(bundle, threads=1)
    prompt = "the cat sat on the mat, the cat sat on"
    tokens = engine.generate(prompt, max_new_tokens=12, chat=False).tokens
    k = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i] and tokens[i] not in
             engine.tokenizer.eos_token_ids)
    answer = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                               extra_body={"stop_token_ids": [tokens[k]]})
    assert answer.choices[0].finish_reason == "stop" and answer.usage.completion_tokens == k + 1
    assert answer.choices[0].text == engine.generate(prompt, max_new_tokens=k, chat=False).text


def test_the_sampling_knobs_are_the_runtimes(server, bundle):
    """Through the official client: a logit bias changes greedy tokens as Engine.generate's does; an end of sequence
    forced by a bias ends the answer at its first token, unless ignore_eos (then max_tokens, finish "length"), and
    min_tokens holds it off as the engine does; a seeded min-p request gives the engine's seeded tokens; the
    penalties give the engine's greedy tokens, which they change."""
    engine = Engine.load(bundle, threads=1)
    prompt, completions = "the cat sat on the mat, the cat sat on", client(server).completions
    plain = engine.generate(prompt, max_new_tokens=8, chat=False)
    banned = SamplingParams(logit_bias=((plain.tokens[0], -100.0),))
    want = engine.generate(prompt, max_new_tokens=8, chat=False, sampling=banned)
    answer = completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                logit_bias={str(plain.tokens[0]): -100})
    assert want.tokens[0] != plain.tokens[0] and answer.choices[0].text == want.text

    eos = min(engine.tokenizer.eos_token_ids)
    forced = {"logit_bias": {str(eos): 100}}
    ended = completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, extra_body=forced)
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    going = completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0,
                               extra_body={**forced, "ignore_eos": True})
    assert going.choices[0].finish_reason == "length" and going.usage.completion_tokens == 6
    held = completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                              extra_body={"logit_bias": {str(eos): 8}, "min_tokens": 5})  # eos likely, kept out
    want = engine.generate(prompt, max_new_tokens=8, chat=False,
                           sampling=SamplingParams(logit_bias=((eos, 8.0),), min_tokens=5))
    assert held.choices[0].text == want.text and held.usage.completion_tokens == len(want.tokens) >= 5

    sampled = SamplingParams(temperature=1.0, min_p=0.2, seed=11)
    want = engine.generate(prompt, max_new_tokens=8, chat=False, sampling=sampled)
    answer = completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=1.0, seed=11,
                                extra_body={"min_p": 0.2})
    assert answer.choices[0].text == want.text

    plain = engine.generate(prompt, max_new_tokens=16, chat=False)
    penalties = {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.3}
    want = engine.generate(prompt, max_new_tokens=16, chat=False, sampling=SamplingParams(**penalties))
    answer = completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0,
                                frequency_penalty=1.5, presence_penalty=0.5, extra_body={"repetition_penalty": 1.3})
    assert answer.choices[0].text == want.text and want.tokens != plain.tokens


def test_logprobs_echo_and_n_are_the_runtimes(server, bundle, template_file):
    """Through the official client: chat logprobs with top_logprobs, streamed and not, are Engine.generate's (the
    target's own, token by token, with each token's bytes); a completion with echo and logprobs gives the prompt's
    text and its tokens' logprobs (null for the first) before the answer's, as the engine scores them; n seeded
    choices are the engine's generations with seeds seed, seed + 1, ..., and the usage counts the prompt once."""
    engine = Engine.load(bundle, threads=1)
    engine.tokenizer.set_chat_template(template_file.read_text(encoding="utf-8"))  # the server's
    api, prompt = client(server), "the cat sat on the mat, the cat sat on"
    messages = [{"role": "user", "content": prompt}]
    ids = protocol.prompt_ids(engine, protocol.chat_request({"messages": messages}), messages)
    want = engine.generate(ids, max_new_tokens=10, sampling=SamplingParams(logprobs=3))
    answer = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, logprobs=True,
                                         top_logprobs=3)
    content = answer.choices[0].logprobs.content
    assert [c.bytes for c in content] == [list(engine.tokenizer.token_bytes(t)) for t in want.tokens]
    assert [c.logprob for c in content] == pytest.approx([x.logprob for x in want.logprobs], abs=1e-4)
    assert [len(c.top_logprobs) for c in content] == [3] * len(want.tokens)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[2].logprob for c in content)
    streamed = [c for event in api.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                                           logprobs=True, top_logprobs=3, stream=True)
                for choice in event.choices if choice.logprobs for c in choice.logprobs.content]
    assert [(c.token, c.bytes) for c in streamed] == [(c.token, c.bytes) for c in content]
    assert [c.logprob for c in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)

    echoed = api.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0, logprobs=2, echo=True)
    scored = engine.generate(prompt, max_new_tokens=4, chat=False,
                             sampling=SamplingParams(logprobs=2, prompt_logprobs=2))
    got = echoed.choices[0].logprobs
    assert echoed.choices[0].text == prompt + scored.text
    assert len(got.tokens) == len(scored.prompt_logprobs) + len(scored.tokens) == echoed.usage.total_tokens
    assert got.token_logprobs[0] is None and got.top_logprobs[0] is None
    assert got.token_logprobs[1:] == pytest.approx([x.logprob for x in scored.prompt_logprobs[1:] + scored.logprobs],
                                                   abs=1e-4)
    assert all(len(top) <= 2 for top in got.top_logprobs[1:]) and got.text_offset[0] == 0
    assert "".join(got.tokens) == echoed.choices[0].text  # (this tokenizer's tokens are whole characters)

    many = api.completions.create(model=MODEL, prompt=[prompt, "hello there"], max_tokens=6, temperature=1.0, seed=7,
                                  n=3)
    assert [c.index for c in many.choices] == list(range(6))
    for c in many.choices:
        text = [prompt, "hello there"][c.index // 3]
        want = engine.generate(text, max_new_tokens=6, chat=False,
                               sampling=SamplingParams(temperature=1.0, seed=7 + c.index % 3))
        assert c.text == want.text
    assert len({c.text for c in many.choices[:3]}) > 1
    one = api.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0)
    assert many.usage.prompt_tokens == one.usage.prompt_tokens + len(engine.encode("hello there", chat=False))


def test_structured_output_fields_are_the_runtimes_constraints(server, bundle):
    """Each structured-output field (OpenAI's response_format, vLLM's guided_* and structured_outputs, llama-server's
    json_schema and GBNF grammar, SGLang's regex) gives Engine.generate's tokens under the same constraint, and the
    answers that end follow it; two fields at once, and a constraint that does not compile, are 400s naming the
    field."""
    from conftest import CONSTRAINTS, constraint, follows

    engine = Engine.load(bundle, threads=1)
    prompt, completions = '{"a": "x", "b": true} and', client(server).completions
    cases = [
        ("json", {"response_format": {"type": "json_schema",
                                      "json_schema": {"name": "ab", "schema": CONSTRAINTS["json"], "strict": True}}}),
        ("json", {"guided_json": json.dumps(CONSTRAINTS["json"])}),
        ("json", {"json_schema": CONSTRAINTS["json"]}),
        ("json", {"structured_outputs": {"json": CONSTRAINTS["json"]}}),
        ("regex", {"guided_regex": CONSTRAINTS["regex"]}),
        ("regex", {"regex": CONSTRAINTS["regex"]}),
        ("choice", {"guided_choice": CONSTRAINTS["choice"]}),
        ("choice", {"structured_outputs": {"choice": CONSTRAINTS["choice"]}}),
    ]
    for kind, extra in cases:
        want = engine.generate(prompt, max_new_tokens=40, chat=False, sampling=SamplingParams(constraint=constraint(kind)))
        answer = completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0, extra_body=extra)
        assert answer.choices[0].text == want.text, extra
        if answer.choices[0].finish_reason == "stop":
            assert follows(kind, answer.choices[0].text)
    gbnf = 'root ::= "yes" | "no"'
    answer = completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, extra_body={"grammar": gbnf})
    assert answer.choices[0].text in ("yes", "no") and answer.choices[0].finish_reason == "stop"
    anything = completions.create(model=MODEL, prompt=prompt, max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_object"}})
    if anything.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(anything.choices[0].text), dict)

    for body, param in [
        ({"guided_regex": "ab", "guided_choice": ["a"]}, "guided_choice"),
        ({"guided_regex": "(ab"}, "guided_regex"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"grammar": "root ::= @@"}, "grammar"),
    ]:
        status, _, answer = call(server, "/v1/completions", {"prompt": "x", "max_tokens": 4, **body})
        assert status == 400 and answer["error"]["param"] == param, (body, answer)
        assert "\n" not in answer["error"]["message"]


HERMES = Path(__file__).parent / "templates" / "hermes_tools.jinja"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12}}, "required": ["city"],
                                                "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone.", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    """A tiny n-gram bundle of 2048 tokens of context (its byte-level tokenizer spends a token per character of the
    tools' JSON) with a Hermes-style chat template that renders tools (tests/templates)."""
    from conftest import method_export, save_folder, tiny_model

    from specexport.exporter.export import ExportOptions, export_bundle

    root = tmp_path_factory.mktemp("tools")
    folder = save_folder(tiny_model("llama", max_position_embeddings=2048), root / "tiny-long")
    export_bundle(str(folder), root / MODEL, ExportOptions(max_context=2048, validate=False,
                                                           **method_export("ngram", draft_length=4)), quiet=True)
    with Served(root / MODEL, "--max-batch", "2", "--threads", "1", "--chat-template", HERMES) as served:
        yield served
        assert served.stop() == 0


def test_an_agent_loop_of_two_forced_tool_calls(tool_server):
    """The openai client runs an agent loop: a forced call of get_weather, its result sent back as a tool message
    with the assistant's call in the history, a forced call of get_time, its result, then an answer without tools
    (tool_choice none). Each forced call is a valid call of the named function (the grammar), finish_reason
    tool_calls; streamed, a required call arrives as tool_call deltas the client assembles."""
    api = client(tool_server)
    messages = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
    for tool, result in (("get_weather", "18 C and sunny"), ("get_time", "14:05")):
        answer = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], max_tokens=200,
                                             tool_choice={"type": "function", "function": {"name": tool}},
                                             temperature=0)
        choice = answer.choices[0]
        assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
        call = choice.message.tool_calls[0]
        arguments = json.loads(call.function.arguments)
        assert call.function.name == tool and call.type == "function" and call.id.startswith("call_")
        assert set(arguments) == ({"city"} if tool == "get_weather" else {"zone"})
        messages += [choice.message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": result}]
    final = api.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER, CLOCK], tool_choice="none",
                                        max_tokens=8, temperature=0)
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in ("stop", "length")

    calls = {}
    for event in api.chat.completions.create(model=MODEL, messages=messages[:1], tools=[WEATHER, CLOCK],
                                             tool_choice="required", parallel_tool_calls=False, max_tokens=200,
                                             temperature=0, stream=True):
        for choice in event.choices:
            for delta in choice.delta.tool_calls or []:
                entry = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or None
    assert len(calls) == 1 and calls[0]["name"] in ("get_weather", "get_time") and finish == "tool_calls"
    assert isinstance(json.loads(calls[0]["arguments"]), dict)


def test_tool_requests_that_cannot_be_served_are_400s(tool_server, strict):
    """Tools with a template that does not render them, a tool message without its call's id, a named function not
    among the tools, and a forced call with a response_format too: each a 400 naming its field."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    status, _, answer = call(strict, "/v1/chat/completions", {**chat, "tools": [WEATHER]})
    assert status == 400 and answer["error"]["param"] == "tools" and "--chat-template" in answer["error"]["message"]
    for body, param in [
        ({"messages": [{"role": "tool", "content": "18 C"}]}, "messages[0].tool_call_id"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0]"),
        ({"tool_choice": "required"}, "tool_choice"),
    ]:
        status, _, answer = call(tool_server, "/v1/chat/completions", {**chat, **body})
        assert status == 400 and answer["error"]["param"] == param, (body, answer)


def test_cached_tokens_count_the_kept_system_prompt(server, bundle, template_file):
    """Two chats with one long system prompt: the first computes it (0 cached), the second copies its rows (the
    system prompt's part of the prompt, cut where its message ends: runtime/prefix.py)."""
    system = {"role": "system", "content": "You are a careful assistant who answers every question in one line."}
    api, got = client(server), []
    for question in ("what is a cat?", "what is a dog?"):
        messages = [system, {"role": "user", "content": question}]
        answer = api.chat.completions.create(model=MODEL, messages=messages, max_tokens=3, temperature=0)
        got.append(answer.usage.prompt_tokens_details.cached_tokens)
    tokenizer = Tokenizer.from_dir(bundle)
    tokenizer.set_chat_template(template_file.read_text(encoding="utf-8"))
    ids = call(server, "/tokenize", {"messages": messages})[2]["tokens"]
    cuts = PrefixStore.of(tokenizer).split(ids)
    assert len(cuts) == 1 and got == [0, cuts[0]]  # the system prompt and its end, copied
    streamed = [json.loads(e) for e in events(server, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 2, "stream": True,
        "stream_options": {"include_usage": True}})[2][:-1]]
    assert streamed[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": cuts[0]}


def test_the_clients_request_id_is_kept(server):
    status, headers, answer = call(server, "/v1/chat/completions", chat("hi"), {"X-Request-Id": "trace-42:a.b_c"})
    assert status == 200 and headers["x-request-id"] == "trace-42:a.b_c" and answer["id"] == "chatcmpl-trace-42:a.b_c"
    line = logged(server, "trace-42:a.b_c")
    assert line["path"] == "/v1/chat/completions" and line["status"] == 200
    status, headers, answer = call(server, "/v1/completions", {"prompt": "x", "max_tokens": 1})
    generated = headers["x-request-id"]
    assert generated.startswith("req-") and answer["id"] == "cmpl-" + generated[4:]
    assert call(server, "/health", None, {"X-Request-Id": "probe-1"}, method="GET")[1]["x-request-id"] == "probe-1"


def test_a_stream_that_fails_ends_with_an_error_event_then_done(bundle, tmp_path):
    fault = tmp_path / "fault"
    with Served(bundle, "--threads", "1", "--max-batch", "1", command=[sys.executable, "-c", FAULTY],
                env={"SPECEXPORT_TEST_FAULT": str(fault)}) as served:
        body = chat("the cat sat on the mat", max_tokens=12, stream=True, stream_options={"include_usage": True})
        status, _, lines = events(served, "/v1/chat/completions", body)
        assert status == 200 and lines[-1] == "[DONE]"
        assert json.loads(lines[-2])["usage"]["completion_tokens"] >= 2  # unfaulted: two emitting steps or more
        fault.touch()  # from now on a generation fails at its second step
        status, _, lines = events(served, "/v1/chat/completions", body)
        assert status == 200 and lines[-1] == "[DONE]"
        *chunks, error = [json.loads(x) for x in lines[:-1]]
        assert chunks and chunks[0]["choices"][0]["delta"]["role"] == "assistant"  # it began
        assert is_error(error, "server_error", None) and "injected fault" in error["error"]["message"]
        with pytest.raises(openai.APIError, match="injected fault"):  # the official client raises on it
            for _ in client(served).chat.completions.create(**body):
                pass
        fault.unlink()
        assert served.stop() == 0
