"""Soak: `specexport serve` on a bundle for N minutes at a steady request rate, on loopback.

Requests arrive every 1/rate seconds (open loop; half streamed, half not, greedy, prompts in turn), each in its
own thread, at most --max-outstanding at once (an arrival past that counts as dropped by the client, not sent).
Every --interval seconds the script samples the server's RSS and what finished in the window. Printed: a table per
window (requests, errors, tokens/s, end-to-end latency p50/p99, time to first token p50/p99 of the streamed ones,
RSS), then the totals; with --plot, tokens/s, latency and RSS over time in one PNG (matplotlib: the profile extra).

    python benchmarks/soak.py smollm2-plain --minutes 10 --rate 2 --plot soak.png
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from specexport.serve.listen import free_port

from common import SHAREGPT40, pct, prompt_texts


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def request(port: int, model: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": stream}
    start = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("POST", "/v1/chat/completions", body=json.dumps(body),
                           headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            return {"error": f"HTTP {response.status}", "end": time.perf_counter()}
        if not stream:
            tokens = json.loads(response.read())["usage"]["completion_tokens"]
            return {"tokens": tokens, "e2e": time.perf_counter() - start, "end": time.perf_counter()}
        first, tokens, done = None, 0, False
        for line in response:
            line = line.decode().strip()
            if line == "data: [DONE]":
                done = True
                break
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if "error" in event:
                    return {"error": str(event["error"])[:120], "end": time.perf_counter()}
                if any((c.get("delta") or {}).get("content") for c in event.get("choices") or []):
                    first = first or time.perf_counter() - start
                    tokens += 1  # pieces; the usage of a streamed request is not asked for here
        if not done:
            return {"error": "stream ended without [DONE]", "end": time.perf_counter()}
        return {"pieces": tokens, "ttft": first, "e2e": time.perf_counter() - start, "end": time.perf_counter()}
    except OSError as e:
        return {"error": str(e), "end": time.perf_counter()}
    finally:
        connection.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundle", type=Path)
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--rate", type=float, default=2.0, help="Requests per second.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-outstanding", type=int, default=64)
    parser.add_argument("--interval", type=float, default=30.0, help="Seconds per row of the table.")
    parser.add_argument("--prompts", type=Path, default=SHAREGPT40)
    parser.add_argument("--plot", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    prompts = prompt_texts(args.prompts)
    port, model = free_port(), args.bundle.name
    server = subprocess.Popen([str(Path(sys.executable).parent / "specexport"), "serve", str(args.bundle), "--port",
                               str(port), "--max-batch", str(args.max_batch), "--max-queue", "1000"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 600
        while True:
            try:
                connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                connection.request("GET", "/ready")
                if connection.getresponse().status == 200:
                    break
            except OSError:
                if server.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit("the server did not start")
                time.sleep(0.5)
        results, lock, outstanding = [], threading.Lock(), [0]
        dropped = [0]

        def fire(i: int) -> None:
            result = request(port, model, prompts[i % len(prompts)], args.max_tokens, stream=bool(i % 2))
            with lock:
                results.append(result)
                outstanding[0] -= 1

        start = time.perf_counter()
        end = start + 60 * args.minutes
        rows, next_sample, i, last = [], start + args.interval, 0, 0
        while (now := time.perf_counter()) < end:
            due = start + i / args.rate
            wake = min(due, next_sample, end)
            if wake > now:
                time.sleep(wake - now)
            elif now >= next_sample:
                with lock:
                    window, last = results[last:], len(results)
                rows.append(summarize(now - start, window, args.interval, rss_mb(server.pid)))
                print(fmt(rows[-1]), file=sys.stderr, flush=True)
                next_sample += args.interval
            else:
                i += 1
                with lock:
                    if outstanding[0] >= args.max_outstanding:
                        dropped[0] += 1
                        continue
                    outstanding[0] += 1
                threading.Thread(target=fire, args=(i - 1,), daemon=True).start()
        while outstanding[0] and time.perf_counter() < end + 600:
            time.sleep(0.1)
        total = summarize(time.perf_counter() - start, results, time.perf_counter() - start, rss_mb(server.pid))
    finally:
        server.terminate()
        code = server.wait(120)
    print(f"soak: {model}, {args.minutes:g} min at {args.rate:g} requests/s, {args.max_tokens} max new tokens, "
          f"{os.cpu_count()} CPUs; server exit code {code}")
    print(f"{'t (s)':>7}{'requests':>10}{'errors':>8}{'tokens/s':>10}{'e2e p50':>9}{'p99':>8}{'TTFT p50':>10}"
          f"{'p99':>8}{'RSS MB':>9}")
    for row in rows:
        print(fmt(row))
    print("total  " + fmt(total)[7:] + f"   dropped by the client: {dropped[0]}")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "total": total, "dropped": dropped[0]}, indent=1))
    if args.plot:
        plot(rows, args.plot, f"{model}: {args.rate:g} req/s")


def summarize(t: float, window: list[dict], seconds: float, rss: float) -> dict:
    ok = [r for r in window if "error" not in r]
    tokens = sum(r.get("tokens", r.get("pieces", 0)) for r in ok)
    e2e = [r["e2e"] for r in ok]
    ttft = [r["ttft"] for r in ok if r.get("ttft") is not None]
    return {"t": round(t, 1), "requests": len(window), "errors": len(window) - len(ok), "tokens_per_s": tokens / seconds,
            "e2e_p50": pct(e2e, 50), "e2e_p99": pct(e2e, 99), "ttft_p50": pct(ttft, 50), "ttft_p99": pct(ttft, 99),
            "rss_mb": rss, "error_sample": next((r["error"] for r in window if "error" in r), None)}


def fmt(r: dict) -> str:
    return (f"{r['t']:>7.0f}{r['requests']:>10}{r['errors']:>8}{r['tokens_per_s']:>10.1f}{r['e2e_p50']:>9.2f}"
            f"{r['e2e_p99']:>8.2f}{1e3 * r['ttft_p50']:>10.0f}{1e3 * r['ttft_p99']:>8.0f}{r['rss_mb']:>9.1f}")


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["t"] for r in rows]
    fig, axes = plt.subplots(3, 1, figsize=(7, 7), sharex=True)
    axes[0].plot(t, [r["tokens_per_s"] for r in rows])
    axes[0].set_ylabel("tokens/s")
    axes[1].plot(t, [r["e2e_p50"] for r in rows], label="p50")
    axes[1].plot(t, [r["e2e_p99"] for r in rows], label="p99")
    axes[1].set_ylabel("e2e latency (s)")
    axes[1].legend()
    axes[2].plot(t, [r["rss_mb"] for r in rows])
    axes[2].set_ylabel("server RSS (MB)")
    axes[2].set_xlabel("seconds")
    for ax in axes:
        ax.set_ylim(bottom=0)
    axes[0].set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    main()
