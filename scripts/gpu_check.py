"""The Python half of scripts/gpu_check.sh: the prompt subset, the CPU fp32 reference tokens, and the report.

    python scripts/gpu_check.py prompts BENCH_DIR OUT.jsonl --per-file K
    python scripts/gpu_check.py reference BUNDLE PROMPTS.jsonl OUT.json [--new-tokens N] [--threads N]
    python scripts/gpu_check.py report --gpu NAME --driver VERSION --reference REF.json --output report.md
                                       [--profile FILE] [--note TEXT ...] [--elapsed S] BENCH.json ...

Every name in the report is a bundle's folder name or a file in the check's own folder, never a machine path.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from specexport.runtime.bench import encode_prompts, read_prompts
from specexport.runtime.generate import Engine


def take_prompts(bench: Path, out: Path, per_file: int) -> int:
    """The first `per_file` prompts of each benchmarks/prompts/*.jsonl, ids prefixed by the file's name."""
    rows = []
    for path in sorted(bench.glob("*.jsonl")):
        for row in read_prompts(path)[:per_file]:
            rows.append({"id": f"{path.stem}:{row['id']}", "prompt": row["prompt"]})
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def reference(bundle: Path, prompts: Path, out: Path, new_tokens: int, threads: int | None) -> None:
    """Plain greedy decoding on the CPU: the tokens every GPU bundle should reproduce."""
    engine = Engine.load(bundle, threads=threads, device="cpu")
    rows = read_prompts(prompts)
    ids = encode_prompts(engine, rows)
    tokens = [engine.generate(p, max_new_tokens=new_tokens, plain=True).tokens for p in ids]
    out.write_text(json.dumps({"bundle": bundle.name, "new_tokens": new_tokens,
                               "prompts": [{"id": r["id"], "tokens": t} for r, t in zip(rows, tokens)]}))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists part (the shorter one's length if one is a prefix), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def versions() -> str:
    found = []
    for module in ("tensorrt", "onnxruntime", "triton"):
        try:
            m = importlib.import_module(module)
        except ImportError:
            found.append(f"{module} not installed")
            continue
        extra = ""
        if module == "onnxruntime":
            extra = " (" + ", ".join(p for p in m.get_available_providers() if p != "CPUExecutionProvider") + ")"
        found.append(f"{module} {m.__version__}{extra}")
    return "; ".join(found)


def report(args) -> None:
    ref = json.loads(Path(args.reference).read_text())
    want = {p["id"]: p["tokens"] for p in ref["prompts"]}
    lines = [f"# GPU check: {args.gpu}", "",
             f"Hardware: {args.gpu}, driver {args.driver}. Software: {versions()}.", "",
             f"Reference: `{ref['bundle']}` (ONNX Runtime on the CPU, fp32), plain greedy decoding of "
             f"{len(want)} prompts (the first ones of each benchmarks/prompts/*.jsonl), up to {ref['new_tokens']} new "
             "tokens each.",
             "", "| bundle | method | identical to CPU fp32: method / plain | tokens/s | plain tokens/s | speedup "
             "| tau |", "|---|---|---|---|---|---|---|"]
    parted = []
    for path in args.bench:
        result = json.loads(Path(path).read_text())
        rows = {r["id"]: r for r in result["prompts"]}
        same = [sum(first_difference(rows[i][key], want[i]) is None for i in want)
                for key in ("tokens", "baseline_tokens")]
        lines.append(f"| `{result['bundle']}` | {result['method']} | {same[0]}/{len(want)} / {same[1]}/{len(want)} | "
                     f"{result['tokens_per_s']} | {result['baseline_tokens_per_s']} | {result['speedup']}x | "
                     f"{result['tau']} |")
        for i in want:
            at = [first_difference(rows[i][key], want[i]) for key in ("tokens", "baseline_tokens")]
            if at != [None, None]:
                parted.append(f"- `{result['bundle']}` {i}: method parts at token {at[0]}, plain at token {at[1]}"
                              if at[0] != at[1] else f"- `{result['bundle']}` {i}: parts at token {at[0]}")
    lines += ["", "## Where the outputs part from the CPU fp32 reference", "",
              "fp16 may choose the other token where the top two logits are nearly tied; the position is the first "
              "differing new token (None: identical).", ""] + (parted or ["- nowhere"])
    if args.profile:
        lines += ["", "## Measured profile", "",
                  f"`{args.profile}`: the verification latency curve and the settings measured on this GPU "
                  "(`specexport profile`), with each method's report in `profile-METHOD-report/report.md`."]
    if args.note:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in args.note]
    if args.elapsed is not None:
        lines += ["", f"Elapsed: {args.elapsed} s for the whole check."]
    Path(args.output).write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prompts")
    p.add_argument("bench", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--per-file", type=int, default=6)
    r = sub.add_parser("reference")
    r.add_argument("bundle", type=Path)
    r.add_argument("prompts", type=Path)
    r.add_argument("out", type=Path)
    r.add_argument("--new-tokens", type=int, default=64)
    r.add_argument("--threads", type=int)
    w = sub.add_parser("report")
    w.add_argument("bench", nargs="*")
    w.add_argument("--gpu", required=True)
    w.add_argument("--driver", default="unknown")
    w.add_argument("--reference", required=True)
    w.add_argument("--output", required=True)
    w.add_argument("--profile")
    w.add_argument("--note", action="append", default=[])
    w.add_argument("--elapsed", type=int)
    args = parser.parse_args()
    if args.command == "prompts":
        print(take_prompts(args.bench, args.out, args.per_file))
    elif args.command == "reference":
        reference(args.bundle, args.prompts, args.out, args.new_tokens, args.threads)
    else:
        report(args)


if __name__ == "__main__":
    main()
