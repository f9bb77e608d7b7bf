"""DFlash at export time: a published block draft (z-lab's layout) is checked against the target, becomes its own
graph with its own cache of context rows, and the target graph returns the context feature it reads (fc and
hidden_norm over the target layers' inputs, computed in the target graph)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from specexport.errors import UserError
from specexport.exporter import families, validate
from specexport.exporter.arch import dims_from_config, rope_rows
from specexport.exporter.dflash import load_dflash
from specexport.exporter.dflash_graph import (
    DFLASH_TOP_K,
    DFlashContext,
    build_draft_graph,
    draft_dims,
    draft_weights,
    rope_for,
)
from specexport.exporter.graph import DecoderGraphBuilder, GraphOptions
from specexport.exporter.methods.plan import ExportMethod, Plan, Target, proposer_folder, settings_dict
from specexport.exporter.save import ExportContext, save_graph
from specexport.options import setting
from specexport.runtime.backends.host import GraphSession
from specexport.runtime.methods import dflash


class DFlashPlan(Plan):
    extra_graphs = 1

    def __init__(self, options: Options, settings: dflash.Settings, target: Target):
        super().__init__(options, settings, target)
        self.where = proposer_folder(options.draft, "dflash", target, "DFlash draft", "--draft", "a DFlash draft "
                                     "folder in z-lab's or speculators' layout, or train one with specexport train "
                                     "--method dflash --model ...")
        self.draft = load_dflash(self.where, target.dims.layers)
        self.draft.check(target.dims, str(self.where))
        c = self.draft.config
        if c.draft_vocab and c.draft_vocab < DFLASH_TOP_K:
            raise UserError(f"{self.where}: a draft vocabulary of {c.draft_vocab} tokens; the draft graph returns the "
                            f"top {DFLASH_TOP_K}")
        depth, _, total = dflash.resolved(settings, c.block, DFLASH_TOP_K)  # bad settings fail before any work
        self.settings = replace(settings, depth=depth, total_tokens=total)

    def graph_options(self, graph: GraphOptions) -> GraphOptions:
        aux = tuple(sorted(set(graph.aux_layers) | set(self.draft.config.target_layers)))
        return replace(graph, fused_accept=True, aux_layers=aux)

    def extensions(self) -> tuple:
        return (DFlashContext(self.draft),)

    def write_graphs(self, ctx: ExportContext) -> dict[str, dict]:
        c = self.draft.config
        ctx.step(f"building the DFlash draft graph ({c.layers} layers, blocks of {c.block})")
        flavour = "trt" if ctx.graph.flavour == "trt" else "onnx"  # its block attends without a causal mask
        graph = GraphOptions(precision=ctx.graph.precision, flavour=flavour)
        dims = dims_from_config(ctx.checkpoint.config)
        ddims = draft_dims(self.draft, dims)
        builder = DecoderGraphBuilder(families.get("qwen3"), ddims, draft_weights(self.draft, ctx.checkpoint.weights()),
                                      graph, rope_for(self.draft, rope_rows(ctx.max_context, flavour, c.block)))
        return {"draft": save_graph(build_draft_graph(builder, self.draft), "draft", graph, ddims, ctx.folder)}

    def validate(self, ctx: ExportContext, graphs: dict[str, dict]) -> dict:
        session = GraphSession(ctx.folder / graphs["target"]["file"], graphs["target"])
        draft_session = GraphSession(ctx.folder / graphs["draft"]["file"], graphs["draft"], spin=False)
        return {"dflash": validate.dflash(ctx.reference, session, draft_session, self.draft)}

    def manifest(self) -> dict:
        c = self.draft.config
        return {**settings_dict(self.settings), "graph_top_k": DFLASH_TOP_K, "draft": self.where.resolve().name,
                "producer": c.producer, "block_size": c.block, "mask_token": c.mask_token, "hidden": c.hidden,
                "target_layers": list(c.target_layers), "draft_layers": c.layers,
                **({"draft_vocab": c.draft_vocab} if c.draft_vocab else {}),
                **{k: self.draft.meta[k] for k in ("verifier", "speculative_tokens") if k in self.draft.meta}}


@dataclass(frozen=True)
class Options:
    draft: str | None = setting(None, "dflash: the DFlash draft folder (config.json and model.safetensors), as z-lab "
                                      "or speculators publish them or specexport train writes them (default: the "
                                      "draft shipped for the model).")


METHOD = ExportMethod(Options, dflash.METHOD, DFlashPlan)
