"""What a reduced draft vocabulary saves: one EAGLE-3 draft step (ms) with the full vocabulary vs a reduced one,
next to one target step, on this machine. Random weights (the cost does not depend on them).

    .venv/bin/python benchmarks/draft_vocab_cost.py [--model smollm2-135m] [--precision int8] [--sizes 49152,8192,4096]
"""

import argparse
import tempfile
from pathlib import Path

import numpy as np

from specexport.exporter import sources
from specexport.exporter.arch import dims_from_config
from specexport.exporter.eagle import default_aux_layers
from specexport.exporter.export import optimize_graph
from specexport.exporter.graph import GraphOptions
from specexport.exporter.methods.eagle import write_draft_graph
from specexport.runtime import tree
from specexport.runtime.backends.host import GraphSession
from specexport.train.eagle import init_draft
from specexport.tune.measure import median_ms


def main():

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--precision", default="int8")
    ap.add_argument("--sizes", default="49152,8192,4096")
    ap.add_argument("--context", type=int, default=200)
    args = ap.parse_args()
    model, _ = sources.load_model(sources.resolve(args.model))
    dims = dims_from_config(model.config)
    graph = GraphOptions(precision=args.precision)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for size in [int(s) for s in args.sizes.split(",")]:
            hot = np.arange(dims.vocab) if size >= dims.vocab else np.sort(np.random.default_rng(0).choice(dims.vocab, size, replace=False))
            draft = init_draft(model, 3, default_aux_layers(dims.layers), hot)
            folder = Path(tmp) / str(size)
            folder.mkdir()
            info = write_draft_graph(model, draft, graph, 4096, folder)
            optimize_graph(folder, info)
            session = GraphSession(folder / info["file"], info)
            cache = session.new_cache(args.context + 16)
            cache.advance(args.context)
            for t in (1, 4):
                call = lambda: session.forward(cache, np.zeros((1, t), np.int64), (args.context + np.arange(t))[None],
                                               tree.causal_mask(t), np.arange(t), want=("hidden_out", "draft_logp", "draft_tokens"),
                                               inputs={"hidden": np.zeros((1, t, dims.hidden), np.float32)})
                rows.append((size, t, median_ms(call, 50)))
    print(f"{args.model} {args.precision}, context {args.context}: one EAGLE-3 draft call (median ms)")
    for size, t, ms in rows:
        print(f"  draft vocabulary {size:>6}  {t} node(s): {ms:6.2f} ms")


if __name__ == "__main__":
    main()
