"""Throughput and latency over HTTP: `specexport serve` on each bundle (and llama.cpp's OpenAI-compatible server on
the same GGUF, where llama-cpp-python[server] is installed; and `serve --ray` with N replicas, each on its own
private Ray instance, where --ray-replicas is given) under the same closed-loop load, side by side.

Every server is started on loopback at once; then for each concurrency C, each server in turn gets C clients that
each send their next streamed chat request as soon as the last one ends (requests per client fixed, greedy, the
same prompts for all). Printed per server and C: aggregate tokens/s, time to first token and time per output token
(p50/p99, from the stream's arrival times), and requests that failed (0 expected).

    python scripts/bench_http.py --bundle smollm2-best --bundle smollm2-plain \
        --llama-python /path/to/venv/bin/python --gguf SmolLM2-135M-Instruct.Q4_1.gguf
    python scripts/bench_http.py --bundle smollm2-best --ray-replicas 1,2 --concurrency 1,4,8
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench_batch import prompt_texts  # this folder's script

from specexport.serve.listen import free_port

ROOT = Path(__file__).resolve().parent.parent


class Server:
    """A server subprocess on 127.0.0.1 and the model name its clients send."""

    def __init__(self, name: str, argv: list[str], port: int, model: str, env: dict | None = None):
        self.name, self.port, self.model = name, port, model
        self.log = open(f"/tmp/bench_http-{name}.log", "w")
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

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
    parser.add_argument("--prompts", type=Path, default=ROOT / "bench" / "sharegpt40.jsonl")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--ray-replicas", default="", help="Also serve each bundle with serve --ray and this many "
                                                             "replicas (comma-separated; the cores split among them).")
    parser.add_argument("--json", type=Path, default=None, help="Also write the rows here.")
    args = parser.parse_args()
    prompts = prompt_texts(args.prompts)
    levels = [int(c) for c in args.concurrency.split(",")]
    specexport = Path(sys.executable).parent / "specexport"
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
          f"requests per client, {os.cpu_count()} CPUs ({cpu_name()})")
    print(f"{'server':<26}{'C':>4}{'tokens/s':>10}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}{'errors':>8}")
    for r in rows:
        print(f"{r['server']:<26}{r['concurrency']:>4}{r['tokens_per_s']:>10.1f}{r['ttft_p50_ms']:>10.0f}"
              f"{r['ttft_p99_ms']:>8.0f}{r['tpot_p50_ms']:>10.1f}{r['tpot_p99_ms']:>8.1f}{r['errors']:>8}")
    if any(r["first_error"] for r in rows):
        print("first error:", next(r["first_error"] for r in rows if r["first_error"]))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


if __name__ == "__main__":
    main()
