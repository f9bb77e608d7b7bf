"""The profile report: Markdown with the measured tables, and PNG plots (matplotlib, headless). Reports name the
bundle and the hardware, never a path on the machine that made them."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import numpy as np

from specexport.tune.measure import errors

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the headless backend)


def plots(measured, folder: Path) -> list[str]:
    """latency.png, accept_lengths.png and predicted_vs_measured.png in `folder`; returns their names."""
    names = []
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for context, curve in measured.verify_ms.items():
        ax.plot(measured.tree_tokens, curve, marker="o", label=f"context {context} tokens")
    ax.set_xlabel("tokens verified per step (tree size, root included)")
    ax.set_ylabel("verification step latency (ms)")
    ax.set_title("Target verification latency vs tree tokens")
    ax.grid(alpha=0.3)
    ax.legend()
    names.append(_save(fig, folder / "latency.png"))

    chosen = measured.chosen or {}
    lengths = chosen.get("accept_lengths") or measured.calibration.get("accept_lengths", [])
    if lengths:
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        values, counts = np.unique(lengths, return_counts=True)
        ax.bar(values, counts / counts.sum() * 100, color="tab:blue",
               label=f"{chosen.get('tree', 'calibration')} (tau {np.mean(lengths):.2f})")
        ax.set_xlabel("accept length (tokens emitted per step, bonus included)")
        ax.set_ylabel("share of steps (%)")
        ax.set_title("Accept-length histogram")
        ax.set_xticks(values)
        ax.legend()
        names.append(_save(fig, folder / "accept_lengths.png"))

    rows = [r for r in measured.candidates if "measured_tokens_per_s" in r]
    if rows:
        rows = sorted(rows, key=lambda r: r["tokens"])
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        x = np.arange(len(rows))
        ax.bar(x - 0.27, [r["predicted_tokens_per_s"] for r in rows], 0.27, label="predicted", color="tab:gray")
        ax.bar(x, [r.get("anchored_tokens_per_s", 0) for r in rows], 0.27, label="predicted at the run's plain rate",
               color="tab:olive")
        ax.bar(x + 0.27, [r["measured_tokens_per_s"] for r in rows], 0.27, label="measured", color="tab:green")
        if measured.calibration.get("plain_tokens_per_s"):
            ax.axhline(measured.calibration["plain_tokens_per_s"], color="tab:red", linestyle="--",
                       label="plain decoding")
        ax.set_xticks(x, [r.get("short") or f"{r['tree']}\n({r['tokens']} tok)" for r in rows], fontsize=8)
        ax.set_xlabel("tree")
        ax.set_ylabel("tokens/s")
        ax.set_title("Predicted vs measured tokens/s")
        top = max(max(r["predicted_tokens_per_s"], r.get("anchored_tokens_per_s", 0), r["measured_tokens_per_s"])
                  for r in rows)
        ax.set_ylim(0, top * 1.3)  # room above the bars for the legend
        ax.legend(loc="upper center", ncol=2, fontsize=7)
        names.append(_save(fig, folder / "predicted_vs_measured.png"))
    return names


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def markdown(measured, meta: dict, images: list[str]) -> str:
    out = [f"# Profile of {meta['bundle']} on {meta['hardware']}", "",
           f"- model {meta['model']}, {meta['precision']}, method {meta['method']}; {meta['prompts']} calibration "
           f"prompts, {meta['new_tokens']} new tokens each, greedy",
           f"- per-step time outside the target call: {measured.overhead_ms:.2f} ms",
           "- tokens/s are decode rates: tokens after the first over the time after the first token"]
    if measured.draft_ms:
        out.append("- EAGLE draft call (ms by nodes fed): "
                   + ", ".join(f"{t}: {ms:.2f}" for t, ms in measured.draft_ms.items()))
    if measured.heads_ms:
        out.append(f"- Medusa heads on one row (their stand-alone graph; inside the fused step and its latency curve): "
                   f"{measured.heads_ms:.2f} ms")
    if measured.calibration.get("plain_tokens_per_s"):
        out.append(f"- plain decoding: {measured.calibration['plain_tokens_per_s']:.1f} tokens/s (decode rate)")
    out += ["", "## Verification latency (ms)", ""]
    if measured.candidates:
        out += ["The last column is at the calibration's typical context, measured before and after the side-by-side "
                "runs (their mean); the predictions use it.", ""]
    out += ["| tree tokens | " + " | ".join(f"context {c}" for c in measured.context) + " |",
            "|---|" + "---|" * len(measured.context)]
    for i, t in enumerate(measured.tree_tokens):
        out.append(f"| {t} | " + " | ".join(f"{measured.verify_ms[c][i]:.2f}" for c in measured.context) + " |")
    if measured.batch_ms:
        out += ["", "## Batched verification latency (ms)", "",
                f"One call of the batched engine: n sequences, each a chain of W tokens after {measured.batch_context} "
                "tokens of its own context (the tree budget of the batched engine reads this table).", "",
                "| sequences | " + " | ".join(f"W={w}" for w in measured.batch_widths) + " |",
                "|---|" + "---|" * len(measured.batch_widths)]
        for n, row in zip(measured.batch_sequences, measured.batch_ms):
            out.append(f"| {n} | " + " | ".join(f"{ms:.2f}" for ms in row) + " |")
        if measured.batch_single_ms:
            out += ["", "The same calls with one real row a sequence, the rest padding (the graph takes ragged rows: "
                    "it computes the real rows, attention runs on the padded width):", "",
                    "| sequences | " + " | ".join(f"W={w}" for w in measured.batch_widths) + " |",
                    "|---|" + "---|" * len(measured.batch_widths)]
            for n, row in zip(measured.batch_sequences, measured.batch_single_ms):
                out.append(f"| {n} | " + " | ".join(f"{ms:.2f}" for ms in row) + " |")
    if measured.rank_rates:
        out += ["", "## Medusa candidate accuracy on the calibration prompts", "",
                "| head | " + " | ".join(f"rank {r}" for r in range(len(measured.rank_rates[0]))) + " |",
                "|---|" + "---|" * len(measured.rank_rates[0])]
        for d, row in enumerate(measured.rank_rates):
            out.append(f"| {d} | " + " | ".join(f"{x:.3f}" for x in row) + " |")
    rows = [r for r in measured.candidates if "measured_tokens_per_s" in r]
    if rows:
        out += ["", "## Trees side by side", "",
                "Predicted from the latency curve and the accept lengths replayed on the calibration steps. The "
                "machine's speed drifts between the curve and the runs, so the prediction is also given at the "
                "plain-decoding rate measured side by side (predicted speedup x that rate); errors are against "
                "the measured tokens/s.", "",
                "| tree | tokens | depth | expected tau | measured tau | predicted tok/s | at the run's plain rate | "
                "measured tok/s | error | error at plain rate | speedup predicted / measured |",
                "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in sorted(rows, key=lambda r: -r["measured_tokens_per_s"]):
            curve, anchored = errors(r)
            out.append(f"| {r['tree']} | {r['tokens']} | {r['depth']} | {r['expected_tau']:.2f} | {r['measured_tau']:.2f} "
                       f"| {r['predicted_tokens_per_s']:.1f} | {r.get('anchored_tokens_per_s', 0):.1f} "
                       f"| {r['measured_tokens_per_s']:.1f} | {curve:+.1f}% | {anchored:+.1f}% "
                       f"| {r.get('predicted_speedup', 0):.2f}x / {r.get('measured_speedup', 0):.2f}x |")
    if measured.chosen:
        c = measured.chosen
        out += ["", f"Chosen: **{c['tree']}** ({c['tokens']} tokens, depth {c['depth']}): predicted "
                    f"{c['predicted_tokens_per_s']:.1f} tokens/s, measured {c.get('measured_tokens_per_s', 0):.1f}.",
                "", "The settings the profile records:", "", "```json", json.dumps(c["settings"]), "```"]
    out += [""] + [f"![{Path(name).stem}]({name})" for name in images]
    return "\n".join(out) + "\n"
