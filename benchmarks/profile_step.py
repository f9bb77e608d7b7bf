#!/usr/bin/env python
"""Where a decoder step spends its time: ONNX Runtime's profiler over repeated forwards of T new tokens at a fixed
context, on one of our bundles' target graphs or on an onnxruntime-genai model folder, the op types ranked by time.

Standalone (numpy and onnxruntime only), so it runs in genai's own venv as well as ours. The KV cache is one buffer
per layer bound as both past and present (as both runtimes do), the context rows already written.

    python benchmarks/profile_step.py GRAPH_OR_FOLDER [--t 1] [--context 256] [--steps 200] [--threads 2] [--top 15]
                                   [--json OUT]

GRAPH_OR_FOLDER: a bundle (its target graph is profiled), a .onnx file, or a genai model folder (genai_config.json).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import onnxruntime as ort

from specexport.runtime import kernels

_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int32)": np.int32,
          "tensor(int64)": np.int64, "tensor(bool)": np.bool_}


def graph_file(path: Path) -> tuple[Path, dict]:
    """The step graph of a bundle (with its manifest entry), of an onnxruntime-genai folder, or a graph file."""
    if path.is_file():
        return path, {}
    if (path / "genai_config.json").is_file():
        return path / json.loads((path / "genai_config.json").read_text())["model"]["decoder"]["filename"], {}
    info = json.loads((path / "manifest.json").read_text())["graphs"]["target"]
    return path / info["file"], info


class Step:
    """A session over a step graph with its KV buffers bound in place; call(t) runs one forward of t tokens."""

    def __init__(self, file: Path, context: int, capacity: int, threads: int, profile: bool, info: dict):
        so = ort.SessionOptions()
        if info.get("kernels"):  # specexport's own (--int4-rows)
            so.register_custom_ops_library(str(kernels.library()))
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.add_session_config_entry("session.intra_op.allow_spinning", "1")
        if profile:
            so.enable_profiling = True
            so.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "step")
        self.session = ort.InferenceSession(str(file), so, providers=["CPUExecutionProvider"])
        self.inputs = {i.name: i for i in self.session.get_inputs()}
        self.context = context
        self.io = self.session.io_binding()
        self.keep = []
        for name, info in self.inputs.items():
            if name.startswith("past_key_values."):
                batch, heads, rows, head_dim = info.shape  # genai names its head size "kv_cache_dim"
                head_dim = head_dim if isinstance(head_dim, int) else self.head_dim(file)
                shape = (1, heads, rows if isinstance(rows, int) else capacity, head_dim)
                buf = np.zeros(shape, _TYPES[info.type])
                self.keep.append(ort.OrtValue.ortvalue_from_numpy(buf))
                self.io.bind_ortvalue_input(name, self.keep[-1])
                self.io.bind_ortvalue_output(name.replace("past_key_values.", "present."), self.keep[-1])
        self.rng = np.random.default_rng(0)

    @staticmethod
    def head_dim(file: Path) -> int:
        config = json.loads((file.parent / "genai_config.json").read_text())
        return config["model"]["decoder"]["head_size"]

    def call(self, t: int) -> float:
        past, io, names = self.context, self.io, self.inputs
        io.bind_cpu_input("input_ids", self.rng.integers(3, 1000, size=(1, t)).astype(np.int64))
        if "position_ids" in names:
            io.bind_cpu_input("position_ids", (past + np.arange(t, dtype=np.int64))[None])
        if "tree_mask" in names:  # ours: the step's ancestor mask (a chain) and the past length
            io.bind_cpu_input("tree_mask", np.tril(np.ones((t, t), np.bool_))[None])
            io.bind_cpu_input("past_len", np.array([past], np.int32))
            io.bind_cpu_input("logits_indices", np.arange(t, dtype=np.int64))
        if "live_rows" in names:  # ours, ragged rows: every row real
            io.bind_cpu_input("live_rows", np.arange(t, dtype=np.int64))
            io.bind_cpu_input("padded_rows", np.arange(t, dtype=np.int64)[None])
        if "attention_mask" in names:  # genai's: ones over past + new
            io.bind_cpu_input("attention_mask", np.ones((1, past + t), _TYPES[names["attention_mask"].type]))
        if "sample_u" in names:  # ours with the fused acceptance: its greedy inputs
            io.bind_cpu_input("sample_u", np.zeros((t, 1), np.float32))
            io.bind_cpu_input("sample_q", np.zeros((0, 0), np.float32))
            io.bind_cpu_input("sample_params", np.array([0, 0, 1, 0], np.float32))
        io.bind_output("logits", "cpu")
        start = time.perf_counter()
        self.session.run_with_iobinding(io)
        return time.perf_counter() - start


def op_table(profile_file: str, skip_runs: int) -> tuple[dict, int]:
    """Microseconds per op type summed over the profiled runs after the first `skip_runs`, and the runs counted."""
    events = json.loads(Path(profile_file).read_text())
    runs = [e for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    if len(runs) <= skip_runs:
        raise SystemExit("too few profiled runs")
    since = runs[skip_runs]["ts"]
    per_op = defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time") and e["ts"] >= since:
            per_op[e["args"]["op_name"]] += e["dur"]
    return per_op, len(runs) - skip_runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", type=Path, nargs="+", help="graphs to compare (their step times alternate)")
    ap.add_argument("--t", type=int, default=1, help="new tokens per forward")
    ap.add_argument("--context", type=int, default=256, help="rows of context already in the cache")
    ap.add_argument("--steps", type=int, default=200, help="timed and profiled forwards per graph")
    ap.add_argument("--rounds", type=int, default=5, help="the timed forwards come in this many alternating blocks")
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--no-profile", action="store_true", help="step times only")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    capacity = args.context + args.t + 64
    files = [graph_file(p) for p in args.paths]

    steps = [Step(f, args.context, capacity, args.threads, False, i) for f, i in files]  # without the profiler
    ms = [[] for _ in steps]
    block = max(1, args.steps // args.rounds)
    for r in range(args.rounds):
        for k in (range(len(steps)) if r % 2 == 0 else reversed(range(len(steps)))):
            for _ in range(10):  # warm the pool after the other graph ran
                steps[k].call(args.t)
            ms[k] += [1000 * steps[k].call(args.t) for _ in range(block)]
    del steps
    report = {}
    for path, (file, info), times in zip(args.paths, files, ms):
        entry = report[path.name] = {"step_ms_median": statistics.median(times)}
        print(f"{path.name}: T={args.t} at {args.context} context, {args.threads} threads: step "
              f"{statistics.median(times):.2f} ms median (p10 {np.percentile(times, 10):.2f}, "
              f"p90 {np.percentile(times, 90):.2f}; {args.rounds} alternating blocks)")
        if args.no_profile:
            continue
        prof = Step(file, args.context, capacity, args.threads, profile=True, info=info)
        for _ in range(20 + args.steps):
            prof.call(args.t)
        per_op, runs = op_table(prof.session.end_profiling(), 20)
        total = sum(per_op.values())
        rows = sorted(per_op.items(), key=lambda kv: -kv[1])
        entry["ops_ms"] = {op: us / runs / 1000 for op, us in rows}
        print(f"  kernels {total / runs / 1000:.2f} ms per step under the profiler\n  {'op':<34}{'ms/step':>9}{'share':>8}")
        for op, us in rows[:args.top]:
            print(f"  {op:<34}{us / runs / 1000:>9.3f}{us / total:>8.1%}")
    if args.json:
        args.json.write_text(json.dumps({"t": args.t, "context": args.context, "graphs": report}, indent=1))


if __name__ == "__main__":
    main()
