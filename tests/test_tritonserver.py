"""A real Triton Inference Server (PyTriton's bundled tritonserver, started by `specexport triton-serve` on loopback)
serving a repository written by `specexport triton`: generate and generate_stream over HTTP, streaming over gRPC
with tritonclient, batching across requests, bad requests, a clean stop. Skipped where the tritonserver extra is
not installed."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from served import SPECEXPORT

from specexport.runtime.generate import Engine
from specexport.runtime.sampling import SamplingParams
from specexport.serve.listen import free_port

pytest.importorskip("pytriton")
grpcclient = pytest.importorskip("tritonclient.grpc")
pytestmark = [pytest.mark.tritonserver, pytest.mark.slow]

PROMPTS = ["the cat sat on the mat, the cat sat on", "hello there hello there", "abcabcabc abc",
           "a prompt about ships and the sea and the wind"]
MODEL = "tiny"


class Triton:
    """`specexport triton-serve REPO` in a subprocess on free loopback ports."""

    def __init__(self, repo, model: str = MODEL, timeout: float = 180, host: str = "127.0.0.1", address=None):
        """`host`: --host; `address`: where the tests reach it (default: host)."""
        self.model = model
        self.http, self.grpc, self.metrics = free_port(), free_port(), free_port()
        address = address or host
        self.address = f"[{address}]" if ":" in address else address
        self.log = open(repo.parent / "tritonserver.log", "w+")
        self.process = subprocess.Popen([SPECEXPORT, "triton-serve", repo, "--host", host, "--http-port",
                                         str(self.http), "--grpc-port", str(self.grpc), "--metrics-port",
                                         str(self.metrics)], stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while not self.ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                self.log.seek(0)
                raise RuntimeError("tritonserver did not start:\n" + self.log.read()[-4000:])
            time.sleep(0.5)

    def ready(self) -> bool:
        try:
            return urllib.request.urlopen(f"http://{self.address}:{self.http}/v2/health/ready", timeout=2).status == 200
        except OSError:
            return False

    def post(self, path: str, body: dict) -> tuple[int, bytes]:
        request = urllib.request.Request(f"http://{self.address}:{self.http}/v2/models/{self.model}/{path}",
                                         data=json.dumps(body).encode(), method="POST")
        try:
            with urllib.request.urlopen(request, timeout=120) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def counters(self, model: str = MODEL) -> dict[str, float]:
        text = urllib.request.urlopen(f"http://{self.address}:{self.metrics}/metrics", timeout=10).read().decode()
        return {m[0]: float(m[2]) for m in re.findall(r"^(specexport_\w+)\{([^}]*)\} (\S+)$", text, re.M)
                if f'model="{model}"' in m[1]}

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            self.log.close()


@pytest.fixture(scope="module")
def engine(tiny_ngram_bundle):
    return Engine.load(tiny_ngram_bundle, threads=1)


@pytest.fixture(scope="module")
def server(tiny_ngram_bundle, tmp_path_factory):
    repo = tmp_path_factory.mktemp("triton") / "repo"
    made = subprocess.run([SPECEXPORT, "triton", tiny_ngram_bundle, "--output", repo, "--name", MODEL, "--copy",
                           "--max-batch", "4", "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    serial = repo.parent / "serial"  # a second model beside it: the same bundle, requests one at a time
    made = subprocess.run([SPECEXPORT, "triton", tiny_ngram_bundle, "--output", serial, "--name", "tiny-serial",
                           "--no-batching", "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    (serial / "tiny-serial").rename(repo / "tiny-serial")
    triton = Triton(repo)
    yield triton
    assert triton.stop() == 0  # SIGTERM: Triton unloads the model (its scheduler closes) and exits 0


def expected(engine, prompt, n, **sampling):
    result = engine.generate(prompt, max_new_tokens=n, chat=False, sampling=SamplingParams(**sampling))
    return result.tokens, result.text, result.stop_reason


def test_generate_equals_specexport_run(server, engine, tiny_ngram_bundle):
    run = subprocess.run([SPECEXPORT, "run", tiny_ngram_bundle, "--prompt", PROMPTS[0], "--raw",
                          "--max-new-tokens", "24", "--json"], capture_output=True, text=True, timeout=120)
    reference = json.loads(run.stdout)
    status, body = server.post("generate", {"text_input": PROMPTS[0], "max_tokens": 24, "raw": True})
    answer = json.loads(body)
    assert status == 200, body
    assert answer["output_ids"] == reference["tokens"] and answer["text_output"] == reference["text"]
    assert answer["finish_reason"] == reference["stop_reason"] and answer["tau"] >= 1.0
    for prompt in PROMPTS[1:]:
        status, body = server.post("generate", {"text_input": prompt, "max_tokens": 20, "raw": True})
        answer = json.loads(body)
        assert (answer["output_ids"], answer["text_output"], answer["finish_reason"]) == expected(engine, prompt, 20)


def test_generate_stream_sends_a_piece_per_step_then_the_finish(server, engine):
    request = urllib.request.Request(f"http://127.0.0.1:{server.http}/v2/models/{MODEL}/generate_stream",
                                     data=json.dumps({"text_input": PROMPTS[1], "max_tokens": 20, "raw": True,
                                                      "stream": True}).encode(), method="POST")
    with urllib.request.urlopen(request, timeout=120) as response:
        events = [json.loads(line[5:]) for line in response.read().decode().splitlines() if line.startswith("data:")]
    assert len(events) > 2
    ids = [i for e in events for i in np.atleast_1d(e["output_ids"]).tolist()]
    assert (ids, "".join(e["text_output"] for e in events), events[-1]["finish_reason"]) == \
        expected(engine, PROMPTS[1], 20)
    assert all(e["finish_reason"] == "" for e in events[:-1]) and events[-1]["tau"] >= 1.0


def grpc_stream(url: str, prompt: str, n: int, seed: int | None = None, model: str = MODEL, **extra) -> dict:
    client = grpcclient.InferenceServerClient(url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    values = {"text_input": np.array([prompt.encode()], dtype=np.object_), "max_tokens": np.array([n], np.int32),
              "raw": np.array([True]), "stream": np.array([True])}
    if seed is not None:
        values.update(seed=np.array([seed], np.int64), temperature=np.array([0.8], np.float32))
    values.update(extra)
    types = {np.dtype(np.int32): "INT32", np.dtype(np.int64): "INT64", np.dtype(np.float32): "FP32",
             np.dtype(bool): "BOOL", np.dtype(np.object_): "BYTES"}
    inputs = []
    for name, array in values.items():
        tensor = grpcclient.InferInput(name, list(array.shape), types[array.dtype])
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client.async_stream_infer(model, inputs, enable_empty_final_response=True)
    out = {"ids": [], "text": "", "responses": 0}
    try:
        while True:
            result, error = responses.get(timeout=120)
            if error is not None:
                out["error"] = str(error)
                return out
            out["responses"] += 1
            out["ids"] += result.as_numpy("output_ids").tolist()
            out["text"] += b"".join(result.as_numpy("text_output")).decode()
            if result.get_response().parameters["triton_final_response"].bool_param:
                out["finish"] = result.as_numpy("finish_reason")[0].decode()
                return out
    finally:
        client.stop_stream()
        client.close()


def streams_at_once(server: Triton, prompts: list[str], n: int, model: str = MODEL) -> list[dict]:
    """One gRPC stream per prompt, all at once; what each received."""
    outs = [None] * len(prompts)

    def one(k):
        outs[k] = grpc_stream(f"127.0.0.1:{server.grpc}", prompts[k], n, model=model)

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return outs


def test_grpc_streams_at_once_are_batched_and_each_equals_batch_one(server, engine):
    before = server.counters()
    outs = streams_at_once(server, PROMPTS, 24)
    for prompt, out in zip(PROMPTS, outs):
        assert (out["ids"], out["text"], out["finish"]) == expected(engine, prompt, 24), out
        assert out["responses"] > 2
    after = server.counters()
    calls = after["specexport_target_calls_total"] - before.get("specexport_target_calls_total", 0)
    sequences = after["specexport_sequences_total"] - before.get("specexport_sequences_total", 0)
    assert sequences > calls  # some target calls carried more than one request
    assert after["specexport_generation_tokens_total"] - before.get("specexport_generation_tokens_total", 0) == \
        sum(len(o["ids"]) for o in outs)


def test_a_seeded_request_gives_its_tokens_whatever_runs_beside_it(server):
    url = f"127.0.0.1:{server.grpc}"
    alone = grpc_stream(url, PROMPTS[3], 16, seed=7)
    beside: list = []
    neighbour = threading.Thread(target=lambda: beside.append(grpc_stream(url, PROMPTS[0], 24, seed=3)))
    neighbour.start()
    together = grpc_stream(url, PROMPTS[3], 16, seed=7)
    neighbour.join(180)
    assert alone["ids"] == together["ids"] and len(alone["ids"]) > 0 and "error" not in beside[0]


def test_structured_output_and_the_sampling_knobs_through_triton(server, engine):
    """TensorRT-LLM's guided-decoding inputs and the sampling knobs, over Triton's HTTP generate: the engine's
    tokens under the same constraint and settings; a grammar that does not compile is a 400 with its reason."""
    from conftest import CONSTRAINTS, constraint

    for kind, body in (("regex", {"guided_decoding_guide_type": "regex", "guided_decoding_guide": CONSTRAINTS["regex"]}),
                       ("json", {"guided_decoding_guide_type": "json_schema",
                                 "guided_decoding_guide": json.dumps(CONSTRAINTS["json"])})):
        status, raw = server.post("generate", {"text_input": PROMPTS[0], "max_tokens": 30, "raw": True, **body})
        want = engine.generate(PROMPTS[0], max_new_tokens=30, chat=False,
                               sampling=SamplingParams(constraint=constraint(kind)))
        assert status == 200 and json.loads(raw)["output_ids"] == want.tokens, raw
    knobs = {"repetition_penalty": 1.4, "frequency_penalty": 0.5, "min_tokens": 6}
    status, raw = server.post("generate", {"text_input": PROMPTS[1], "max_tokens": 16, "raw": True, **knobs})
    want = engine.generate(PROMPTS[1], max_new_tokens=16, chat=False, sampling=SamplingParams(**knobs))
    assert status == 200 and json.loads(raw)["output_ids"] == want.tokens
    status, raw = server.post("generate", {"text_input": "hi", "guided_decoding_guide_type": "regex",
                                           "guided_decoding_guide": "(ab"})
    assert status == 400 and "the regex is not usable" in json.loads(raw)["error"]


def test_bad_requests_are_triton_errors_and_the_server_goes_on(server, engine):
    cases = [({"max_tokens": 8}, "text_input or as input_ids"),  # our model's checks: 400 and the reason
             ({"text_input": "hi", "top_p": 0}, "top_p"),
             ({"text_input": "hi", "max_tokens": 0}, "max_tokens must be >= 1"),
             ({"text_input": "word " * 400}, "context")]
    for body, message in cases:
        status, raw = server.post("generate", body)
        assert status == 400 and message in json.loads(raw)["error"], (body, status, raw)
    status, raw = server.post("generate", {"text_input": "hi", "max_tokens": "eight"})  # Triton's own JSON check
    assert status >= 400 and "Unable to parse" in json.loads(raw)["error"]
    wrong_type = grpc_stream(f"127.0.0.1:{server.grpc}", PROMPTS[0], 8, max_tokens=np.array([8.0], np.float32))
    assert "error" in wrong_type and "data-type" in wrong_type["error"].lower().replace("datatype", "data-type")
    status, raw = server.post("generate", {"text_input": PROMPTS[2], "max_tokens": 12, "raw": True})
    assert status == 200 and json.loads(raw)["output_ids"] == expected(engine, PROMPTS[2], 12)[0]


def test_a_cancelled_grpc_stream_frees_its_slot(server, engine):
    client = grpcclient.InferenceServerClient(f"{server.address}:{server.grpc}")
    got: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    inputs = []
    for name, array, kind in [("text_input", np.array([PROMPTS[3].encode()], dtype=np.object_), "BYTES"),
                              ("max_tokens", np.array([200], np.int32), "INT32"), ("raw", np.array([True]), "BOOL"),
                              ("stream", np.array([True]), "BOOL")]:
        tensor = grpcclient.InferInput(name, list(array.shape), kind)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    client.async_stream_infer(MODEL, inputs)
    got.get(timeout=120)  # the first piece: it runs
    client.stop_stream(cancel_requests=True)
    client.close()
    deadline = time.monotonic() + 60
    while server.counters()["specexport_requests_running"] + server.counters()["specexport_requests_waiting"] > 0:
        assert time.monotonic() < deadline, "the cancelled request still holds its slot"
        time.sleep(0.2)
    status, raw = server.post("generate", {"text_input": PROMPTS[0], "max_tokens": 8, "raw": True})
    assert status == 200 and json.loads(raw)["output_ids"] == expected(engine, PROMPTS[0], 8)[0]


def test_a_bundle_missing_on_the_node_fails_the_load_in_one_line(tiny_ngram_bundle, tmp_path):
    import shutil

    bundle = tmp_path / "moved"
    shutil.copytree(tiny_ngram_bundle, bundle)
    made = subprocess.run([SPECEXPORT, "triton", bundle, "--output", tmp_path / "repo", "--name", MODEL],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    shutil.rmtree(bundle)
    process = subprocess.run([SPECEXPORT, "triton-serve", tmp_path / "repo", "--http-port", str(free_port()),
                              "--grpc-port", str(free_port()), "--metrics-port", str(free_port())],
                             capture_output=True, text=True, timeout=180, env={**os.environ})
    assert process.returncode != 0
    assert f"bundle {bundle} not found on this node" in process.stdout + process.stderr


def test_an_ipv6_address_or_a_name_as_host(tiny_ngram_bundle, engine, tmp_path):
    """--host ::1 and --host localhost: generate over HTTP, a gRPC stream and the metrics answer there (Triton's HTTP
    endpoint reads only numeric IPv4 addresses as written: triton-serve gives it the resolved address, an IPv6 one
    spelt as each endpoint wants)."""
    import socket

    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    made = subprocess.run([SPECEXPORT, "triton", tiny_ngram_bundle, "--output", tmp_path / "repo", "--name", MODEL,
                           "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    named = socket.getaddrinfo("localhost", 0, type=socket.SOCK_STREAM)[0][4][0]
    for host, address in [("::1", "::1"), ("localhost", named)]:
        triton = Triton(tmp_path / "repo", host=host, address=address)
        try:
            status, raw = triton.post("generate", {"text_input": PROMPTS[1], "max_tokens": 12, "raw": True})
            answer = json.loads(raw)
            assert status == 200 and (answer["output_ids"], answer["text_output"], answer["finish_reason"]) == \
                expected(engine, PROMPTS[1], 12), raw
            out = grpc_stream(f"{triton.address}:{triton.grpc}", PROMPTS[0], 8)
            assert (out["ids"], out["text"], out["finish"]) == expected(engine, PROMPTS[0], 8), out
            assert triton.counters()["specexport_generation_tokens_total"] == len(answer["output_ids"]) + len(out["ids"])
        finally:
            assert triton.stop() == 0


@pytest.mark.real
def test_real_smollm2_on_triton_equals_specexport_run(real_smol_ngram, tmp_path):
    """SmolLM2-135M fp32 with n-gram speculation in a Triton repository: the four prompts at once, two over HTTP
    generate and two as gRPC streams (chat template applied, as `run` does), each equal to `specexport run --json`
    (text and token ids); the same prompts streamed over HTTP generate_stream one by one."""
    bundle, prompts, want = real_smol_ngram
    made = subprocess.run([SPECEXPORT, "triton", bundle, "--output", tmp_path / "repo", "--name", "smol"],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    triton = Triton(tmp_path / "repo", model="smol")
    try:
        got = [None] * len(prompts)

        def ask(i):
            if i % 2:
                out = grpc_stream(f"127.0.0.1:{triton.grpc}", prompts[i], 48, model="smol", raw=np.array([False]))
                got[i] = (out["ids"], out["text"])
            else:
                status, body = triton.post("generate", {"text_input": prompts[i], "max_tokens": 48})
                answer = json.loads(body)
                got[i] = (answer["output_ids"], answer["text_output"])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(600)
        for (ids, text), run in zip(got, want):
            assert (ids, text) == (run["tokens"], run["text"])
        for prompt, run in zip(prompts, want):
            request = urllib.request.Request(f"http://127.0.0.1:{triton.http}/v2/models/smol/generate_stream",
                                             data=json.dumps({"text_input": prompt, "max_tokens": 48,
                                                              "stream": True}).encode(), method="POST")
            with urllib.request.urlopen(request, timeout=300) as response:
                events = [json.loads(line[5:]) for line in response.read().decode().splitlines()
                          if line.startswith("data:")]
            assert "".join(e["text_output"] for e in events) == run["text"]
    finally:
        assert triton.stop() == 0


def test_a_model_without_batching_serves_streams_one_at_a_time(server, engine):
    """--no-batching (what a bundle of TensorRT engines gets): concurrent gRPC streams each equal batch 1, every
    target call carries one sequence."""
    before = server.counters("tiny-serial")
    outs = streams_at_once(server, PROMPTS[:3], 16, model="tiny-serial")
    for prompt, out in zip(PROMPTS, outs):
        assert (out["ids"], out["text"], out["finish"]) == expected(engine, prompt, 16), out
    after = server.counters("tiny-serial")
    calls = after["specexport_target_calls_total"] - before.get("specexport_target_calls_total", 0)
    assert calls > 0 and after["specexport_sequences_total"] - before.get("specexport_sequences_total", 0) == calls
