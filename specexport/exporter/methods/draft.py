"""A draft model at export time: the draft (another model with the target's vocabulary, or the target's first N
layers) becomes its own step graph with its own KV cache."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch

from specexport.errors import UserError
from specexport.exporter import budget, sources, validate
from specexport.exporter.arch import dims_from_config
from specexport.exporter.graph import GraphOptions
from specexport.exporter.layerwise import layerwise_model
from specexport.exporter.methods.plan import ExportMethod, Plan, Target
from specexport.exporter.save import Checkpoint, ExportContext, rotary_module, write_graph
from specexport.exporter.weights import FirstLayers
from specexport.options import setting
from specexport.runtime.methods import draft


class DraftPlan(Plan):
    extra_graphs = 1

    def __init__(self, options: Options, settings: draft.Settings, target: Target):
        super().__init__(options, settings, target)
        if not options.draft_model:
            raise UserError("--method draft needs --draft-model (a model, or self:N for the target's first N layers)")
        self.spec, self.model = options.draft_model, None
        if parse_self_draft(self.spec, target.dims.layers) is None:
            try:  # fail early on a draft that is not a model or has another vocabulary size
                vocab = sources.load_config(sources.resolve(self.spec)).vocab_size
            except UserError as e:
                raise UserError(f"--draft-model: {e}") from None
            if vocab != target.dims.vocab:
                raise UserError(f"draft model {self.spec} has a different vocabulary than the target ({vocab} vs "
                                f"{target.dims.vocab} tokens); a draft must share the target's tokenizer")

    def write_graphs(self, ctx: ExportContext) -> dict[str, dict]:
        plain = GraphOptions(precision=ctx.graph.precision, flavour=ctx.graph.flavour)
        n = parse_self_draft(self.spec, ctx.dims.layers)
        if n is not None and ctx.loaded is None:  # a streamed target: its first n layers, streamed too
            config, source = first_layers_config(ctx.checkpoint.config, n), ctx.checkpoint.source
            ctx.step(f"building the draft graph (self:{n}, {n} layers)")
            reference = ctx.reference
            self.model = (layerwise_model(source, config) if hasattr(reference, "layerwise_weight")
                          else self_draft(reference, n))
            checkpoint = Checkpoint(config, FirstLayers(source, n), rotary_module(config))
            return {"draft": write_graph(checkpoint, "draft", plain, ctx.max_context, ctx.folder, ctx.quiet)}
        if n is not None:
            self.model, checkpoint, name = self_draft(ctx.model, n), None, f"self:{n}"
        else:
            self.model, checkpoint, name = open_draft(self.spec, ctx.tokenizer)
        ctx.step(f"building the draft graph ({name}, {self.model.config.num_hidden_layers} layers)")
        return {"draft": write_graph(checkpoint or self.model, "draft", plain, ctx.max_context, ctx.folder,
                                     ctx.quiet)}

    def validate(self, ctx: ExportContext, graphs: dict[str, dict]) -> dict:
        # the draft's quality shows in the accept length; its numerics are checked case by case
        return {"draft": validate.check_graph(self.model, ctx.tokenizer, ctx.folder, graphs["draft"],
                                              ctx.graph.precision, agreement=False)}

    def manifest(self) -> dict:
        s = self.settings
        where = Path(self.spec)  # a local folder or file by its name only: a bundle names no machine path
        spec = where.resolve().name if where.exists() else self.spec
        return {"draft_model": spec, "draft_length": s.draft_length, "draft_branching": list(s.branching)}


@dataclass(frozen=True)
class Options:
    draft_model: str | None = setting(None, "draft: a model with the target's vocabulary (folder, .gguf, HF id or "
                                            "alias), or self:N (the target's first N layers).")


def parse_self_draft(spec: str, target_layers: int) -> int | None:
    """N for "self:N", None for any other draft spec."""
    if not spec.startswith("self:"):
        return None
    try:
        n = int(spec[5:])
    except ValueError:
        raise UserError(f"--draft-model self:N needs an integer N, got '{spec}'") from None
    if not 1 <= n < target_layers:
        raise UserError(f"--draft-model self:{n}: N must be in 1..{target_layers - 1} (the target has {target_layers} "
                        "layers)")
    return n


def first_layers_config(config, n: int):
    """A copy of a decoder's config with its first n layers: per-layer plans (layer_types, no_rope_layers) cut too."""
    config = copy.deepcopy(config)
    layers = config.num_hidden_layers
    config.num_hidden_layers = n
    for key, value in vars(config).items():
        if isinstance(value, list) and len(value) == layers and key != "architectures":
            setattr(config, key, value[:n])
    return config


def self_draft(model, n: int):
    """The target's first n layers + its final norm and LM head, sharing the target's tensors."""
    config = first_layers_config(model.config, n)
    with torch.device("meta"):
        draft_model = type(model)(config)
    keep = {k: v for k, v in model.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < n}
    draft_model.load_state_dict(keep, assign=True, strict=True)
    draft_model.model.rotary_emb = model.model.rotary_emb  # its inverse frequencies are a buffer outside the state dict
    target_buffers = dict(model.named_buffers())
    for name, buffer in list(draft_model.named_buffers()):  # the rest outside the state dict (Gemma's embed scale)
        if buffer.is_meta:
            module_name, _, attr = name.rpartition(".")
            draft_model.get_submodule(module_name).register_buffer(attr, target_buffers[name], persistent=False)
    return draft_model.eval()


def open_draft(spec: str, target_tokenizer):
    """(validation's reference, the checkpoint to build from or None for the reference itself, name) of another
    model as the draft, read as the target is: a tensor at a time where it streams (sources.stream_source), its
    reference whole while it fits (budget.whole_reference), else layer-wise. The vocabularies must match."""
    source = sources.resolve(spec)
    config, tokenizer = sources.load_config(source), sources.load_tokenizer(source)
    if tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise UserError(f"draft model {source.name} has a different vocabulary than the target "
                        f"({len(tokenizer.get_vocab())} vs {len(target_tokenizer.get_vocab())} tokens); "
                        "a draft must share the target's tokenizer")
    weights = sources.stream_source(source, config)
    if weights is None:
        return sources.load_model(source)[0], None, source.name
    if budget.whole_reference(True, dims_from_config(config)):
        reference = sources.load_model(source)[0]
    else:
        reference = layerwise_model(weights, config)
    return reference, Checkpoint.of_source(weights, config), source.name


METHOD = ExportMethod(Options, draft.METHOD, DraftPlan)
