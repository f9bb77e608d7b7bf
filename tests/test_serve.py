"""`specexport serve`: a real server (uvicorn, in a subprocess, on loopback) answering the official `openai` client,
raw HTTP for what the client never sends, a bounded load test, draining on SIGTERM; the request checks on their
own. The tiny bundles run in CI; the real SmolLM2 comparison with `specexport run --json` is marked real."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import threading
from urllib.parse import urlsplit

import onnxruntime as ort
import pytest
from served import SPECEXPORT, Gate, Served, specexport, wait_for

from specexport.runtime.generate import Engine
from specexport.runtime.sampling import SamplingParams
from specexport.serve import protocol

openai = pytest.importorskip("openai")
psutil = pytest.importorskip("psutil")

PROMPTS = ["the cat sat on the mat, the cat sat on", "hello there hello there", "abcabcabc abc",
           "a prompt about ships and the sea and the wind", "zz top", "one two three one two three"]


@pytest.fixture(scope="module")
def bundle(tiny_ngram_bundle):
    return tiny_ngram_bundle


@pytest.fixture(scope="module")
def server(bundle):
    with Served(bundle, "--max-batch", "4", "--threads", "1") as served:
        yield served
        assert served.stop() == 0


def client(served, **kw):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                         timeout=kw.pop("timeout", 120), **kw)


def post(served, path, body, headers=None, method="POST", raw=False):
    """(status, headers, parsed JSON or text) of one request over a fresh connection."""
    parts = urlsplit(served.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    connection.request(method, path, body=data, headers={"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    text = response.read().decode()
    connection.close()
    try:
        parsed = text if raw else json.loads(text)
    except json.JSONDecodeError:
        parsed = text
    return response.status, dict(response.getheaders()), parsed


def metrics(served) -> dict:
    """The /metrics samples: {name{labels}: value}."""
    _, _, text = post(served, "/metrics", None, method="GET", raw=True)
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def metric(samples: dict, name: str, **labels) -> float:
    """The sum of a metric's samples whose labels include `labels`."""
    return sum(v for k, v in samples.items() if k.split("{")[0] == name and
               all(f'{key}="{value}"' in k for key, value in labels.items()))


def active(served) -> float:
    """Requests the server holds: running (or prefilling) and queued."""
    samples = metrics(served)
    return metric(samples, "specexport:num_requests_running") + metric(samples, "specexport:num_requests_waiting")


def metrics_when(served, test, what: str) -> dict:
    """The /metrics samples once `test(samples)` holds (polled: wait_for's bound on a hang)."""
    def ready():
        samples = metrics(served)
        return samples if test(samples) else None
    return wait_for(ready, what)


def aborted(samples) -> float:
    return metric(samples, "specexport:request_success_total", finished_reason="abort")


def completions_logged(served) -> list[dict]:
    """The access log's lines for /v1/completions (a line is written when the response has ended)."""
    return [line for line in served.access_log() if line["path"] == "/v1/completions"]


# ---- the requests, checked on their own --------------------------------------------------------------------------


def test_neutral_values_pass_and_asking_values_are_refused_by_name():
    base = {"messages": [{"role": "user", "content": "hi"}]}
    neutral = {"n": 1, "logprobs": False, "top_logprobs": 0, "frequency_penalty": 0, "presence_penalty": 0.0,
               "logit_bias": {}, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
               "parallel_tool_calls": True, "store": False, "metadata": {"a": "b"}, "service_tier": "auto",
               "stream_options": {"include_usage": False}, "user": "u1", "seed": 3, "top_k": 5}
    job = protocol.chat_request({**base, **neutral})
    assert job.sampling == SamplingParams(temperature=1.0, top_k=5, seed=3)
    for name, value in {"n": 17, "logprobs": 1, "top_logprobs": 2, "frequency_penalty": 2.5, "presence_penalty": -3,
                        "tools": [{"type": "function"}], "tool_choice": "required",
                        "response_format": {"type": "xml"}, "reasoning_effort": "high"}.items():
        with pytest.raises(protocol.ApiError) as e:
            protocol.chat_request({**base, name: value})
        assert e.value.status == 400 and e.value.param in (name, f"{name}[0]"), (name, e.value.message)
    assert protocol.chat_request({**base, "n ": 1}).ignored == ("n ",)  # unknown: ignored, and named
    with pytest.raises(protocol.ApiError) as e:
        protocol.chat_request({**base, "n ": 1}, strict=True)  # serve --strict
    assert e.value.param == "n "
    assert protocol.completion_request({"prompt": "x", "best_of": 1, "echo": False, "suffix": None}).prompts == ["x"]
    with pytest.raises(protocol.ApiError, match="echo"):
        protocol.completion_request({"prompt": "x", "echo": True, "logprobs": 1, "stream": True})
    for body, param in [({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"), ({"n": 0}, "n"),
                        ({"echo": "yes"}, "echo")]:
        with pytest.raises(protocol.ApiError) as e:
            protocol.completion_request({"prompt": "x", **body})
        assert e.value.status == 400 and e.value.param == param, body


def test_messages_become_the_templates_messages():
    job = protocol.chat_request({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "ann"},
        {"role": "assistant", "content": "ok", "tool_calls": [], "refusal": None}]})
    assert job.prompts == [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "a\nb", "name": "ann"},
                            {"role": "assistant", "content": "ok"}]]
    called = protocol.chat_request({"messages": [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}]})
    assert called.prompts == [[{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"}]]
    for messages, param in [([], "messages"), ([{"role": "robot", "content": "x"}], "messages[0].role"),
                            ([{"role": "user", "content": 5}], "messages[0].content"),
                            ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}],
                             "messages[0].content"),
                            ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
                            ([{"role": "function", "content": "x"}], "messages[0]"),
                            ([{"role": "assistant", "content": None, "tool_calls": [{"id": "t"}]}],
                             "messages[0].tool_calls[0]"),
                            ([{"role": "assistant", "content": None, "tool_calls": [
                                {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}],
                             "messages[0].tool_calls[0]")]:
        with pytest.raises(protocol.ApiError) as e:
            protocol.chat_request({"messages": messages})
        assert e.value.param == param, (messages, e.value.message)


# ---- a real server, the official client ----------------------------------------------------------------------------


def test_the_openai_client_streamed_and_not(server, bundle):
    """Chat and completions, streamed and not: greedy text equals the engine's batch-1 generation, streamed chunks
    concatenate to it, usage counts the tokens, a seeded sampled request repeats exactly."""
    engine = Engine.load(bundle, threads=1)
    api = client(server)
    [model] = [m.id for m in api.models.list().data]
    assert model == "tiny-ngram"
    for prompt in PROMPTS[:3]:
        want = engine.generate(prompt, max_new_tokens=24)
        chat = api.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], max_tokens=24,
                                           temperature=0)
        assert chat.choices[0].message.content == want.text
        assert chat.choices[0].finish_reason == ("length" if want.stop_reason == "length" else "stop")
        assert chat.usage.completion_tokens == len(want.tokens)
        assert chat.usage.prompt_tokens == len(engine.encode(prompt))
        assert chat.usage.total_tokens == chat.usage.prompt_tokens + chat.usage.completion_tokens
        assert chat.usage.model_extra["specexport"]["steps"] >= 1
        pieces, finish, usage, ids = [], [], None, set()
        for event in api.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=24, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}):
            ids.add(event.id)
            if event.usage is not None:
                usage = event.usage
                assert event.choices == []
                continue
            pieces.append(event.choices[0].delta.content or "")
            finish.append(event.choices[0].finish_reason)
        assert "".join(pieces) == want.text and len(ids) == 1
        assert finish[-1] == chat.choices[0].finish_reason and set(finish[:-1]) == {None}
        assert usage.completion_tokens == len(want.tokens)
        text = api.completions.create(model=model, prompt=prompt, max_tokens=16, temperature=0)
        raw = engine.generate(prompt, max_new_tokens=16, chat=False)
        assert text.choices[0].text == raw.text and text.usage.completion_tokens == len(raw.tokens)
        streamed = "".join(e.choices[0].text for e in api.completions.create(
            model=model, prompt=prompt, max_tokens=16, temperature=0, stream=True) if e.choices)
        assert streamed == raw.text
    two = api.completions.create(model=model, prompt=PROMPTS[:2], max_tokens=8, temperature=0)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [engine.generate(p, max_new_tokens=8, chat=False).text for p in PROMPTS[:2]]
    seeded = [api.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPTS[3]}],
                                          max_tokens=20, temperature=1.0, seed=11).choices[0].message.content
              for _ in range(2)]
    assert seeded[0] == seeded[1] == engine.generate(PROMPTS[3], max_new_tokens=20,
                                                     sampling=SamplingParams(temperature=1.0, seed=11)).text


BAD = [  # (what, method, path, body, headers, status, param)
    ("malformed JSON", "POST", "/v1/chat/completions", b'{"messages": [', {}, 400, None),
    ("not an object", "POST", "/v1/chat/completions", b"[1, 2]", {}, 400, None),
    ("wrong content type", "POST", "/v1/chat/completions", b"messages=x", {"Content-Type": "text/plain"}, 415, None),
    ("not UTF-8", "POST", "/v1/completions", b'{"prompt": "\xff\xfe"}', {}, 400, None),
    ("10 MB body", "POST", "/v1/completions", b'{"prompt": "' + b"a" * (10 << 20) + b'"}', {}, 413, None),
    ("n past its limit", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 17}, {},
     400, "n"),
    ("logprobs past 20", "POST", "/v1/completions", {"prompt": "x", "logprobs": 21}, {}, 400, "logprobs"),
    ("top_logprobs without logprobs", "POST", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, {}, 400, "top_logprobs"),
    ("tools", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                               "tools": [{"type": "function", "function": {"name": "f"}}]}, {}, 400,
     "tools"),
    ("a penalty past 2", "POST", "/v1/completions", {"prompt": "x", "frequency_penalty": 2.5}, {}, 400,
     "frequency_penalty"),
    ("max_tokens 0", "POST", "/v1/completions", {"prompt": "x", "max_tokens": 0}, {}, 400, "max_tokens"),
    ("max_tokens past the context", "POST", "/v1/completions", {"prompt": "x", "max_tokens": 100000}, {}, 400,
     "max_tokens"),
    ("temperature -1", "POST", "/v1/completions", {"prompt": "x", "temperature": -1}, {}, 400, "temperature"),
    ("temperature NaN", "POST", "/v1/completions", b'{"prompt": "x", "temperature": NaN}', {}, 400, "temperature"),
    ("top_p 0", "POST", "/v1/completions", {"prompt": "x", "top_p": 0}, {}, 400, "top_p"),
    ("empty messages", "POST", "/v1/chat/completions", {"messages": []}, {}, 400, "messages"),
    ("unknown role", "POST", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, {}, 400,
     "messages[0].role"),
    ("non-string content", "POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": {"a": 1}}]}, {},
     400, "messages[0].content"),
    ("unknown model", "POST", "/v1/completions", {"model": "gpt-9", "prompt": "x"}, {}, 404, "model"),
    ("100 stop strings", "POST", "/v1/completions", {"prompt": "x", "stop": [f"s{i}" for i in range(100)]}, {}, 400,
     "stop"),
    ("a prompt past the context", "POST", "/v1/completions", {"prompt": "word " * 400}, {}, 400, "prompt"),
    ("token ids out of the vocabulary", "POST", "/v1/completions", {"prompt": [1, 2, 99999]}, {}, 400, "prompt"),
    ("unknown path", "GET", "/v1/engines", None, {}, 404, None),
    ("wrong method", "GET", "/v1/chat/completions", None, {}, 405, None),
    ("unknown model card", "GET", "/v1/models/nope", None, {}, 404, "model"),
]


def test_a_client_that_writes_its_whole_body_first_reads_the_413(server):
    """Python's urllib sends the whole body before reading: a body over the limit (4 MiB), declared or chunked, is
    read and dropped, so that it reads the 413 in OpenAI's shape rather than a reset connection; the server then
    answers the next request."""
    import urllib.error
    import urllib.request

    def chunks():
        for _ in range(12):
            yield b"a" * (1 << 20)

    before = len(server.access_log())
    for body in (b'{"prompt": "' + b"a" * (12 << 20) + b'"}', chunks()):
        request = urllib.request.Request(server.url + "/v1/completions", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 413
        assert json.loads(refused.value.read())["error"]["code"] == "request_too_large"
    status, _, _ = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200
    lines = wait_for(lambda: len(server.access_log()) >= before + 3 and server.access_log()[before:],
                     "an access-log line for each request")  # read before the next test counts its own
    assert [line["status"] for line in lines] == [413, 413, 200]


def test_bad_input_gets_its_status_and_openais_error_shape(server):
    before = len(server.access_log())
    for what, method, path, body, headers, status, param in BAD:
        got, _, answer = post(server, path, body, headers, method=method)
        assert got == status, (what, got, answer)
        assert set(answer) == {"error"} and set(answer["error"]) == {"message", "type", "param", "code"}, (what, answer)
        assert answer["error"]["param"] == param and answer["error"]["message"], (what, answer)
        assert "Traceback" not in answer["error"]["message"]
    lines = wait_for(lambda: len(server.access_log()) >= before + len(BAD) and server.access_log()[before:],
                     "an access-log line for each request")  # through the server's stderr and a reader thread
    assert [line["status"] for line in lines] == [b[5] for b in BAD]  # one line each, with its error
    assert all(line["error"] for line in lines)
    assert not any("Traceback" in line for line in server.lines)
    api = client(server)  # and the server goes on serving
    assert api.completions.create(model="tiny-ngram", prompt="x", max_tokens=3, temperature=0).usage.completion_tokens


def test_api_key(bundle):
    with Served(bundle, "--api-key", "s3cret", "--threads", "1") as served:
        for key in ("wrong", None):
            status, _, body = post(served, "/v1/models", None, {"Authorization": f"Bearer {key}"} if key else {},
                                   method="GET")
            assert status == 401 and body["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            client(served, api_key="nope").models.list()
        assert client(served, api_key="s3cret").models.list().data[0].id == "tiny-ngram"
        assert post(served, "/health", None, method="GET")[0] == 200  # operations stay open
        assert served.stop() == 0


def stream_some(served, prompt, max_tokens, stop_after=None):
    """A raw streamed completion: the concatenated text, the finish reason and the events; `stop_after`: close the
    connection after that many text events (a client going away)."""
    parts = urlsplit(served.url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    connection.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = connection.getresponse()
    if response.status != 200:
        text = response.read().decode()
        connection.close()
        return {"status": response.status, "retry_after": response.getheader("Retry-After"), "body": text}
    text, finish, usage, events, done, error = [], None, None, 0, False, None
    for line in response:
        line = line.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            done = True
            break
        event = json.loads(line[6:])
        error = event.get("error", error)
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            text.append(choice["text"])
            finish = choice["finish_reason"] or finish
        events += 1
        if stop_after is not None and events >= stop_after:
            connection.sock.close()
            connection.close()
            return {"status": 200, "disconnected": True}
    connection.close()
    return {"status": 200, "text": "".join(text), "finish": finish, "usage": usage, "done": done, "error": error}


def test_load_queue_limit_disconnects_and_metrics(bundle, tmp_path):
    """More concurrent clients than --max-batch + --max-queue, streamed and not, some leaving mid-stream: each
    either completes with all its tokens or gets a 429 with Retry-After; the server's RSS after the run is within a
    few percent of before (after a warm-up at full batch); /metrics adds up to what the clients saw. Each wave is
    held at its first tokens (a gate) until every client has its place or its 429: the first four, in order (a
    disconnecting one among them), fill both slots and the queue, the rest are refused, on a fast machine or a slow
    one."""
    N = 120
    engine = Engine.load(bundle, threads=1)
    want = {p: engine.generate(p, max_new_tokens=N, chat=False) for p in PROMPTS}
    gate = Gate(tmp_path / "gate")
    with Served(bundle, "--max-batch", "2", "--max-queue", "2", "--threads", "1", gate=gate) as served:
        proc = psutil.Process(served.pid)
        api = client(served)

        def one(i):
            prompt = PROMPTS[i % len(PROMPTS)]
            if i % 4 == 1:
                return prompt, stream_some(served, prompt, 200, stop_after=3)
            if i % 2:
                return prompt, stream_some(served, prompt, N)
            try:
                answer = api.completions.create(model="tiny-ngram", prompt=prompt, max_tokens=N, temperature=0)
                return prompt, {"status": 200, "text": answer.choices[0].text, "usage": answer.usage.model_dump(),
                                "finish": answer.choices[0].finish_reason, "done": True}
            except openai.RateLimitError as e:
                return prompt, {"status": 429, "retry_after": e.response.headers.get("retry-after")}

        def wave(n):
            wait_for(lambda: active(served) == 0, "an idle server")  # a client that left may still be running
            gate.hold()
            results = [None] * n
            threads = [threading.Thread(target=lambda i=i: results.__setitem__(i, one(i))) for i in range(n)]
            for i, t in enumerate(threads):
                t.start()
                if i < 4:  # in index order: the first ones (a disconnecting one among them) are admitted
                    wait_for(lambda: active(served) == i + 1, f"client {i} admitted")
            for t in threads[4:]:
                t.join(timeout=300)  # the slots and the queue are full (held): a 429 at once
            gate.release()
            for t in threads:
                t.join(timeout=300)
            assert not any(t.is_alive() for t in threads)
            return results

        wave(4)  # warm-up: both slots, the queue, streamed and not
        wait_for(lambda: active(served) == 0, "the warm-up's end")
        rss_before, base = proc.memory_info().rss, metrics(served)
        results = []
        for _ in range(3):
            results += wave(12)

        completed = [(p, r) for p, r in results if r["status"] == 200 and not r.get("disconnected")]
        refused = [r for _, r in results if r["status"] == 429]
        left = [r for _, r in results if r.get("disconnected")]
        assert len(completed) + len(refused) + len(left) == len(results)
        assert (len(completed), len(refused), len(left)) == (9, 24, 3), [r["status"] for _, r in results]

        def ended(samples):  # requests ended since `base`, by the server's count
            return sum(metric(samples, "specexport:request_success_total", finished_reason=reason) -
                       metric(base, "specexport:request_success_total", finished_reason=reason)
                       for reason in ("length", "stop", "abort", "error"))

        def settled(samples):  # every request counted (one that left is, once the server has seen it go), none held
            held = metric(samples, "specexport:num_requests_running") + metric(samples, "specexport:num_requests_waiting")
            return held == 0 and ended(samples) >= len(completed) + len(left)

        after = metrics_when(served, settled, "the server to count every request")
        rss_after = proc.memory_info().rss
        assert all(r["retry_after"] and int(r["retry_after"]) >= 1 for r in refused)
        for prompt, r in completed:
            assert r["done"] and r["text"] == want[prompt].text, (prompt, r)  # no duplicates, no gaps
            assert r["usage"]["completion_tokens"] == len(want[prompt].tokens)
        assert abs(rss_after - rss_before) <= 0.05 * rss_before, (rss_before, rss_after)

        def grew(name, **labels):
            return metric(after, name, **labels) - metric(base, name, **labels)

        assert grew("specexport:request_success_total", finished_reason="length") + \
            grew("specexport:request_success_total", finished_reason="stop") == len(completed)
        assert grew("specexport:request_success_total", finished_reason="abort") == len(left)
        assert grew("specexport:request_rejected_total", status="429") == len(refused)
        prompt_tokens = {p: len(engine.encode(p, chat=False)) for p in PROMPTS}
        admitted = [p for p, r in results if r["status"] == 200]
        assert grew("specexport:prompt_tokens_total") == sum(prompt_tokens[p] for p in admitted)
        seen = sum(r["usage"]["completion_tokens"] for _, r in completed)
        generated = grew("specexport:generation_tokens_total")
        assert seen + 3 * len(left) <= generated <= seen + 200 * len(left)
        assert grew("specexport:e2e_request_latency_seconds_count") == len(completed) + len(left)
        # the drafting governor may stop drafting on a machine where it does not pay: the counts agree, not their size
        assert grew("specexport:spec_decode_num_draft_tokens_total") >= grew("specexport:spec_decode_num_accepted_tokens_total") >= 0
        per_pos = sum(v for k, v in after.items() if k.startswith("specexport:spec_decode_num_accepted_tokens_per_pos")) - \
            sum(v for k, v in base.items() if k.startswith("specexport:spec_decode_num_accepted_tokens_per_pos"))
        assert per_pos == grew("specexport:spec_decode_num_accepted_tokens_total")
        assert metric(after, "specexport:num_requests_running") == metric(after, "specexport:num_requests_waiting") == 0
        assert metric(after, "specexport:batch_size_count") > 0
        assert served.stop() == 0


def test_a_disconnected_client_cancels_its_request(bundle, tmp_path):
    """The request is held at its first tokens (a gate) until it is cancelled: it cannot finish before its client
    leaves, however fast this machine generates (unheld, the 240 tokens took 60 ms on a busy 2-core machine)."""
    gate = Gate(tmp_path / "gate")
    with Served(bundle, "--max-batch", "2", "--threads", "1", gate=gate) as served:
        gate.hold()
        parts = urlsplit(served.url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        connection.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 240,
                                                                        "temperature": 0}),
                           headers={"Content-Type": "application/json"})
        wait_for(lambda: metric(metrics(served), "specexport:num_requests_running"), "the request to run")
        connection.sock.close()  # gone before its answer
        samples = metrics_when(served, aborted, "the request to end")
        gate.release()
        assert metric(samples, "specexport:num_requests_running") == 0
        assert metric(samples, "specexport:request_success_total", finished_reason="abort") == 1
        assert metric(samples, "specexport:generation_tokens_total") < 240
        assert served.stop() == 0


def test_a_stream_left_before_its_first_event_is_cancelled(bundle, tmp_path):
    """One slot: a long stream runs; a second stream waits in the queue and its client leaves before any event.
    The waiting request is dropped (never generates), the first one completes. The first is held at its first
    tokens (a gate) until the second's response has ended: it cannot finish first, however fast this machine is."""
    engine = Engine.load(bundle, threads=1)
    want = engine.generate(PROMPTS[1], max_new_tokens=200, chat=False)
    gate = Gate(tmp_path / "gate")
    with Served(bundle, "--max-batch", "1", "--threads", "1", gate=gate) as served:
        gate.hold()
        first = {}
        reader = threading.Thread(target=lambda: first.update(stream_some(served, PROMPTS[1], 200)))
        reader.start()
        wait_for(lambda: metric(metrics(served), "specexport:num_requests_running"), "the first stream to run")
        parts = urlsplit(served.url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
        connection.request("POST", "/v1/completions", body=json.dumps({"prompt": "x", "max_tokens": 200,
                                                                        "stream": True}),
                           headers={"Content-Type": "application/json"})
        wait_for(lambda: metric(metrics(served), "specexport:num_requests_waiting"), "the second stream queued")
        connection.sock.close()  # gone while queued: no event was sent
        wait_for(lambda: completions_logged(served), "the second stream's response to end")  # (the first is held)
        gate.release()
        reader.join(timeout=120)
        samples = metrics_when(served, aborted, "the queued one dropped")
        assert first["done"] and first["text"] == want.text
        assert metric(samples, "specexport:request_success_total", finished_reason="abort") == 1
        assert metric(samples, "specexport:generation_tokens_total") == len(want.tokens)
        assert metric(samples, "specexport:num_requests_waiting") == 0
        assert served.stop() == 0


def test_sigterm_drains_then_exits_0(bundle, tmp_path):
    """SIGTERM with six streams on one slot (one running, five queued): they all finish with all their tokens, a new
    request and /ready get a 503, the process exits 0. SIGINT with --drain-timeout 0: what has not finished is
    stopped (an error event, then [DONE], ends its stream), still exit 0."""
    engine = Engine.load(bundle, threads=1)
    want = engine.generate(PROMPTS[1], max_new_tokens=200, chat=False)
    for timeout, finishes in ((60, True), (0, False)):
        gate = Gate(tmp_path / f"gate-{timeout}")  # the streams held at their first tokens until the signal is in
        with Served(bundle, "--threads", "1", "--max-batch", "1", "--drain-timeout", timeout, gate=gate) as served:
            gate.hold()
            results = [{} for _ in range(6)]
            readers = [threading.Thread(target=lambda r=r: r.update(stream_some(served, PROMPTS[1], 200)))
                       for r in results]
            for reader in readers:
                reader.start()
            wait_for(lambda: active(served) == 6, "one stream running, five queued")
            served.process.send_signal(signal.SIGTERM if finishes else signal.SIGINT)  # Ctrl-C drains alike
            if finishes:
                wait_for(lambda: post(served, "/ready", None, method="GET")[0] == 503, "/ready to answer 503")
                status, _, body = post(served, "/v1/completions", {"prompt": "x", "max_tokens": 2})
                assert status == 503 and body["error"]["type"] == "service_unavailable"
                gate.release()  # the drain: all six finish
            for reader in readers:
                reader.join(timeout=120)
            assert served.process.wait(timeout=60) == 0
            if finishes:
                assert all(r["done"] and r["text"] == want.text and r["error"] is None for r in results)
            else:  # every stream ends with [DONE]; those stopped say why first
                assert all(r["done"] and (r["error"] or r["text"] == want.text) for r in results)
                assert any(r["error"] and r["error"]["type"] == "service_unavailable" for r in results)
            assert not any("Traceback" in line for line in served.lines)


def test_served_on_the_device_path_equals_batch_one(bundle):
    """`serve --device cpu-iobinding` (ONNX Runtime's device path, the code `--device cuda` runs, its KV pool on the
    device): six chat requests at once through the `openai` client, batched on four slots, each the host engine's
    batch-1 text."""
    engine = Engine.load(bundle, threads=1)
    want = [engine.generate(p, max_new_tokens=24).text for p in PROMPTS]
    with Served(bundle, "--max-batch", "4", "--threads", "1", "--device", "cpu-iobinding") as served:
        assert any("KV cache: 4 sequences" in line for line in served.lines)
        api, got = client(served), [None] * len(PROMPTS)

        def ask(i):
            got[i] = api.chat.completions.create(model="tiny-ngram", messages=[{"role": "user", "content": PROMPTS[i]}],
                                                 max_tokens=24, temperature=0).choices[0].message.content

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=300)
        assert got == want
        assert served.stop() == 0


def test_serve_bad_options_are_one_line(bundle, tmp_path):
    cases = [([tmp_path / "missing"], "does not exist"),
             ([bundle, "--max-batch", "0"], "Invalid value for '--max-batch'"),
             ([bundle, "--api-key", " "], "--api-key must not be empty"),
             ([bundle, "--max-context", "100000"], "the context limit must be in 2..256"),
             ([bundle, "--device", "tpu"], "Invalid value for '--device'"),
             ([bundle, "--prefix-cache", "-1"], "Invalid value for '--prefix-cache'")]
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        cases.append(([bundle, "--device", "cuda"], "no CUDAExecutionProvider"))
    for args, match in cases:
        result = subprocess.run([SPECEXPORT, "serve", *map(str, args)], capture_output=True, text=True, timeout=120)
        assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
        assert match in result.stderr.strip().splitlines()[-1], result.stderr
    with socket.socket() as taken:  # an address it cannot have: one line, before the bundle loads
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args, line in [(["--port", port], f"cannot listen on 127.0.0.1:{port} (--port): Address already in use"),
                           (["--host", "no-such-host.invalid"], "cannot listen on no-such-host.invalid: ")]:
            result = subprocess.run([SPECEXPORT, "serve", bundle, *map(str, args)], capture_output=True, text=True,
                                    timeout=120)
            assert result.returncode == 1 and "KV cache" not in result.stderr, result.stderr
            assert result.stderr.strip().splitlines()[-1].startswith(f"Error: {line}"), result.stderr


# ---- the real model --------------------------------------------------------------------------------------------------


@pytest.mark.real
@pytest.mark.slow
def test_real_smollm2_served_greedy_equals_specexport_run(real_smol_ngram):
    """SmolLM2-135M fp32 with n-gram speculation behind `specexport serve`: four chat requests at once through the
    `openai` client (batched on one engine), streamed and not, each equal to `specexport run --json`'s text. Then a
    conversation with its own system prompt, three turns: the third copies the first two's chunks (runtime/prefix.py:
    the prefix cache's hits in /metrics) and answers what `specexport run` answers the same prompt ids (a fresh
    process: computed); a server with `--prefix-cache 0` copies nothing and answers the same."""
    from specexport.runtime.prefix import PrefixStore
    from specexport.runtime.tokenizer import Tokenizer

    bundle, prompts, want = real_smol_ngram
    with Served(bundle, "--max-batch", "4") as served:
        api = client(served)
        got = [None] * (2 * len(prompts))

        def ask(i):
            messages = [{"role": "user", "content": prompts[i % len(prompts)]}]
            if i < len(prompts):
                answer = api.chat.completions.create(model="smol-ngram", messages=messages, max_tokens=48,
                                                     temperature=0)
                got[i] = (answer.choices[0].message.content, answer.usage.completion_tokens)
            else:
                got[i] = ("".join(e.choices[0].delta.content or "" for e in api.chat.completions.create(
                    model="smol-ngram", messages=messages, max_tokens=48, temperature=0, stream=True)), None)

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(got))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        for i, (text, count) in enumerate(got):
            assert text == want[i % len(prompts)]["text"], (i, text)
            assert count in (None, want[i % len(prompts)]["new_tokens"])
        before = metrics(served)
        chat = [{"role": "system", "content": "You answer in one short sentence, plainly, without lists or code."}]
        for prompt in prompts[:3]:
            chat.append({"role": "user", "content": prompt})
            answer = api.chat.completions.create(model="smol-ngram", messages=chat, max_tokens=48, temperature=0)
            chat.append({"role": "assistant", "content": answer.choices[0].message.content})
        after = metrics(served)
        hits, queries, prompt_tokens = (
            metric(after, f"specexport:{name}_total") - metric(before, f"specexport:{name}_total")
            for name in ("prefix_cache_hits", "prefix_cache_queries", "prompt_tokens"))
        assert queries == prompt_tokens  # every prompt token of the conversation's requests looked up
        tokenizer = Tokenizer.from_dir(bundle)
        ids = tokenizer.encode_chat(chat[:-1])
        cuts = PrefixStore.of(tokenizer).split(ids)  # the system prompt, turn 1, turn 2 (a question and its answer)
        assert len(cuts) == 3 and hits == cuts[0] + cuts[1]  # turn 2 copied the system prompt, turn 3 that and turn 1
        run = json.loads(specexport("run", bundle, "--prompt-ids", ",".join(map(str, ids)), "--json",
                                    "--max-new-tokens", "48"))
        assert chat[-1]["content"] == run["text"]
        assert served.stop() == 0
    with Served(bundle, "--max-batch", "1", "--prefix-cache", "0") as served:  # nothing kept: every turn computed
        for turn in (4, 6):
            answer = client(served).chat.completions.create(model="smol-ngram", messages=chat[:turn], max_tokens=48,
                                                            temperature=0)
            assert answer.choices[0].message.content == chat[turn]["content"]
        assert metric(metrics(served), "specexport:prefix_cache_hits_total") == 0
        assert served.stop() == 0


@pytest.mark.real
@pytest.mark.slow
def test_real_smollm2_parses_pydantic_objects_through_the_openai_client(real_smol_ngram):
    """The openai client's beta.chat.completions.parse with a pydantic model, against SmolLM2-135M fp32 with n-gram
    speculation: a valid object every time, greedy and sampled (seeded), four requests at once; the greedy answer is
    constrained plain decoding's (Engine.generate with the same schema, plain)."""
    from typing import Literal

    from pydantic import BaseModel, Field

    from specexport.runtime.grammar import Constraint

    class Pet(BaseModel):
        name: str = Field(max_length=30)
        kind: Literal["cat", "dog", "fish", "bird"]
        age: int = Field(ge=0, le=40)

    bundle, prompts, _ = real_smol_ngram
    asks = ["Describe a pet as JSON with its name, kind and age.", "Invent a dog and give it as JSON.",
            "My cat is called Tom and is 4. Reply in JSON.", prompts[0]]
    with Served(bundle, "--max-batch", "4") as served:
        api = client(served)
        parsed = {}

        def ask(i, temperature):
            answer = api.beta.chat.completions.parse(model="smol-ngram", response_format=Pet, max_tokens=80,
                                                     messages=[{"role": "user", "content": asks[i]}],
                                                     temperature=temperature, seed=i)
            parsed[i, temperature] = (answer.choices[0].message.parsed, answer.choices[0].message.content)

        threads = [threading.Thread(target=ask, args=(i, t)) for i in range(len(asks)) for t in (0.0, 0.9)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        assert len(parsed) == 2 * len(asks) and all(isinstance(p, Pet) for p, _ in parsed.values())
        assert served.stop() == 0
    from openai.lib._pydantic import to_strict_json_schema

    engine = Engine.load(bundle)
    schema = Constraint.json_schema(to_strict_json_schema(Pet))  # what the client sends
    plain = engine.generate(asks[0], max_new_tokens=80, plain=True, sampling=SamplingParams(constraint=schema))
    assert parsed[0, 0.0][1] == plain.text
