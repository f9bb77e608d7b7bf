#!/usr/bin/env python
"""Does a mixture of experts cost what its routed experts cost? Step time of Mixtral-shaped target graphs (random
weights) with top-2 of 8 and top-2 of 64 experts of equal size, beside a dense model of the same active size (an
MLP as wide as two experts), at T = 1 and T = 16 new tokens; their step times alternate in one run.

    python benchmarks/moe_step.py [--precision int4] [--hidden 512] [--expert 768] [--layers 2] [--steps 200]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import transformers  # noqa: E402
from profile_step import Step  # noqa: E402

from specexport.exporter.graph import GraphOptions  # noqa: E402
from specexport.exporter.save import write_graph  # noqa: E402

CONTEXT = 256


def model(args, experts: int):
    """A random Mixtral (or, with experts 0, a Mistral whose MLP is two experts wide) with unit-spread weights."""
    common = dict(vocab_size=2048, hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=64, max_position_embeddings=1024)
    if experts:
        config = transformers.MixtralConfig(**common, intermediate_size=args.expert, num_local_experts=experts,
                                            num_experts_per_tok=2)
    else:
        config = transformers.MistralConfig(**common, intermediate_size=2 * args.expert)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--precision", default="int4", choices=["fp32", "int8", "int4"])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--expert", type=int, default=768, help="each expert's intermediate size")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    args = ap.parse_args()
    names = {0: "dense, 2 experts wide", 8: "top-2 of 8 experts", 64: "top-2 of 64 experts"}
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for experts in names:
            folder = Path(tmp) / str(experts)
            folder.mkdir()
            graph = GraphOptions(precision=args.precision, chain_only=True)
            info = write_graph(model(args, experts), "target", graph, 1024, folder, quiet=True)
            files[experts] = folder / info["file"]
        print(f"{args.precision}, hidden {args.hidden}, experts of {args.expert}, {args.layers} layers, {CONTEXT} "
              f"context, {args.threads} threads; median step ms over {args.rounds} alternating blocks")
        print("| graph | T=1 | T=16 |\n|---|---|---|")
        ms = {}
        for t in (1, 16):
            steps = {e: Step(f, CONTEXT, CONTEXT + 64, args.threads, profile=False) for e, f in files.items()}
            times = {e: [] for e in steps}
            block = max(1, args.steps // args.rounds)
            for r in range(args.rounds):
                for e in (list(steps) if r % 2 == 0 else list(reversed(steps))):
                    for _ in range(5):
                        steps[e].call(t)
                    times[e] += [1000 * steps[e].call(t) for _ in range(block)]
            for e in steps:
                ms[e, t] = statistics.median(times[e])
        for e, name in names.items():
            print(f"| {name} | {ms[e, 1]:.2f} | {ms[e, 16]:.2f} |")
        print(f"64 experts / 8 experts: T=1 {ms[64, 1] / ms[8, 1]:.2f}x, T=16 {ms[64, 16] / ms[8, 16]:.2f}x")


if __name__ == "__main__":
    main()
