"""What a speculation method does to an export: a `Plan` made before the target loads (so bad heads, drafts or trees
fail before any work), then asked, in order, for the target graph's options and extensions, its own graphs, its
numerics and its manifest section."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from specexport.errors import UserError
from specexport.exporter.graph import GraphOptions
from specexport.exporter.save import ExportContext
from specexport.options import fields

ASSETS = Path(__file__).parent.parent / "assets"  # proposers shipped for known models: ASSETS/<method>-<model>


@dataclass(frozen=True)
class Target:
    """The target as known before loading it: its short name (for shipped assets), dims, and where its checkpoint is
    (the MTP layers inside it are read from there)."""

    name: str
    dims: object  # arch.Dims
    source: object = None  # sources.ModelSource
    config: object = None  # its transformers config


def proposer_folder(given: str | None, kind: str, target: Target, what: str, option: str, how: str) -> Path:
    """The proposer's checkpoint: the path given, else the one shipped for the target (ASSETS/<kind>-<name>); one
    line where neither exists. Example: proposer_folder(None, "eagle3", target, "eagle3 draft", "--draft", ...) is
    ASSETS/eagle3-smollm2-135m for SmolLM2."""
    where = Path(given) if given else ASSETS / f"{kind}-{target.name}"
    if where.exists():
        return where
    if given:
        raise UserError(f"{what} {where} not found")
    raise UserError(f"no {what} shipped for {target.name}: pass {option} PATH ({how})")


class Plan:
    """A method that adds nothing to the export (plain decoding; a lookup whose settings are its whole section).
    Methods with graphs of their own override what they add."""

    extra_graphs = 0  # graphs of its own (progress steps)

    def __init__(self, options, settings, target: Target):
        self.settings = settings

    def graph_options(self, graph: GraphOptions) -> GraphOptions:
        """The target graph's options (Medusa and EAGLE need the fused acceptance, EAGLE-3 its aux layers)."""
        return graph

    def extensions(self) -> tuple:
        """What it adds to the target graph (graph.GraphExtension)."""
        return ()

    def write_graphs(self, ctx: ExportContext) -> dict[str, dict]:
        """Its own graphs, written into ctx.folder: name -> manifest entry."""
        return {}

    def validate(self, ctx: ExportContext, graphs: dict[str, dict]) -> dict:
        """Its numerics (added to the manifest's), against the PyTorch reference."""
        return {}

    def manifest(self) -> dict:
        """Its manifest section (the name is added by the export): the run-time settings, and what it was made of."""
        return settings_dict(self.settings)


class PlainPlan(Plan):
    """Plain decoding: every step is a chain and greedy acceptance is one argmax, so the ort flavour's target graph
    is chain-only (GQA's causal path, no tree bias) and leaves the acceptance to the runtime (the fused one's If
    costs more than a host argmax over one row)."""

    def graph_options(self, graph: GraphOptions) -> GraphOptions:
        return replace(graph, chain_only=True, fused_accept=False) if graph.flavour == "ort" else graph


def settings_dict(settings) -> dict:
    """Run-time settings as manifest values (tuples as lists)."""
    return {f.name: list(v) if isinstance(v := getattr(settings, f.name), tuple) else v
            for f in fields(type(settings)) if f.build}


@dataclass(frozen=True)
class NoOptions:
    pass


@dataclass(frozen=True)
class ExportMethod:
    """A method at export time: its build-only options (a frozen dataclass of options.setting fields, which the CLI
    makes `build` options from), its runtime method (whose Settings the bundle saves), and its plan, made from
    (options, settings, target) before any work."""

    Options: type
    runtime: object
    plan: Callable[..., Plan]
