"""Speculation methods at export time: their options (saved in the manifest) and their models."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from specexport.errors import UserError

METHODS = ("none", "ngram", "draft", "medusa", "eagle", "eagle3")
EAGLE_METHODS = {"eagle": 1, "eagle3": 3}  # method -> draft architecture version (eagle = EAGLE-1/2)
MEDUSA_TOP_K = 10  # candidates per head in the graph: any tree with ranks < 10 runs on the bundle
ASSETS = Path(__file__).parent / "assets"
MAX_DRAFT = 64


@dataclass(frozen=True)
class MethodOptions:
    name: str = "none"
    # draft: a model spec (path, alias, HF id) or "self:N" (the target's first N layers + norm + LM head)
    draft_model: str | None = None
    draft_length: int = 4  # K: draft tokens per step (the depth of a draft tree)
    draft_branching: tuple[int, ...] = ()  # children per node at each depth (a tree); () = a chain
    # ngram (prompt lookup)
    max_ngram: int = 3
    min_ngram: int = 2
    max_matches: int = 1
    # medusa: heads (folder or file; default: the heads shipped for the target) and the tree
    heads: str | None = None
    tree: str = "auto:3"  # what `specexport profile` chose on a 2-core CPU (profiles/cpu-2core.toml)
    # eagle / eagle3: the draft (folder; default: the draft shipped for the target) and the tree it grows
    eagle_draft: str | None = None
    # EAGLE-2's dynamic tree: what `specexport profile` chose on a 2-core CPU (profiles/cpu-2core.toml)
    depth: int = 2
    top_k: int = 2
    total_tokens: int = 4
    eagle_tree: str = "dynamic"  # or a static tree (EAGLE-1): preset, JSON file or inline JSON paths

    def check(self) -> None:
        if self.name not in METHODS:
            raise UserError(f"unknown method '{self.name}'; choose from {', '.join(METHODS)}")
        if not 1 <= self.draft_length <= MAX_DRAFT:
            raise UserError(f"--draft-length must be in 1..{MAX_DRAFT}, got {self.draft_length}")
        if self.name == "draft" and not self.draft_model:
            raise UserError("--method draft needs --draft-model (a model, or self:N for the target's first N layers)")
        if self.draft_branching:
            if len(self.draft_branching) > self.draft_length or any(not 1 <= b <= 8 for b in self.draft_branching):
                raise UserError(f"--draft-tree must give 1..8 children for at most --draft-length ({self.draft_length}) "
                                f"depths, got {','.join(map(str, self.draft_branching))}")
            if self.tree_size() > MAX_DRAFT:
                raise UserError(f"--draft-tree {','.join(map(str, self.draft_branching))} makes {self.tree_size()} "
                                f"nodes; at most {MAX_DRAFT}")
        if self.eagle_draft and self.name not in EAGLE_METHODS:
            raise UserError("--draft is only used with --method eagle or eagle3")
        if self.name in EAGLE_METHODS:
            from specexport.exporter.eagle_graph import EAGLE_TOP_K
            from specexport.runtime.eagle_tree import check_dynamic, parse_static

            check_dynamic(self.depth, self.top_k, self.total_tokens, EAGLE_TOP_K)
            if self.eagle_tree != "dynamic" and parse_static(self.eagle_tree).max_rank >= EAGLE_TOP_K:
                raise UserError(f"--tree ranks must be below {EAGLE_TOP_K} (the draft graph returns that many candidates)")
        if self.heads and self.name != "medusa":
            raise UserError("--heads is only used with --method medusa")
        if self.name == "ngram" and not (1 <= self.min_ngram <= self.max_ngram <= 16 and 1 <= self.max_matches <= 16):
            raise UserError("n-gram options must satisfy 1 <= --min-ngram <= --max-ngram <= 16, 1 <= --max-matches <= 16")

    def branching(self) -> tuple[int, ...]:
        """Children per node for each of the draft_length depths (1 past the given ones: a chain)."""
        return self.draft_branching + (1,) * (self.draft_length - len(self.draft_branching))

    def tree_size(self) -> int:
        size, width = 0, 1
        for b in self.branching():
            width *= b
            size += width
        return size

    def manifest(self) -> dict:
        data = {"name": self.name}
        if self.name == "draft":
            data.update(draft_model=self.draft_model, draft_length=self.draft_length,
                        draft_branching=list(self.branching()))
        if self.name == "ngram":
            data.update(max_ngram=self.max_ngram, min_ngram=self.min_ngram, max_matches=self.max_matches,
                        draft_length=self.draft_length)
        if self.name in EAGLE_METHODS:
            from specexport.exporter.eagle_graph import EAGLE_TOP_K

            data.update(depth=self.depth, top_k=self.top_k, total_tokens=self.total_tokens, tree=self.eagle_tree,
                        graph_top_k=EAGLE_TOP_K)
        if self.name == "medusa":
            data.update(tree_spec=self.tree)  # the heads, their source and the resolved tree: added by the export
        return data


def default_heads(model_name: str) -> Path | None:
    """Medusa heads shipped with specexport for a model (by its short name), if any."""
    folder = ASSETS / f"medusa-{model_name}"
    return folder if folder.is_dir() else None


def load_medusa(options: MethodOptions, model_name: str, hidden: int, vocab: int):
    """(heads, where, tree) for --method medusa: the heads checked against the target, the tree against them."""
    from specexport.exporter.medusa import load_heads
    from specexport.runtime.medusa_tree import resolve_tree

    where = Path(options.heads) if options.heads else default_heads(model_name)
    if where is None:
        raise UserError(f"no Medusa heads ship for {model_name}: pass --heads PATH (published heads, or train them "
                        f"with specexport train --method medusa --model ...)")
    heads = load_heads(where)
    heads.check(hidden, vocab, str(where))
    ranks = [row.get("ranks") for row in heads.meta.get("accuracy", [])]
    tree = resolve_tree(options.tree, heads.count, MEDUSA_TOP_K, ranks if ranks and all(ranks) else None)
    return heads, where, tree


def load_eagle(options: MethodOptions, model_name: str, dims):
    """(draft, where) for --method eagle/eagle3: the draft checked against the target and the method."""
    from specexport.exporter.eagle import load_draft
    from specexport.exporter.eagle_graph import EAGLE_TOP_K

    where = Path(options.eagle_draft) if options.eagle_draft else ASSETS / f"{options.name}-{model_name}"
    if not where.exists():
        if options.eagle_draft:
            raise UserError(f"EAGLE draft {where} not found")
        raise UserError(f"no {options.name} draft ships for {model_name}: pass --draft PATH (a published checkpoint "
                        f"folder, or train one with specexport train --method {options.name} --model ...)")
    draft = load_draft(where, dims.layers)
    want = EAGLE_METHODS[options.name]
    if draft.config.version != want:
        other = "eagle3" if draft.config.version == 3 else "eagle"
        raise UserError(f"{where} is an EAGLE-{draft.config.version} draft: use --method {other}")
    draft.check(dims, str(where))
    if draft.config.draft_vocab < EAGLE_TOP_K:
        raise UserError(f"{where}: a draft vocabulary of {draft.config.draft_vocab} is below the {EAGLE_TOP_K} "
                        "candidates the draft graph returns")
    return draft, where


def parse_self_draft(spec: str, target_layers: int) -> int | None:
    """N for "self:N", None for any other draft spec."""
    if not spec.startswith("self:"):
        return None
    try:
        n = int(spec[5:])
    except ValueError:
        raise UserError(f"--draft-model self:N needs an integer N, got '{spec}'") from None
    if not 1 <= n < target_layers:
        raise UserError(f"--draft-model self:{n}: N must be in 1..{target_layers - 1} (the target has {target_layers} layers)")
    return n


def self_draft(model, n: int):
    """The target's first n layers + its final norm and LM head, sharing the target's tensors."""
    import copy

    import torch

    config = copy.deepcopy(model.config)
    config.num_hidden_layers = n
    with torch.device("meta"):
        draft = type(model)(config)
    keep = {k: v for k, v in model.state_dict().items()
            if not k.startswith("model.layers.") or int(k.split(".")[2]) < n}
    draft.load_state_dict(keep, assign=True, strict=True)
    draft.model.rotary_emb = model.model.rotary_emb  # its inverse frequencies are a buffer outside the state dict
    return draft.eval()


def load_draft(options: MethodOptions, target, target_tokenizer, target_layers: int):
    """(draft model, description) for --method draft; checks that the vocabularies match."""
    from specexport.exporter import sources

    n = parse_self_draft(options.draft_model, target_layers)
    if n is not None:
        return self_draft(target, n), f"self:{n}"
    source = sources.resolve(options.draft_model)
    model, tokenizer = sources.load_model(source)
    if model.config.vocab_size != target.config.vocab_size or tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise UserError(f"draft model {source.name} has a different vocabulary than the target "
                        f"({len(tokenizer.get_vocab())} vs {len(target_tokenizer.get_vocab())} tokens); "
                        "a draft must share the target's tokenizer")
    return model, source.name
