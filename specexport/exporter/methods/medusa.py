"""Medusa at export time: the heads (shipped for the model, or any published layout) are checked against the
target, fused into the target graph at the accepted row (verify, accept and propose in one call), and also
written as a stand-alone heads graph for sampling outside the graph."""

from __future__ import annotations

from dataclasses import dataclass, replace

from specexport.exporter import validate
from specexport.exporter.graph import GraphOptions
from specexport.exporter.medusa import load_heads
from specexport.exporter.medusa_graph import HeadsAtAcceptedRow, build_heads_graph
from specexport.exporter.methods.plan import ExportMethod, Plan, Target, proposer_folder
from specexport.exporter.save import ExportContext, decoder_builder, save_graph
from specexport.options import setting
from specexport.runtime.backends.host import GraphSession
from specexport.runtime.methods import medusa

TOP_K = 10  # candidates per head in the graph: any tree with ranks < 10 runs on the bundle


class MedusaPlan(Plan):
    extra_graphs = 1

    def __init__(self, options: Options, settings: medusa.Settings, target: Target):
        super().__init__(options, settings, target)
        self.where = proposer_folder(options.heads, "medusa", target, "Medusa heads", "--heads",
                                     "published heads, or train them with specexport train --method medusa --model ...")
        self.heads = load_heads(self.where)
        self.heads.check(target.dims.hidden, target.dims.vocab, str(self.where))
        section = {"heads_count": self.heads.count, "top_k": TOP_K, "accuracy": self.heads.meta.get("accuracy")}
        self.tree = medusa.Medusa.resolve(settings, section)  # a bad tree fails before any work

    def graph_options(self, graph: GraphOptions) -> GraphOptions:
        return replace(graph, fused_accept=True)

    def extensions(self) -> tuple:
        return (HeadsAtAcceptedRow(self.heads, TOP_K),)

    def write_graphs(self, ctx: ExportContext) -> dict[str, dict]:
        ctx.step(f"building the Medusa heads graph ({self.heads.count} {self.heads.style}-LM-head heads, for sampling)")
        builder = decoder_builder(ctx.checkpoint, self.graph_options(ctx.graph), ctx.max_context)
        proto = build_heads_graph(builder, self.heads, TOP_K)
        return {"medusa_heads": save_graph(proto, "medusa_heads", builder.opt, builder.d, ctx.folder)}

    def validate(self, ctx: ExportContext, graphs: dict[str, dict]) -> dict:
        """The fused step (accept + heads) and the heads graph against the PyTorch reference, on three trees."""
        target = GraphSession(ctx.folder / graphs["target"]["file"], graphs["target"])
        alone = GraphSession(ctx.folder / graphs["medusa_heads"]["file"], graphs["medusa_heads"], spin=False)
        runs = [validate.medusa_step(ctx.reference, target, alone.session, self.heads, seed) for seed in range(3)]
        return {"medusa": {"runs": runs, "path_match": all(r["path_match"] for r in runs),
                           "bonus_match": all(r["bonus_match"] for r in runs)}}

    def manifest(self) -> dict:
        h = self.heads
        return {"tree_spec": self.settings.tree, "tree": self.tree.as_lists(), "heads": self.where.resolve().name,
                "heads_count": h.count, "heads_layers": h.layers, "head_style": h.style, "top_k": TOP_K,
                "accuracy": h.meta.get("accuracy")}


@dataclass(frozen=True)
class Options:
    heads: str | None = setting(None, "medusa: heads folder or file, any published layout (default: the heads "
                                      "shipped for the model).")


METHOD = ExportMethod(Options, medusa.METHOD, MedusaPlan)
