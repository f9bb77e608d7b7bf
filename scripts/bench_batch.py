#!/usr/bin/env python
"""Throughput against concurrency on one engine: a closed loop of C clients (each sends its next prompt when its last
one finishes, `--requests` each), C = 1, 2, 4, 8, 16, for each configuration:

- `batch-1`: today's engine, one generation at a time (`Engine.generate`; C = 1 only, the reference);
- `plain`: plain decoding, batched (runtime/scheduler.py) on the plain bundle;
- `fixed`: the speculative bundle's method, batched, every tree as its proposer made it;
- `budget`: the same with one tree budget for the batch (runtime/budget.py);
- `genai`: with `--genai CACHE`, onnxruntime-genai's `og.Engine` on its own build of the same weights (the plain
  bundle's precision; its venv and model folders made as scripts/bench_plain.py makes them, in CACHE), the same
  prompt ids, greedy, EOS masked for exactly --new-tokens. On CPU genai 0.18 batches statically
  (`engine.static_batching.max_batch_size` = C): its continuous `dynamic_batching` needs a PagedAttention model,
  which its builder makes for CUDA only. Its closed loop runs in its own process, in the Engine's one thread (a
  finished request's client sends its next prompt at once).

Printed per configuration and C: aggregate tokens/s (all new tokens / wall time), time to first token p50/p99
(submit to first token: queueing and prefill included), time between tokens p50/p99 (the gap before each step's
tokens divided by how many it brought, over all steps of all requests), the mean rows per target call and the
scheduler's time outside the graph calls per step. Configurations alternate at each C, so they see the same
machine; each closed loop runs in a process of its own (its bundle loaded afresh, so that no configuration runs beside
another's engine, caches and threads) and starts after one short untimed request. With `--rounds R` each
configuration runs R closed loops at each C (each round after the first in a shuffled order): the tokens/s printed is
their median, the latencies are pooled, and the ratios are taken round by round (the budget over the better of plain
and fixed in the same round), with the median and the range over rounds; plain then runs twice a round, and the
ratio of the pair (`plain-again` / `plain`, an A/A test) shows how far such a ratio moves on this machine with
nothing changed. Greedy unless `--temperature` (then every request samples, with `--top-p`, unseeded: a seeded
request keeps its whole tree, so that its tokens never depend on the batch), EOS suppressed (every request emits
exactly --new-tokens).

    python scripts/bench_batch.py --plain BUNDLE --method BUNDLE [--prompts bench/sharegpt40.jsonl]
        [--concurrency 1,2,4,8,16] [--requests 2] [--rounds 1] [--new-tokens 128] [--temperature T [--top-p P]]
        [--threads N] [--genai CACHE] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from specexport.errors import UserError  # noqa: E402
from specexport.runtime.bench import read_prompts  # noqa: E402
from specexport.runtime.generate import Engine  # noqa: E402
from specexport.runtime.sampling import SamplingParams  # noqa: E402
from specexport.runtime.scheduler import Scheduler  # noqa: E402


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))] if values else float("nan")


def closed_loop(submit, prompts: list[str], clients: int, per_client: int) -> dict:
    """`clients` threads, each submitting `per_client` prompts one after the other; the requests' arrival records."""
    lock, done, next_prompt = threading.Lock(), [], iter(range(clients * per_client))

    def client():
        for _ in range(per_client):
            with lock:
                k = next(next_prompt)
            request = submit(prompts[k % len(prompts)])
            request.result(timeout=1800)
            with lock:
                done.append(request)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    tokens = sum(r.result().stats.new_tokens for r in done)
    ttft = [r.arrivals[0][0] - r.submitted for r in done]
    tbt = [(t1 - t0) / n for r in done for (t0, _), (t1, n) in zip(r.arrivals, r.arrivals[1:]) if n]
    return loop_row(tokens, wall, len(done), ttft, tbt)


def loop_row(tokens: int, wall: float, requests: int, ttft: list[float], tbt: list[float]) -> dict:
    """One closed loop's figures (its latencies kept, seconds, so that rounds can be pooled)."""
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "wall_s": wall, "requests": requests, "ttft": ttft,
            "tbt": tbt}


class BatchOne:
    """The batch-1 engine behind the same submit/result interface (one generation at a time, in the caller)."""

    def __init__(self, engine: Engine, new_tokens: int):
        self.engine, self.new_tokens, self.lock = engine, new_tokens, threading.Lock()

    def submit(self, prompt: str, sampling: SamplingParams | None = None):
        request = _Done()
        with self.lock:
            request.submitted = time.perf_counter()
            steps = []
            request.generation = self.engine.generate(prompt, max_new_tokens=self.new_tokens, stop_ids=(),
                                                      sampling=sampling, on_step=lambda
                                                      record: steps.append((time.perf_counter(),
                                                                            record.acceptance.accept_length)))
            request.arrivals = [(request.submitted + request.generation.stats.ttft_s, 1)] + steps
        return request


# onnxruntime-genai's Engine, in genai's venv: one closed loop per process, printed as one JSON line
GENAI_ENGINE_WORKER = r"""
import json, sys, time
import numpy as np, onnxruntime_genai as og

folder, job = sys.argv[1], json.loads(sys.argv[2])
prompts, clients, new = job["prompts"], job["clients"], job["new_tokens"]
config = og.Config(folder)
config.overlay(json.dumps({"engine": {"static_batching": {"max_batch_size": clients}}}))
engine = og.Engine(og.Model(config))
buffer = engine.create_event_buffer(256)
live, done = {}, []

def start(k):
    request = engine.create_request()
    turn = og.TurnOptions(request)
    turn.set_do_sample(False)
    turn.set_max_generated_tokens(new)
    turn.set_min_generated_tokens(new)
    live[id(request)] = {"request": request, "submitted": time.perf_counter(), "times": []}
    request.begin_turn(np.array(prompts[k % len(prompts)], np.int32), turn)

def drain():
    while live:
        events = engine.run(buffer)
        now = time.perf_counter()
        for event in events:
            record = live.get(id(event.request))
            if record is None:
                continue
            if event.flags & og.EngineEventFlags.FAILED:
                sys.exit(f"genai's request failed: {event.error_code}")
            if event.flags & og.EngineEventFlags.TOKEN:
                record["times"].append(now)
            if event.flags & og.EngineEventFlags.TURN_FINISHED:
                del live[id(event.request)]
                event.request.close()
                done.append(record)
                if todo:
                    start(todo.pop(0))

todo = []  # warm-up: one request first, as the other configurations had
start(0)
drain()
todo, done = list(range(clients * job["per_client"])), []
begin = time.perf_counter()
for _ in range(clients):
    start(todo.pop(0))
drain()
wall = time.perf_counter() - begin
print(json.dumps({"wall_s": wall, "tokens": sum(len(r["times"]) for r in done), "requests": len(done),
                  "ttft": [r["times"][0] - r["submitted"] for r in done],
                  "tbt": [b - a for r in done for a, b in zip(r["times"], r["times"][1:])]}), flush=True)
"""


def genai_closed_loop(python: Path, worker: Path, folder: Path, prompt_ids: list[list[int]], clients: int,
                      per_client: int, new_tokens: int) -> dict:
    """The same closed loop on onnxruntime-genai's Engine (GENAI_ENGINE_WORKER in its venv)."""
    job = {"prompts": prompt_ids, "clients": clients, "per_client": per_client, "new_tokens": new_tokens}
    done = subprocess.run([str(python), str(worker), str(folder), json.dumps(job)], stdout=subprocess.PIPE, text=True)
    if done.returncode:
        sys.exit(f"onnxruntime-genai's engine failed at C={clients} (exit {done.returncode}); its error is above")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    return loop_row(r["tokens"], r["wall_s"], r["requests"], r["ttft"], r["tbt"])


class _Done:
    def __init__(self):
        self.arrivals, self.generation = [], None

    def result(self, timeout=None):
        return self.generation


def prompt_texts(path) -> list[str]:
    """The prompts of a JSON-lines file (runtime.bench.read_prompts checks each line); a missing or malformed file
    ends the script with one line."""
    try:
        return [p["prompt"] for p in read_prompts(path)]
    except UserError as e:
        sys.exit(str(e))


def worker(job: dict) -> dict:
    """One closed loop of configuration job["config"] at C = job["clients"], in this process: its figures, and its
    scheduler's steps, rows, summed widths and time outside the graph calls."""
    engine = Engine.load(job["bundle"], threads=job["threads"])
    prompts = prompt_texts(job["prompts"])
    new, name = job["new_tokens"], job["config"]

    def sampling():
        return SamplingParams(job["temperature"], top_p=job["top_p"]) if job["temperature"] else None

    if name == "batch-1":
        engine.generate(prompts[0], max_new_tokens=8, stop_ids=())  # warm-up, untimed
        one = BatchOne(engine, new)
        return closed_loop(lambda prompt: one.submit(prompt, sampling()), prompts, job["clients"], job["per_client"])
    scheduler = Scheduler(engine, max_batch=job["max_batch"], plain=name.startswith("plain"), budget=name != "fixed")
    widths = [0]  # the widths of every target call, summed (Scheduler.on_step)
    scheduler.on_step = lambda n, width: widths.__setitem__(0, widths[0] + width)
    try:
        scheduler.submit(prompts[0], max_new_tokens=8, stop_ids=()).result(timeout=600)  # warm-up, untimed
        before = (scheduler.steps, scheduler.rows, scheduler.overhead_s, widths[0])
        row = closed_loop(lambda prompt: scheduler.submit(prompt, max_new_tokens=new, stop_ids=(), sampling=sampling()),
                          prompts, job["clients"], job["per_client"])
        row.update(steps=scheduler.steps - before[0], rows=scheduler.rows - before[1],
                   overhead_ms=1e3 * (scheduler.overhead_s - before[2]), width=widths[0] - before[3])
    finally:
        scheduler.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plain", type=Path, help="a plain-decoding bundle")
    ap.add_argument("--method", type=Path, default=None, help="a speculative bundle (its fixed tree)")
    ap.add_argument("--prompts", type=Path, default=Path("bench/sharegpt40.jsonl"))
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1,
                    help="closed loops per configuration and C, each round after the first in a shuffled order "
                         "(more than 1: plain runs twice a round, an A/A pair whose ratio shows the noise)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample every request (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--genai", type=Path, default=None, metavar="CACHE",
                    help="add onnxruntime-genai's og.Engine (its venv and models in CACHE, as bench_plain.py makes them)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # one closed loop (a job's JSON), in this process
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(json.loads(args.worker))), flush=True)
        return
    if args.plain is None:
        sys.exit("--plain is required")
    if args.rounds < 1 or args.requests < 1:
        sys.exit("--rounds and --requests must be >= 1")
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = prompt_texts(args.prompts)  # checked here, read again by each worker
    new = args.new_tokens
    genai = None
    if args.genai is not None and args.temperature:
        sys.exit("--genai compares greedy decoding only")
    if args.genai is not None:
        from bench_plain import ensure_genai  # this folder's script: genai's venv and model folders

        plain = Engine.load(args.plain, threads=args.threads)  # its precision and tokenizer; dropped before the runs
        precision = plain.bundle.precision if plain.bundle.precision in ("fp32", "int4") else "int4"
        python, folders = ensure_genai(args.genai, [precision])
        worker_file = args.genai / "genai_engine_worker.py"
        worker_file.write_text(GENAI_ENGINE_WORKER)
        genai = (python, worker_file, folders[precision], [plain.encode(p) for p in prompts])
        del plain
        print(f"genai: onnxruntime-genai's og.Engine, {precision} (static batching)", file=sys.stderr)
    configs = ["plain"] + (["fixed", "budget"] if args.method is not None else [])

    def one_run(name: str, c: int, r: int) -> dict:
        """One closed loop of configuration `name` at C = c, in a process of its own."""
        if name == "genai":
            row = genai_closed_loop(*genai[:3], genai[3], c, args.requests, new)
        else:
            bundle = args.plain if name in ("plain", "plain-again", "batch-1") else args.method
            job = {"bundle": str(bundle), "config": name, "clients": c, "per_client": args.requests,
                   "new_tokens": new, "temperature": args.temperature, "top_p": args.top_p, "threads": args.threads,
                   "prompts": str(args.prompts), "max_batch": max(levels)}
            done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], stdout=subprocess.PIPE,
                                  text=True)
            if done.returncode:
                sys.exit(f"{name} failed at C={c} (exit {done.returncode}); its error is above")
            row = json.loads(done.stdout.strip().splitlines()[-1])
        row.update(config=name, concurrency=c, round=r)
        print(f"  C={c:<3} round {r} {name:<12} {row['tokens_per_s']:7.1f} tok/s", file=sys.stderr, flush=True)
        return row

    runs = []  # one closed loop each: (config, C, round)
    for c in levels:
        names = (["batch-1"] if c == 1 else []) + configs + (["plain-again"] if args.rounds > 1 else []) \
            + (["genai"] if genai else [])
        for r in range(args.rounds):
            order = names if r == 0 else random.Random(f"{c}/{r}").sample(names, len(names))  # neighbours vary
            for name in order:
                runs.append(one_run(name, c, r))
    report(args, levels, runs, genai is not None)


def report(args, levels: list[int], runs: list[dict], genai: bool) -> None:
    how = f"temperature {args.temperature:g}, top-p {args.top_p:g}" if args.temperature else "greedy"
    print(f"{args.plain.name} vs {args.method.name if args.method else '-'}: closed loop, {args.requests} requests per "
          f"client, {args.new_tokens} new tokens each, {how}, {args.threads} threads, {args.rounds} round(s) per C")
    print(f"{'config':<12}{'C':>4}{'tokens/s':>10}{'rounds':>14}{'TTFT p50':>10}{'p99':>8}{'TBT p50':>9}{'p99':>8}"
          f"{'rows/call':>10}{'width':>7}{'host ms/step':>13}")
    summary, by = [], {}
    for c in levels:
        for name in dict.fromkeys(r["config"] for r in runs if r["concurrency"] == c):
            mine = [r for r in runs if r["config"] == name and r["concurrency"] == c]
            speeds = [r["tokens_per_s"] for r in mine]
            ttft, tbt = [t for r in mine for t in r["ttft"]], [t for r in mine for t in r["tbt"]]
            steps = sum(r.get("steps", 0) for r in mine)
            row = {"config": name, "concurrency": c, "tokens_per_s": float(np.median(speeds)),
                   "tokens_per_s_rounds": speeds, "ttft_p50_ms": 1e3 * pct(ttft, 50), "ttft_p99_ms": 1e3 * pct(ttft, 99),
                   "tbt_p50_ms": 1e3 * pct(tbt, 50), "tbt_p99_ms": 1e3 * pct(tbt, 99)}
            if steps:
                row.update({key: sum(r[key] for r in mine) / steps for key in ("rows", "width", "overhead_ms")})
            summary.append(row)
            by[(name, c)] = row["tokens_per_s"]
            spread = f"{min(speeds):.0f}-{max(speeds):.0f}" if len(speeds) > 1 else ""
            print(f"{name:<12}{c:>4}{row['tokens_per_s']:>10.1f}{spread:>14}{row['ttft_p50_ms']:>10.0f}"
                  f"{row['ttft_p99_ms']:>8.0f}{row['tbt_p50_ms']:>9.1f}{row['tbt_p99_ms']:>8.1f}"
                  f"{row.get('rows', 1):>10.1f}{row.get('width', 1):>7.1f}{row.get('overhead_ms', float('nan')):>13.2f}")
    if ("plain", 1) in by and ("plain", max(levels)) in by:
        print(f"plain batched C={max(levels)} / C=1: {by[('plain', max(levels))] / by[('plain', 1)]:.2f}x (target >= 3x)")
    if ("batch-1", 1) in by:
        print(f"plain batched C=1 / batch-1 engine: {by[('plain', 1)] / by[('batch-1', 1)]:.2f}x")
    if genai:
        print("plain batched / onnxruntime-genai's og.Engine, per C: " + ", ".join(
            f"C={c} {by[('plain', c)] / by[('genai', c)]:.2f}x" for c in levels))
    if args.method is not None:
        print("budget / the better of plain and fixed, per C: " + paired(runs, levels, "budget", ("plain", "fixed")))
    if args.rounds > 1:
        print("plain / plain again (A/A: the noise of such a ratio here), per C: "
              + paired(runs, levels, "plain-again", ("plain",)))
    if args.json:
        strip = [{k: v for k, v in r.items() if k not in ("ttft", "tbt")} for r in runs]
        args.json.write_text(json.dumps({"summary": summary, "runs": strip}, indent=1))


def paired(runs: list[dict], levels: list[int], name: str, against: tuple[str, ...]) -> str:
    """Per C: the median over rounds of `name`'s tokens/s over the best of `against` in the same round (and the
    rounds' lowest and highest)."""
    parts = []
    for c in levels:
        speed = {(r["config"], r["round"]): r["tokens_per_s"] for r in runs if r["concurrency"] == c}
        rounds = sorted({r for _, r in speed})
        ratios = [speed[(name, r)] / max(speed[(a, r)] for a in against) for r in rounds]
        parts.append(f"C={c} {np.median(ratios):.2f}x" + (f" ({min(ratios):.2f}-{max(ratios):.2f})"
                                                           if len(ratios) > 1 else ""))
    return ", ".join(parts)


if __name__ == "__main__":
    main()
