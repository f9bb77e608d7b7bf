"""C++ through libspecexport against the Python runtime: tokens/s on the same bundles and prompts, greedy.

    .venv/bin/specexport embed --build          # once: the library and the example service into this environment
    .venv/bin/python benchmarks/bench_embed.py BUNDLE [BUNDLE ...] [--prompts benchmarks/prompts/sharegpt40.jsonl]
        [--max-new-tokens 64] [--threads 0] [--service PATH] [--json OUT]

Each side is a persistent process that loads the bundle once and answers JSON lines: the C++ example service
(examples/service.cpp, one worker) and a Python worker here (`--python-worker BUNDLE`) that calls Engine.generate and
streams its text the same way. Every prompt runs on both, one after the other, the order alternating from prompt to
prompt, so machine noise hits both alike. Tokens/s = new tokens / the generate call's wall time (measured inside each
process), summed over the prompts; a warm-up prompt on each side is not counted. Greedy tokens are compared too.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from common import SHAREGPT40, cpu_description, prompt_texts


def python_worker(bundle: str, threads: int) -> None:
    """The Python side: the service's protocol (requests in, chunk lines and a done line out) over Engine.generate."""
    from specexport.runtime.generate import Engine

    engine = Engine.load(bundle, threads=threads or None)
    for line in sys.stdin:
        request = json.loads(line)

        def chunk(text, rid=request["id"]):
            print(json.dumps({"id": rid, "tokens": [], "text": text}), flush=True)

        start = time.perf_counter()
        result = engine.generate(request["prompt"], max_new_tokens=request["max_new_tokens"], on_text=chunk)
        wall = time.perf_counter() - start
        print(json.dumps({"id": request["id"], "done": True, "tokens": result.tokens,
                          "new_tokens": result.stats.new_tokens, "wall_s": wall}), flush=True)


class Side:
    """A worker process and the requests it answers, one at a time."""

    def __init__(self, name: str, command: list[str]):
        self.name = name
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        self.tokens, self.seconds = 0, 0.0

    def ask(self, rid: int, prompt: str, max_new_tokens: int, count: bool = True) -> list[int]:
        self.process.stdin.write(json.dumps({"id": rid, "prompt": prompt, "max_new_tokens": max_new_tokens}) + "\n")
        self.process.stdin.flush()
        tokens = []
        for line in self.process.stdout:
            reply = json.loads(line)
            if "error" in reply:
                raise SystemExit(f"{self.name}: {reply['error']}")
            tokens += reply.get("tokens", [])  # the service's chunks carry them; the Python worker's done line
            if reply.get("done"):
                if count:
                    self.tokens += reply["new_tokens"]
                    self.seconds += reply["wall_s"]
                return tokens
        raise SystemExit(f"{self.name} worker ended early")

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=120)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def bench(bundle: str, prompts: list[str], args) -> dict:
    threads = str(args.threads)
    cpp = Side("C++", [args.service, bundle, "--workers", "1", "--threads", threads])
    py = Side("Python", [sys.executable, __file__, "--python-worker", bundle, "--threads", threads])
    for side in (cpp, py):
        side.ask(-1, prompts[0], args.max_new_tokens, count=False)  # warm-up
    same = 0
    for i, prompt in enumerate(prompts):
        order = (cpp, py) if i % 2 == 0 else (py, cpp)
        got = {side.name: side.ask(i, prompt, args.max_new_tokens) for side in order}
        same += got["C++"] == got["Python"]
    for side in (cpp, py):
        side.close()
    return {"bundle": bundle, "prompts": len(prompts), "identical": same, "cpp_tokens_per_s": round(cpp.rate, 2),
            "python_tokens_per_s": round(py.rate, 2), "ratio": round(cpp.rate / py.rate, 4) if py.rate else None,
            "cpp_tokens": cpp.tokens, "python_tokens": py.tokens}


def concurrency(bundle: str, prompts: list[str], args) -> dict:
    """The service with 1 and with --workers threads on one engine, every prompt sent at once: aggregate tokens/s,
    and overlap = the generations' summed wall time / the run's (1: they ran one after another)."""
    out = {}
    for workers in (1, args.workers):
        requests = "".join(json.dumps({"id": i, "prompt": p, "max_new_tokens": args.max_new_tokens}) + "\n"
                           for i, p in enumerate(prompts))
        start = time.perf_counter()
        proc = subprocess.run([args.service, bundle, "--workers", str(workers), "--threads", str(args.threads)],
                              input=requests, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - start
        done = [r for r in map(json.loads, proc.stdout.splitlines()) if r.get("done")]
        tokens = sum(r["new_tokens"] for r in done)
        out[workers] = {"tokens_per_s": round(tokens / wall, 2), "overlap": round(sum(r["wall_s"] for r in done) / wall, 2)}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bundles", nargs="+")
    parser.add_argument("--prompts", default=str(SHAREGPT40))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=0, help="threads per model call (0: every core)")
    parser.add_argument("--service", default=str(Path(sys.prefix) / "bin" / "specexport-service"),
                        help="the example service [default: the one `specexport embed --build` installed here]")
    parser.add_argument("--workers", type=int, default=0,
                        help="also run every prompt at once through the service with this many threads on one engine")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--python-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.python_worker:
        return python_worker(args.bundles[0], args.threads)
    if not Path(args.service).exists():
        raise SystemExit(f"no service at {args.service}: run 'specexport embed --build' first, or pass --service")
    prompts = prompt_texts(args.prompts)
    print(f"CPU: {cpu_description()}; {len(prompts)} prompts, {args.max_new_tokens} new tokens, greedy", flush=True)
    results = []
    for bundle in args.bundles:
        r = bench(bundle, prompts, args)
        results.append(r)
        print(f"{Path(bundle).name}: C++ {r['cpp_tokens_per_s']:.1f} tokens/s, Python {r['python_tokens_per_s']:.1f} "
              f"tokens/s, ratio {r['ratio']:.3f}, identical tokens {r['identical']}/{r['prompts']}", flush=True)
        if args.workers > 1:
            r["concurrency"] = c = concurrency(bundle, prompts, args)
            print(f"  one engine, 1 vs {args.workers} worker threads: {c[1]['tokens_per_s']:.1f} vs "
                  f"{c[args.workers]['tokens_per_s']:.1f} tokens/s in all, overlap {c[1]['overlap']:.2f} vs "
                  f"{c[args.workers]['overlap']:.2f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_description(), "max_new_tokens": args.max_new_tokens,
                                               "results": results}, indent=2))


if __name__ == "__main__":
    main()
