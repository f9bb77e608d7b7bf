"""What each way of serving a bundle costs on this machine: seconds from the command to the first answer, and the
memory (RSS summed over every process it started: the server, Ray's raylet/GCS/proxy/controller/replicas, Triton's
model stubs) once it has answered a request. Each runs alone, in turn, on loopback:

    specexport serve BUNDLE                            one process
    specexport serve BUNDLE --ray --replicas 1|2       a private local Ray instance (RAY_TMPDIR of its own)
    specexport triton-serve REPO                       PyTriton's tritonserver, REPO written by `specexport triton`

    python benchmarks/serving_costs.py --bundle smollm2-best [--ray-replicas 1,2] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import psutil

from specexport.serve.listen import free_port


def post(url: str, body: dict) -> bool:
    try:
        request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status == 200
    except OSError:
        return False


def tree_rss_mb(root: psutil.Process, since: float) -> float:
    """RSS of `root`, its descendants, and the processes started since `since` that outlive their parent (Ray's
    daemons re-parent themselves)."""
    seen = {root.pid: root}
    for p in root.children(recursive=True):
        seen[p.pid] = p
    for p in psutil.process_iter(["create_time", "cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if p.info["create_time"] >= since and any(k in cmdline for k in ("ray", "tritonserver", "triton_python")):
            seen[p.pid] = p
    total = 0
    for p in seen.values():
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


def measure(name: str, argv: list[str], ask, env: dict | None = None, timeout: float = 600) -> dict:
    since = time.time() - 1
    start = time.perf_counter()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, **(env or {})})
    try:
        while not ask():
            if process.poll() is not None or time.perf_counter() - start > timeout:
                raise SystemExit(f"{name} did not answer (exit {process.poll()})")
            time.sleep(0.2)
        ready = time.perf_counter() - start
        for _ in range(3):
            ask()
        rss = tree_rss_mb(psutil.Process(process.pid), since)
    finally:
        process.terminate()
        try:
            process.wait(120)
        except subprocess.TimeoutExpired:
            process.kill()
    time.sleep(3)  # the last one's daemons gone before the next starts
    return {"server": name, "ready_s": ready, "rss_mb": rss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, required=True)
    parser.add_argument("--ray-replicas", default="1,2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--no-triton", action="store_true")
    args = parser.parse_args()
    specexport = str(Path(sys.executable).parent / "specexport")
    chat = {"model": args.bundle.name, "messages": [{"role": "user", "content": "Hi!"}], "max_tokens": 8}
    cores = os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="serving-costs-"))
    runs = []
    try:
        if not args.no_triton:
            subprocess.run([specexport, "triton", str(args.bundle), "--output", str(work / "repo")], check=True,
                           capture_output=True)
        for _ in range(args.rounds):
            port = free_port()
            runs.append(measure("serve", [specexport, "serve", str(args.bundle), "--port", str(port)],
                                lambda: post(f"http://127.0.0.1:{port}/v1/chat/completions", chat)))
            for n in [int(n) for n in args.ray_replicas.split(",") if n]:
                port = free_port()
                runs.append(measure(f"serve --ray --replicas {n}", [
                    specexport, "serve", str(args.bundle), "--ray", "--replicas", str(n), "--num-cpus",
                    f"{cores / n:g}", "--threads", str(max(1, cores // n)), "--port", str(port)],
                    lambda: post(f"http://127.0.0.1:{port}/v1/chat/completions", chat),
                    env={"RAY_TMPDIR": tempfile.mkdtemp(prefix="ray", dir="/tmp")}))
            if not args.no_triton:
                http, grpc, metrics = free_port(), free_port(), free_port()
                runs.append(measure("triton-serve", [
                    specexport, "triton-serve", str(work / "repo"), "--http-port", str(http), "--grpc-port",
                    str(grpc), "--metrics-port", str(metrics)],
                    lambda: post(f"http://127.0.0.1:{http}/v2/models/{args.bundle.name}/generate",
                                 {"text_input": "Hi!", "max_tokens": 8})))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"bundle {args.bundle.name}, {cores} CPUs, {args.rounds} rounds (median; min-max)")
    print(f"{'server':<26}{'ready s':>10}{'':>14}{'RSS MB':>10}{'':>14}")
    for name in dict.fromkeys(r["server"] for r in runs):
        mine = [r for r in runs if r["server"] == name]
        ready, rss = [r["ready_s"] for r in mine], [r["rss_mb"] for r in mine]
        print(f"{name:<26}{statistics.median(ready):>10.1f}{f'({min(ready):.1f}-{max(ready):.1f})':>14}"
              f"{statistics.median(rss):>10.0f}{f'({min(rss):.0f}-{max(rss):.0f})':>14}")


if __name__ == "__main__":
    main()
