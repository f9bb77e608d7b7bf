"""`specexport triton`: the model repository it writes, and the Triton model's request parsing (no server here; the
real tritonserver runs in test_tritonserver.py)."""

from __future__ import annotations

import socket
import subprocess

import numpy as np
import pytest
from served import SPECEXPORT

from specexport.errors import UserError
from specexport.runtime.grammar import Constraint
from specexport.runtime.sampling import SamplingParams
from specexport.serve.listen import free_port
from specexport.serve.tritonserver import INPUTS, OUTPUTS, launch
from specexport.serve.tritonserver.model import Job, manifest_sha256, parse
from specexport.serve.tritonserver.repository import MODEL_PY, write_repository


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def test_parse_takes_text_or_ids_and_every_setting():
    job = parse({"text_input": text("Hi!"), "max_tokens": np.array([7], np.int32),
                 "temperature": np.array([0.5], np.float32), "top_p": np.array([0.9], np.float32),
                 "top_k": np.array([3], np.int32), "seed": np.array([11], np.int64),
                 "stop": np.array([b"\n", b"END"], dtype=np.object_), "raw": np.array([True]),
                 "stream": np.array([True])})
    assert job == Job("Hi!", 7, SamplingParams(temperature=0.5, top_k=3, top_p=np.float32(0.9), seed=11),
                      ("\n", "END"), chat=False, stream=True)
    job = parse({"input_ids": np.array([5, 6, 7], np.int32)})
    assert job == Job([5, 6, 7], 128, SamplingParams(), (), chat=True, stream=False)
    job = parse({"input_ids": np.array([5], np.int32), "min_p": np.array([0.25], np.float32),
                 "repetition_penalty": np.array([1.5], np.float32), "frequency_penalty": np.array([0.5], np.float32),
                 "presence_penalty": np.array([-0.5], np.float32), "min_tokens": np.array([3], np.int32),
                 "guided_decoding_guide_type": text("regex"), "guided_decoding_guide": text("[ab]+")})
    assert job.sampling == SamplingParams(min_p=0.25, repetition_penalty=1.5, frequency_penalty=0.5,
                                          presence_penalty=-0.5, min_tokens=3, constraint=Constraint("regex", "[ab]+"))
    json_any = parse({"input_ids": np.array([5], np.int32), "guided_decoding_guide_type": text("json")})
    assert json_any.sampling.constraint == Constraint.json_object()


@pytest.mark.parametrize("values, message", [
    ({}, "text_input or as input_ids"),
    ({"text_input": text("a"), "input_ids": np.array([1], np.int32)}, "one of them"),
    ({"text_input": text("")}, "text_input is empty"),
    ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, "not UTF-8"),
    ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "one value"),
    ({"input_ids": np.zeros((0,), np.int32)}, "non-empty"),
    ({"text_input": text("a"), "top_p": np.array([0.0], np.float32)}, "top_p"),
    ({"text_input": text("a"), "temperature": np.array([np.nan], np.float32)}, "finite"),
    ({"text_input": text("a"), "seed": np.array([-2], np.int64)}, "seed"),
    ({"text_input": text("a"), "prompt": text("b")}, "unknown input 'prompt'"),
    ({"text_input": text("a"), "guided_decoding_guide": text("x")}, "needs guided_decoding_guide_type"),
    ({"text_input": text("a"), "guided_decoding_guide_type": text("xml")}, "must be json, json_schema"),
    ({"text_input": text("a"), "guided_decoding_guide_type": text("regex")}, "needs its guided_decoding_guide"),
    ({"text_input": text("a"), "repetition_penalty": np.array([0.0], np.float32)}, "repetition_penalty"),
])
def test_parse_names_what_is_wrong(values, message):
    with pytest.raises(UserError, match=message):
        parse(values)


def test_the_repository_names_the_bundle_and_its_checksum(tiny_ngram_bundle, tmp_path):
    model = write_repository(tiny_ngram_bundle, tmp_path / "repo", name="tiny", max_batch=4, threads=1)
    config = (model / "config.pbtxt").read_text()
    assert (model / "1" / "model.py").read_text() == MODEL_PY
    assert 'backend: "python"' in config and "decoupled: true" in config and 'name: "tiny"' in config
    for name, dtype, dims in INPUTS:
        assert f'{{ name: "{name}" data_type: {dtype} dims: {dims} optional: true }}' in config
    for name, dtype, dims in OUTPUTS:
        assert f'{{ name: "{name}" data_type: {dtype} dims: {dims} }}' in config
    assert f'key: "bundle" value {{ string_value: "{tiny_ngram_bundle.resolve()}" }}' in config
    assert f'string_value: "{manifest_sha256(tiny_ngram_bundle)}"' in config
    assert 'key: "max_batch" value { string_value: "4" }' in config


def test_copy_puts_the_bundle_inside_and_overwrite_replaces_only_a_repository(tiny_ngram_bundle, tmp_path):
    repo = tmp_path / "repo"
    model = write_repository(tiny_ngram_bundle, repo, copy=True)
    assert model.name == tiny_ngram_bundle.name
    assert (model / "1" / "bundle" / "manifest.json").read_bytes() == (tiny_ngram_bundle / "manifest.json").read_bytes()
    assert 'key: "bundle" value { string_value: "bundle" }' in (model / "config.pbtxt").read_text()
    with pytest.raises(UserError, match="already exists"):
        write_repository(tiny_ngram_bundle, repo)
    write_repository(tiny_ngram_bundle, repo, name="again", overwrite=True)
    assert sorted(p.name for p in repo.iterdir()) == ["again"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a Triton model repository"):
        write_repository(tiny_ngram_bundle, other, overwrite=True)
    assert (other / "notes.txt").read_text() == "mine"
    with pytest.raises(UserError, match="model name"):
        write_repository(tiny_ngram_bundle, tmp_path / "r2", name="../x")
    assert not (tmp_path / "r2").exists()


def test_cli_bad_inputs_are_one_line(tiny_ngram_bundle, tmp_path):
    def run(*args):
        return subprocess.run([SPECEXPORT, *map(str, args)], capture_output=True, text=True, timeout=120)

    missing = run("triton", tmp_path / "nothing", "--output", tmp_path / "repo")
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "does not exist" in missing.stderr
    assert not (tmp_path / "repo").exists()
    ok = run("triton", tiny_ngram_bundle, "--output", tmp_path / "repo")
    assert ok.returncode == 0, ok.stderr
    again = run("triton", tiny_ngram_bundle, "--output", tmp_path / "repo")
    assert again.returncode == 1 and "--overwrite" in again.stderr and again.stderr.count("\n") == 1
    not_repo = run("triton-serve", tmp_path / "nothing")
    assert not_repo.returncode == 1 and "not a Triton model repository" in not_repo.stderr
    assert not_repo.stderr.count("\n") == 1
    with socket.socket() as taken:  # where Triton cannot listen: one line before it starts (it exits on its own)
        taken.bind(("127.0.0.1", free_port()))
        taken.listen()
        port = taken.getsockname()[1]
        ports = ["--http-port", free_port(), "--grpc-port", port, "--metrics-port", free_port()]
        for args, line in [(ports, f"cannot listen on 127.0.0.1:{port} (--grpc-port): Address already in use"),
                           (["--http-port", 9100, "--metrics-port", 9100],
                            "--http-port, --grpc-port, --metrics-port must be different ports"),
                           (["--host", "no-such-host.invalid"], "cannot listen on no-such-host.invalid: ")]:
            refused = run("triton-serve", tmp_path / "repo", *args)
            assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
            assert refused.stderr.startswith(f"Error: {line}"), refused.stderr


def test_the_launcher_names_what_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(launch.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(UserError, match=r"specexport\[tritonserver\]"):
        launch.pytriton_dir()
    monkeypatch.setattr(launch.np, "__version__", "2.1.0")
    with pytest.raises(UserError, match="numpy<2"):
        launch.command(tmp_path, tmp_path / "ws", "127.0.0.1", 1, 2, 3)


def test_serial_runs_requests_one_at_a_time_as_batch_one(tiny_ngram_bundle):
    """The runner of TensorRT bundles (and --no-batching): each request equals Engine.generate, its ids streamed
    per step add up to its tokens, a cancelled one stops, a bad one raises at submit."""
    import threading

    from specexport.runtime.generate import Engine
    from specexport.serve.tritonserver.model import Serial

    engine = Engine.load(tiny_ngram_bundle, threads=1)
    prompts = ["the cat sat on the mat, the cat sat on", "hello there hello there", "abcabcabc abc"]
    want = [engine.generate(p, max_new_tokens=20, chat=False) for p in prompts]
    serial = Serial(engine)
    try:
        streamed = [[] for _ in prompts]
        ended = threading.Semaphore(0)
        requests = [serial.submit(p, max_new_tokens=20, chat=False, on_tokens=streamed[i].extend,
                                  on_end=lambda r: ended.release()) for i, p in enumerate(prompts)]
        for r, w, ids in zip(requests, want, streamed):
            got = r.result(timeout=120)
            assert (got.tokens, got.text, got.stop_reason) == (w.tokens, w.text, w.stop_reason) and ids == w.tokens
        for _ in prompts:
            assert ended.acquire(timeout=10)
        with pytest.raises(UserError, match="max_new_tokens"):
            serial.submit("x", max_new_tokens=0)
        # the callback runs on Serial's thread, which can reach it before `slow` is assigned here: it waits for that
        assigned = threading.Event()
        slow = serial.submit(prompts[0], max_new_tokens=200, chat=False,
                             on_tokens=lambda ids: assigned.wait(60) and slow.cancel())
        assigned.set()
        assert slow.result(timeout=120).stop_reason == "cancelled"
    finally:
        serial.close()


def test_a_tensorrt_bundle_gets_a_gpu_per_instance_and_no_batching(tiny_ngram_bundle, tmp_path):
    import json
    import shutil

    copy = tmp_path / "trt-like"
    shutil.copytree(tiny_ngram_bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["flavour"] = "trt"  # what the repository reads of it (the engines themselves need a GPU)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    model = write_repository(copy, tmp_path / "repo", instances=2)
    config = (model / "config.pbtxt").read_text()
    assert "instance_group [ { count: 2 kind: KIND_GPU } ]" in config
    assert 'key: "batching" value { string_value: "false" }' in config
    model = write_repository(tiny_ngram_bundle, tmp_path / "repo2", batching=False)
    assert 'key: "batching" value { string_value: "false" }' in (model / "config.pbtxt").read_text()


def test_instances_default_to_one_per_group_of_the_profile_s_cores(tiny_ngram_bundle, tmp_path, monkeypatch):
    import json
    import os
    import shutil

    copy = tmp_path / "profiled"
    shutil.copytree(tiny_ngram_bundle, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["profile"] = {"hardware": {"kind": "cpu"}, "detected": {"kind": "cpu", "cores": 2}}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    config = (write_repository(copy, tmp_path / "r1") / "config.pbtxt").read_text()
    assert "count: 8 kind: KIND_CPU" in config and 'key: "threads" value { string_value: "2" }' in config
    config = (write_repository(tiny_ngram_bundle, tmp_path / "r2") / "config.pbtxt").read_text()  # no profile
    assert "count: 1 kind: KIND_CPU" in config and 'key: "threads" value { string_value: "16" }' in config
