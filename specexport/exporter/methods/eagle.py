"""EAGLE-1/2 and EAGLE-3 at export time: the draft decoder (shipped for the model, published, or trained here) is
checked against the target, becomes its own graph with its own KV cache, and the target graph returns the
features it reads (EAGLE-3: fc of three layers' inputs, computed in the target graph)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from specexport.errors import UserError
from specexport.exporter import families, validate
from specexport.exporter.arch import dims_from_config, rope_rows
from specexport.exporter.drafts import load_draft
from specexport.exporter.drafts.mtp import load_mtp
from specexport.exporter.eagle import EagleDraft
from specexport.exporter.eagle_graph import (
    EAGLE_TOP_K,
    TargetFeatures,
    build_draft_graph,
    draft_dims,
    draft_weights,
    rope_for,
)
from specexport.exporter.graph import DecoderGraphBuilder, GraphOptions
from specexport.exporter.methods.plan import ExportMethod, NoOptions, Plan, Target, proposer_folder, settings_dict
from specexport.exporter.save import ExportContext, save_graph
from specexport.options import setting
from specexport.runtime.backends.host import GraphSession
from specexport.runtime.methods import eagle


class EaglePlan(Plan):
    extra_graphs = 1

    def __init__(self, method: str, version: int, options: Options, settings: eagle.Settings, target: Target):
        super().__init__(options, settings, target)
        eagle.EagleMethod.static_tree(settings, EAGLE_TOP_K)
        self.where = proposer_folder(options.draft, method, target, f"{method} draft", "--draft", "a published "
                                     f"checkpoint folder, or train one with specexport train --method {method} "
                                     "--model ...")
        self.draft = load_draft(self.where, target.dims.layers)
        if self.draft.config.version != version:
            raise UserError(f"{self.where} is an EAGLE-{self.draft.config.version} draft: use --method "
                            f"{METHOD_OF_VERSION[self.draft.config.version]}")
        self.draft.check(target.dims, str(self.where))
        if self.draft.config.draft_vocab < EAGLE_TOP_K:
            raise UserError(f"{self.where}: a draft vocabulary of {self.draft.config.draft_vocab} is below the "
                            f"{EAGLE_TOP_K} candidates the draft graph returns")

    def graph_options(self, graph: GraphOptions) -> GraphOptions:
        aux = tuple(sorted(set(graph.aux_layers) | set(self.draft.config.aux_layers)))
        return replace(graph, fused_accept=True, aux_layers=aux)

    def extensions(self) -> tuple:
        return (TargetFeatures(self.draft),)

    def write_graphs(self, ctx: ExportContext) -> dict[str, dict]:
        c = self.draft.config
        ctx.step(f"building the {'EAGLE-3' if c.version == 3 else 'EAGLE-1/2'} draft graph (draft vocabulary "
                 f"{c.draft_vocab})")
        plain = GraphOptions(precision=ctx.graph.precision, flavour=ctx.graph.flavour)
        return {"draft": write_draft_graph(ctx.checkpoint, self.draft, plain, ctx.max_context, ctx.folder)}

    def validate(self, ctx: ExportContext, graphs: dict[str, dict]) -> dict:
        session = GraphSession(ctx.folder / graphs["target"]["file"], graphs["target"])
        draft_session = GraphSession(ctx.folder / graphs["draft"]["file"], graphs["draft"], spin=False)
        return {"eagle": validate.eagle(ctx.reference, session, draft_session, self.draft)}

    def manifest(self) -> dict:
        c = self.draft.config
        return {**settings_dict(self.settings), "graph_top_k": EAGLE_TOP_K, "draft": self.where.resolve().name,
                "version": c.version, "draft_vocab": c.draft_vocab, "aux_layers": list(c.aux_layers),
                "producer": c.producer, "draft_layers": c.layers,
                "accuracy": self.draft.meta.get("accuracy"),
                **{k: self.draft.meta[k] for k in ("verifier", "speculative_tokens") if k in self.draft.meta}}


class MtpPlan(EaglePlan):
    """The target's own MTP layers as the draft (exporter/drafts/mtp.py): no --draft, nothing to download."""

    def __init__(self, options, settings: eagle.Settings, target: Target):
        Plan.__init__(self, options, settings, target)
        eagle.EagleMethod.static_tree(settings, EAGLE_TOP_K)
        self.where = target.source.path
        self.draft = load_mtp(target.source, target.config)
        self.draft.check(target.dims, target.source.name)


@dataclass(frozen=True)
class Options:
    draft: str | None = setting(None, "eagle, eagle3: the draft folder, a published EAGLE-1/2/3 checkpoint or one "
                                      "trained with specexport train (default: the draft shipped for the model).")


def write_draft_graph(checkpoint, draft: EagleDraft, graph: GraphOptions, max_context: int, folder: Path) -> dict:
    """draft.onnx: the draft decoder with its own KV cache (exporter/eagle_graph.py); its manifest entry. It reads
    the target's embedding and LM head only (save.Checkpoint)."""
    dims = dims_from_config(checkpoint.config)
    target = checkpoint.weights()
    ddims = draft_dims(draft, dims)
    builder = DecoderGraphBuilder(families.get("llama"), ddims, draft_weights(draft, target), graph,
                                  rope_for(draft, rope_rows(max_context, graph.flavour, tree_rows=64)))
    return save_graph(build_draft_graph(builder, draft), "draft", graph, ddims, folder)


METHOD_OF_VERSION = {1: "eagle", 3: "eagle3"}  # the draft architectures (EAGLE-2 runs EAGLE-1's drafts)
EAGLE1 = ExportMethod(Options, eagle.EAGLE1, partial(EaglePlan, "eagle", 1))
EAGLE3 = ExportMethod(Options, eagle.EAGLE3, partial(EaglePlan, "eagle3", 3))
MTP = ExportMethod(NoOptions, eagle.MTP, MtpPlan)
