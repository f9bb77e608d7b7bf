"""The engine: a loaded bundle that turns prompts into tokens, with stats."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specexport.errors import UserError
from specexport.runtime import tree
from specexport.runtime.bundle import Bundle, load_bundle
from specexport.runtime.backend import TargetSession, greedy_accept_inputs
from specexport.runtime.kvcache import KVCache
from specexport.runtime.sampling import Sampler, SamplingParams, probabilities
from specexport.runtime.verify import Acceptance, accept_greedy, accept_tree, accept_typical, uniforms_shape
from specexport.runtime.tokenizer import StreamDecoder, Tokenizer, find_stop

PREFILL_CHUNK = 512  # tokens per prefill call: bounds the bias ([T, past+T] floats) and activations


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # target calls after prefill
    ttft_s: float = 0.0  # prompt in -> first new token out
    seconds: float = 0.0  # whole generation, prefill included
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per step (1 for plain decoding)
    drafted: int = 0  # draft tokens verified

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tau(self) -> float:
        return float(np.mean(self.accept_lengths)) if self.accept_lengths else 0.0

    @property
    def accepted(self) -> int:
        """Draft tokens accepted (each step's accept length minus its bonus token)."""
        return sum(self.accept_lengths) - len(self.accept_lengths)

    def histogram(self) -> dict[int, int]:
        """Accept length -> number of steps."""
        lengths, counts = np.unique(self.accept_lengths, return_counts=True)
        return {int(k): int(v) for k, v in zip(lengths, counts)}

    def as_dict(self) -> dict:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "steps": self.steps,
            "ttft_s": round(self.ttft_s, 4),
            "seconds": round(self.seconds, 4),
            "tokens_per_s": round(self.tokens_per_s, 2),
            "tau": round(self.tau, 3),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "accept_histogram": self.histogram(),
        }


@dataclass
class Generation:
    tokens: list[int]
    text: str
    stop_reason: str  # "eos" | "stop_string" | "length" | "context"
    stats: Stats


class Engine:
    """A bundle loaded for generation (batch 1)."""

    def __init__(self, bundle: Bundle, threads: int | None = None, device: str = "auto"):
        if threads is not None and threads < 1:
            raise UserError(f"threads must be >= 1, got {threads}")
        self.bundle = bundle
        self.threads, self.device = threads, device
        self.draft = None  # the draft model's session, loaded on first use
        info = bundle.graphs["target"]
        self.target = TargetSession(bundle.file(info["file"]), info, threads=threads, device=device)
        self.tokenizer = Tokenizer.from_dir(bundle.path)
        self.max_context = int(bundle.manifest["max_context"])
        self.first_token_alone = bool(bundle.manifest.get("runtime", {}).get("prefill_first_token_alone"))
        self.fused_accept = "accept_rows" in self.target.outputs  # greedy and sampling acceptance inside the graph
        self.typical = None  # (threshold, alpha): Medusa's lossy typical acceptance when sampling
        self.medusa_tree = None
        self.heads = None  # the stand-alone Medusa heads graph, loaded when sampling needs it
        if bundle.method == "medusa":
            self.set_tree(None)
        self.draft_length = None  # a draft or n-gram bundle's draft length, when overridden
        self.eagle = None  # EAGLE tree settings: depth, top_k, total_tokens, static (a StaticTree or None)
        if bundle.method in ("eagle", "eagle3"):
            self.set_eagle()

    def configure(self, tree: str | None = None, depth: int | None = None, top_k: int | None = None,
                  total_tokens: int | None = None, draft_length: int | None = None) -> None:
        """Run-time overrides of the bundle's proposal: `tree` for Medusa and EAGLE (dynamic or a static tree),
        depth / top_k / total_tokens for EAGLE's dynamic tree, draft_length for draft and n-gram bundles."""
        from specexport.exporter.methods import MAX_DRAFT

        method = self.bundle.method
        if draft_length is not None:
            if method not in ("draft", "ngram"):
                raise UserError(f"--draft-length applies to draft and n-gram bundles; this one is '{method}'")
            if not 1 <= draft_length <= MAX_DRAFT:
                raise UserError(f"--draft-length must be in 1..{MAX_DRAFT}, got {draft_length}")
            self.draft_length = draft_length
        eagle_given = [n for n, v in (("--depth", depth), ("--draft-top-k", top_k), ("--total-tokens", total_tokens))
                       if v is not None]
        if eagle_given and self.eagle is None:
            raise UserError(f"{eagle_given[0]} applies to EAGLE bundles; this one is '{method}'")
        if tree is not None and method != "medusa" and self.eagle is None:
            raise UserError(f"--tree applies to Medusa and EAGLE bundles; this one is '{method}'")
        if self.eagle is not None and (tree is not None or eagle_given):
            self.set_eagle(depth, top_k, total_tokens, tree)
        elif tree is not None:
            self.set_tree(tree)

    def set_eagle(self, depth: int | None = None, top_k: int | None = None, total_tokens: int | None = None,
                  tree_spec: str | None = None) -> None:
        """EAGLE's tree: the bundle's settings, each overridable; tree_spec "dynamic" or a static tree."""
        from specexport.runtime.eagle_tree import check_dynamic, parse_static

        m = self.bundle.manifest["method"]
        depth = m["depth"] if depth is None else depth
        top_k = m["top_k"] if top_k is None else top_k
        total = m["total_tokens"] if total_tokens is None else total_tokens
        spec = tree_spec or m.get("tree", "dynamic")
        check_dynamic(depth, top_k, total, m["graph_top_k"])
        static = None if spec == "dynamic" else parse_static(spec)
        if static is not None and static.max_rank >= m["graph_top_k"]:
            raise UserError(f"EAGLE tree {spec[:40]!r} uses rank {static.max_rank}; this bundle's draft returns "
                            f"{m['graph_top_k']} candidates per node")
        self.eagle = {"depth": depth, "top_k": top_k, "total_tokens": total, "static": static, "tree": spec}

    def set_tree(self, spec: str | None) -> None:
        """The Medusa tree to run: the bundle's (None), a preset, a JSON file or auto:N."""
        from specexport.runtime.medusa_tree import make_tree, resolve_tree

        m = self.bundle.manifest["method"]
        if spec is None:
            self.medusa_tree = make_tree(m["tree"], m["heads_count"], m["top_k"], "the bundle's tree")
            return
        ranks = [row.get("ranks") for row in m.get("accuracy") or []]
        self.medusa_tree = resolve_tree(spec, m["heads_count"], m["top_k"], ranks if ranks and all(ranks) else None)

    def _heads_session(self):
        if self.heads is None:
            import onnxruntime as ort

            from specexport.runtime.backend import providers, session_options

            info = self.bundle.graphs["medusa_heads"]
            self.heads = ort.InferenceSession(str(self.bundle.file(info["file"])), session_options(self.threads, spin=False),
                                              providers=providers(self.device))
        return self.heads

    @classmethod
    def load(cls, path: str | Path, threads: int | None = None, device: str = "auto", verify: bool = True) -> "Engine":
        return cls(load_bundle(path, verify=verify), threads=threads, device=device)

    # -- prompts -----------------------------------------------------------------------------
    def encode(self, prompt: str | list[int], chat: bool = True) -> list[int]:
        """Token ids for a prompt: text goes through the chat template when the tokenizer has one."""
        if isinstance(prompt, str):
            try:
                prompt.encode("utf-8")
            except UnicodeEncodeError:
                raise UserError("the prompt is not valid UTF-8 text (it holds bytes that decode to no character)") \
                    from None
            if chat and self.tokenizer.has_chat_template:
                ids = self.tokenizer.encode_chat([{"role": "user", "content": prompt}])
            else:
                ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            vocab = self.bundle.manifest["model"]["vocab"]
            if any(not 0 <= t < vocab for t in ids):
                raise UserError(f"token ids must be in 0..{vocab - 1}")
        if not ids:
            raise UserError("the prompt is empty")
        if len(ids) >= self.max_context:
            raise UserError(f"the prompt has {len(ids)} tokens; this bundle's context limit is {self.max_context}")
        return ids

    # -- target calls ------------------------------------------------------------------------
    def prefill(self, cache: KVCache, ids: list[int], proposer=None) -> np.ndarray:
        """Run the prompt through the target; returns the logits of its last token. Its calls also
        bring what `proposer` wants from the target (EAGLE's features; Medusa's candidates at the last row)."""
        chunks = [ids[:1], ids[1:]] if self.first_token_alone and len(ids) > 1 else [ids]
        chunks = [c[i:i + PREFILL_CHUNK] for c in chunks for i in range(0, len(c), PREFILL_CHUNK)]
        extra = proposer.wants(self.fused_accept) if proposer is not None else ()
        for chunk in chunks:
            out = self.forward_chain(cache, chunk, ("logits",) + extra)
            if extra:
                proposer.observe(out, range(len(chunk)))
        return out["logits"][-1]

    def forward_chain(self, cache: KVCache, ids: list[int], want=("logits",)) -> dict:
        """Append a chain of tokens; returns the `want`ed outputs, the logits of the last row, [1, vocab]."""
        t, past = len(ids), cache.length
        bias = tree.causal_bias(past, t, self.target.bias_width(cache, past, t))
        out = self.target.forward(cache, np.array([ids]), past + np.arange(t)[None], bias, np.array([t - 1]), want=want)
        cache.advance(t)
        return out

    # -- speculation ---------------------------------------------------------------------------
    def proposer(self, method: str, sampler: Sampler):
        """The proposer for `method` with the bundle's settings ("none" = plain decoding)."""
        from specexport.runtime import proposers

        options = self.bundle.manifest["method"]
        if method == "none":
            return proposers.NoProposer()
        if method != options["name"]:
            raise UserError(f"this bundle was built for method '{options['name']}', not '{method}'")
        length = self.draft_length or options.get("draft_length")
        if method == "ngram":
            return proposers.NgramLookup(options["max_ngram"], options["min_ngram"], length, options["max_matches"])
        if method in ("draft", "eagle", "eagle3") and self.draft is None:
            info = self.bundle.graphs["draft"]
            self.draft = TargetSession(self.bundle.file(info["file"]), info, threads=self.threads, device=self.device,
                                       spin=False)
        if method == "draft":  # the bundle's branching per depth, cut or extended by chain links to the length
            branching = (tuple(options["draft_branching"]) + (1,) * length)[:length]
            return proposers.DraftModel(self.draft, branching, sampler.params, sampler.rng)
        if method == "medusa":
            heads = None
            if not self.fused(sampler):
                heads = self._heads_session()
            return proposers.MedusaHeads(self.medusa_tree, heads)
        if method in ("eagle", "eagle3"):
            e = self.eagle
            return proposers.Eagle(self.draft, e["depth"], e["top_k"], e["total_tokens"], e["static"])
        raise UserError(f"this runtime cannot run method '{method}'")

    def step(self, cache: KVCache, history: list[int], proposer, sampler: Sampler) -> tuple[Acceptance, int]:
        """One speculative step: propose, verify, accept, commit. history[-1] is the root.

        Returns the acceptance and the number of draft tokens verified."""
        proposal = proposer.propose(history)
        room = cache.capacity - cache.length - 1
        if len(proposal) > room:
            proposal = proposal.truncated(room)
        tokens = [history[-1]] + proposal.tokens
        parents = [-1] + [p + 1 for p in proposal.parents]
        fused = self.fused(sampler)
        extra = proposer.wants(fused)
        if fused:  # verify and accept in one graph call: only the path and the bonus token come back
            feeds = accept_inputs(parents, proposal, sampler)
            out = self.verify(cache, tokens, parents, want=("accept_rows", "bonus_token") + extra, accept=feeds)
            path = out["accept_rows"].tolist()
            acceptance = Acceptance(path, [tokens[r] for r in path[1:]] + [int(out["bonus_token"][0])])
        else:
            out = self.verify(cache, tokens, parents, want=("logits",) + extra)
            acceptance = accept(tokens, parents, out["logits"], proposal, sampler, self.typical)
        cache.commit(acceptance.path)
        proposer.accepted([r - 1 for r in acceptance.path[1:]])
        if extra:
            proposer.observe(out, acceptance.path)
        return acceptance, len(proposal)

    def fused(self, sampler: Sampler) -> bool:
        """Whether steps accept inside the graph: greedy always; sampling where the graph takes the random
        numbers (bundles before it accepted greedily only), but not Medusa's typical acceptance."""
        return self.fused_accept and (sampler.params.greedy or (self.target.fused_inputs and self.typical is None))

    def verify(self, cache: KVCache, tokens: list[int], parents: list[int], want=("logits",),
               accept: dict | None = None) -> dict:
        """One target call over the tree (root first), every row selected; logits are [T, vocab].
        `accept`: the fused acceptance's inputs (`accept_inputs`), greedy when not given."""
        t, past = len(tokens), cache.length
        bias = tree.attention_bias(parents, past, self.target.bias_width(cache, past, t))
        positions = past + tree.depths(parents)
        return self.target.forward(cache, np.array([tokens]), positions[None], bias, np.arange(t), want=want,
                                   accept=accept)

    # -- generation --------------------------------------------------------------------------
    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, sampling: SamplingParams | None = None,
                 stop: tuple[str, ...] = (), stop_ids: tuple[int, ...] | None = None, chat: bool = True,
                 on_text=None, method: str | None = None, proposer=None) -> Generation:
        """Generate up to `max_new_tokens`; `method` defaults to the bundle's ("none" = plain decoding).
        `proposer`: a ready proposer instead (e.g. one that records what it proposes)."""
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not all(isinstance(s, str) and s for s in stop):
            raise UserError("stop strings must not be empty")
        sampler = Sampler(sampling or SamplingParams())
        proposer = proposer or self.proposer(method or self.bundle.method, sampler)
        ids = self.encode(prompt, chat=chat)
        stop_ids = set(self.tokenizer.eos_token_ids if stop_ids is None else stop_ids)
        budget = min(max_new_tokens, self.max_context - len(ids))
        cache = self.target.new_cache(len(ids) + budget + proposer.max_nodes)
        proposer.start(len(ids), cache.capacity)
        stats = Stats(prompt_tokens=len(ids))
        stream = StreamDecoder(self.tokenizer)
        hold = max((len(s) for s in stop), default=1) - 1  # chars that may still become a stop string
        text, emitted, out, reason = "", 0, [], None

        def emit(token: int) -> str | None:
            """Append one token; returns why generation stops, if it does."""
            nonlocal text, emitted
            out.append(token)
            if token in stop_ids:
                return "eos"
            text += stream.push(token)
            cut = find_stop(text, list(stop)) if stop else None
            if cut is not None:
                text = text[:cut]
                return "stop_string"
            if on_text and len(text) - hold > emitted:
                on_text(text[emitted:len(text) - hold])
                emitted = len(text) - hold
            if len(out) >= budget:
                return "length" if budget == max_new_tokens else "context"
            return None

        start = time.perf_counter()
        pending = [sampler(self.prefill(cache, ids, proposer))]
        stats.ttft_s = time.perf_counter() - start
        while True:
            reason = next((r for r in map(emit, pending) if r), None)
            if reason:
                break
            acceptance, drafted = self.step(cache, ids + out, proposer, sampler)
            stats.steps += 1
            stats.drafted += drafted
            stats.accept_lengths.append(acceptance.accept_length)
            pending = acceptance.tokens
        stats.seconds = time.perf_counter() - start
        stats.new_tokens = len(out)
        if reason != "stop_string":
            text += stream.flush()
        if on_text and len(text) > emitted:
            on_text(text[emitted:])
        return Generation(out, text, reason, stats)


def accept_inputs(parents: list[int], proposal, sampler: Sampler) -> dict[str, np.ndarray]:
    """The fused acceptance's inputs for one step (exporter/fused.py): the same random numbers, drawn the
    same way, as `accept` uses, so a seed gives the same tokens either way."""
    params = sampler.params
    if params.greedy:
        return greedy_accept_inputs(len(parents))
    u = sampler.rng.random(uniforms_shape(parents))
    q = proposal.q[:len(parents)] if proposal.mode != "topk" and len(parents) > 1 else np.zeros((0, 0))
    return {"sample_u": u, "sample_q": q,
            "sample_params": np.array([params.temperature, params.top_k, params.top_p,
                                       proposal.mode == "without_replacement"], np.float32)}


def accept(tokens: list[int], parents: list[int], logits: np.ndarray, proposal, sampler: Sampler,
           typical: tuple[float, float] | None = None) -> Acceptance:
    """Greedy: the longest path matching the target's argmax. Sampling: the exact rule for how the
    drafts were chosen (verify.accept_tree), so the output follows the target's distribution; or, when
    `typical` (threshold, alpha) is given, Medusa's lossy typical acceptance."""
    if sampler.params.greedy:
        return accept_greedy(tokens, parents, logits.argmax(-1))
    p = probabilities(logits, sampler.params)
    u = sampler.rng.random(uniforms_shape(parents))
    if typical is not None:
        return accept_typical(tokens, parents, p, u, *typical)
    if proposal.mode == "topk":
        return accept_tree(tokens, parents, p, None, u, "topk")
    return accept_tree(tokens, parents, p, proposal.q[:len(tokens)], u, proposal.mode)
