"""The model-family table of docs/families.md: every family's tiny random model (tests/test_families.py's configs)
in each flavour: built or refused (the line), fp32 max |logit diff| against transformers on validation's cases
(prompts longer than every window), and the int8 and int4 graphs' top-1 agreement with the fp32 transformers model
on the same cases.

    python benchmarks/families.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import numpy as np  # noqa: E402
from test_families import FAMILIES, MAX_CONTEXT, model  # noqa: E402

from specexport.errors import UserError  # noqa: E402
from specexport.exporter import validate  # noqa: E402
from specexport.exporter.graph import GraphOptions  # noqa: E402
from specexport.exporter.save import write_graph  # noqa: E402
from specexport.runtime.backends.host import GraphSession  # noqa: E402


def measure(kind: str, **graph) -> dict | str:
    """validate.compare's worst diff and mean top-1, or the refusal's line."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            info = write_graph(model(kind), "target", GraphOptions(**graph), MAX_CONTEXT, Path(tmp), quiet=True)
        except UserError as e:
            return str(e)
        s = GraphSession(Path(tmp) / info["file"], info, threads=1, device="cpu")
        report = validate.compare(model(kind), s, max_context=MAX_CONTEXT)
    return {"diff": max(c["max_abs_diff"] for c in report.values()),
            "top1": float(np.mean([c["top1_agreement"] for c in report.values()]))}


def main() -> None:
    print("| family (tiny model) | ort fp32 | onnx fp32 | trt fp32 | int8 top-1 (ort) | int4 top-1 (ort) |")
    print("|---|---|---|---|---|---|")
    for kind, (model_type, _) in FAMILIES.items():
        cells = []
        for flavour in ("ort", "onnx", "trt"):
            r = measure(kind, flavour=flavour)
            cells.append(f"refused: {r}" if isinstance(r, str) else f"{r['diff']:.1e}")
        for precision in ("int8", "int4"):
            r = measure(kind, precision=precision)
            cells.append(r if isinstance(r, str) else f"{100 * r['top1']:.0f}%")
        print(f"| {kind} (`{model_type}`) | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
