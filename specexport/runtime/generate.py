"""The engine: a loaded bundle that turns prompts into tokens, with stats.

The loop is four named calls per step (`Engine.step`): the proposer proposes a tree, the target verifies it (one
call over the tree, which also accepts where the graph has the acceptance fused in), the acceptance picks the
path, and the cache commits it. Anything that wants to watch steps (bench, profile) passes `on_step` to
`generate` and gets a `StepRecord` per step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specexport.bundle import Bundle, load_bundle
from specexport.errors import UserError
from specexport.runtime import cpu, methods, tree
from specexport.runtime.backends import open_graph
from specexport.runtime.backends.layout import MARGIN, exact_nodes
from specexport.runtime.backends.protocol import Backend, Cache, pools
from specexport.runtime.budget import BatchLatency, grid
from specexport.runtime.governor import WHOLE, Governor, profiled_latency
from specexport.runtime.grammar import Grammars
from specexport.runtime.prefix import PrefixStore
from specexport.runtime.sampling import Context, Sampler, SamplingParams, TokenLogprob, logprobs
from specexport.runtime.tokenizer import StreamDecoder, Tokenizer, find_stop
from specexport.runtime.tree import DraftTree
from specexport.runtime.verify import Acceptance, Accepting, Route, accept, fused_inputs

PREFILL_CHUNK = 512  # tokens per prefill call: bounds the tree mask ([T, T] bools) and activations
LATENCY_CONTEXT = 128  # rows of context at which an engine measures its calls when no profile measured them here


@dataclass
class Stats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    steps: int = 0  # target calls after prefill
    ttft_s: float = 0.0  # prompt in -> first new token out
    seconds: float = 0.0  # whole generation, prefill included
    accept_lengths: list[int] = field(default_factory=list)  # tokens emitted per step (1 for plain decoding)
    drafted: int = 0  # draft tokens verified
    drafting_steps: int = 0  # steps that verified at least one draft token
    cached_tokens: int = 0  # prompt tokens copied from kept prompt beginnings (runtime/prefix.py), not computed

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

    def record(self, step: "StepRecord") -> None:
        """Count one speculative step."""
        self.steps += 1
        self.drafted += step.tree.drafts
        self.drafting_steps += step.tree.drafts > 0
        self.accept_lengths.append(step.acceptance.accept_length)

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


@dataclass(frozen=True)
class StepRecord:
    """What one step did, for observers (`generate(on_step=...)`): the verified tree, the acceptance, and where the
    time went (proposing; the target call, acceptance included when fused; the whole step)."""

    tree: DraftTree
    acceptance: Acceptance
    history_length: int  # tokens before the step, the root included: the root is token history_length - 1
    propose_s: float
    verify_s: float
    step_s: float


@dataclass
class Generation:
    tokens: list[int]
    text: str
    stop_reason: str  # "eos" | "stop_string" | "length" | "context" | "cancelled"
    stats: Stats
    logprobs: list[TokenLogprob] | None = None  # each token's, where asked (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # the prompt's: None for its first token (nothing before)


class Engine:
    """A bundle loaded for generation (batch 1): its target session, tokenizer, method and run-time settings."""

    def __init__(self, bundle: Bundle, threads: int | None = None, device: str = "auto"):
        if threads is not None and threads < 1:
            raise UserError(f"threads must be >= 1, got {threads}")
        self.bundle = bundle
        self.threads, self.device = threads, device
        self.target = self._session("target", spin=True)
        self.tokenizer = Tokenizer.from_dir(bundle.path)
        self.max_context = int(bundle.manifest["max_context"])
        notes = bundle.manifest.get("runtime") or {}
        self.first_token_alone = bool(notes.get("prefill_first_token_alone"))
        self.prefixes = PrefixStore.of(self.tokenizer)  # prompts' leading chunks, kept for later prompts
        self.grammars = Grammars(self.tokenizer.backend.to_str(), int(bundle.manifest["model"]["vocab"]),
                                 self.tokenizer.eos_token_ids)  # structured output's (runtime/grammar.py)
        self.warnings = []  # what a caller should tell the user (the CLI prints them)
        ort_int8 = bundle.precision == "int8" and bundle.manifest["flavour"] == "ort"
        if notes.get("int8_weight_bits", 8 if ort_int8 else 0) > cpu.int8_weight_bits():  # older bundles: 8 bits
            self.warnings.append("this int8 bundle was built for a CPU with VNNI/AMX; this CPU's int8 kernels saturate "
                                 "on its 8-bit weights (logits off by ~1): rebuild it on this machine")
        self.accepting = Accepting.of(self.target)  # what the target graph accepts itself (each step's Route)
        self.method = methods.get(bundle.method)
        self.settings = self.method.settings(bundle.manifest["method"], {})
        if bundle.manifest["graphs"]["target"].get("chain_only") and self.method.tokens_per_step(self.settings) > 1:
            raise UserError(f"bundle {bundle.path}: its target graph verifies chains only (plain decoding's), and its "
                            f"method ({bundle.method}) verifies trees: rebuild it")
        self._graphs: dict[str, Backend] = {}
        self._governor: Governor | None = None

    @classmethod
    def load(cls, path: str | Path, threads: int | None = None, device: str = "auto", verify: bool = True) -> "Engine":
        return cls(load_bundle(path, verify=verify), threads=threads, device=device)

    def configure(self, **given) -> None:
        """Run with other settings than the bundle's (the method's Settings fields; None = the bundle's). Each call
        starts again from the bundle's settings, so configure() restores them."""
        given = {k: v for k, v in given.items() if v is not None}
        methods.check_given(self.bundle.method, given)
        self.settings = self.method.settings(self.bundle.manifest["method"], given)
        self._governor = None  # its rates are of the trees the old settings made

    def limit_context(self, tokens: int) -> None:
        """Take prompts plus new tokens up to `tokens` only (below the bundle's context): a batched engine's KV pool
        holds this many rows per sequence."""
        if not 2 <= tokens <= int(self.bundle.manifest["max_context"]):
            raise UserError(f"the context limit must be in 2..{self.bundle.manifest['max_context']} (the bundle's), "
                            f"got {tokens}")
        self.max_context = tokens

    def describe(self) -> str:
        """The method and its tree in a few words, for summaries."""
        note = self.method.describe(self.settings)
        return self.bundle.method + (f" ({note})" if note else "")

    def graph(self, name: str) -> Backend:
        """Another graph of the bundle (a draft, Medusa's heads), loaded on first use; it does not spin, so it never
        takes the cores from the target's next call (backend.session_options)."""
        if name not in self._graphs:
            self._graphs[name] = self._session(name, spin=False)
        return self._graphs[name]

    def side_graphs(self) -> list[Backend]:
        """The other graphs loaded so far (their calls and time: Backend.calls, .seconds)."""
        return list(self._graphs.values())

    def _session(self, name: str, spin: bool) -> Backend:
        info = self.bundle.graphs[name]
        return open_graph(self.bundle.file(info["file"]), info, threads=self.threads, device=self.device, spin=spin)

    def governor(self) -> Governor | None:
        """The drafting governor of this engine's generations alone (runtime/governor.py), made at the first: its
        latency is the profile's where the profile was measured on this CPU (profiled_latency), else measured now
        (one sequence, widths up to the method's tree, about half a second). None for trees of one row, and where
        the backend has no pool to measure its calls on (TensorRT: every tree whole)."""
        rows = self.method.tokens_per_step(self.settings)
        if self._governor is None and rows > 1 and pools(self.target):
            widths = grid(rows)
            context = min(LATENCY_CONTEXT, self.max_context - rows)
            latency = profiled_latency(self) or BatchLatency.measure(
                self.target, self.target.new_pool(1, context + rows), [1], widths, context, repeats=3)
            self._governor = Governor(rows, latency)
        return self._governor

    def sampler(self, params: SamplingParams | None = None) -> Sampler:
        """A generation's sampler: its settings, random stream and, where it has a constraint, its grammar's state
        (UserError, one line, for a constraint that does not parse)."""
        params = params or SamplingParams()
        return Sampler(params, self.grammars.matcher(params.constraint) if params.constraint is not None else None)

    def proposer(self, sampler: Sampler, plain: bool = False) -> methods.Proposer:
        """The bundle's proposer with the current settings; `plain`: plain decoding (the baseline)."""
        if plain:
            return methods.PLAIN.proposer(self, methods.PLAIN.Settings(), sampler)
        return self.method.proposer(self, self.settings, sampler)

    def request(self, prompt: str | list[int], max_new_tokens: int, stop: tuple[str, ...], chat: bool
                ) -> tuple[list[int], int]:
        """A generation's request checked (one line for what is wrong): its prompt ids and its budget of new tokens
        (max_new_tokens, or what the context leaves)."""
        if max_new_tokens < 1:
            raise UserError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not all(isinstance(s, str) and s for s in stop):
            raise UserError("stop strings must not be empty")
        ids = self.encode(prompt, chat=chat)
        return ids, min(max_new_tokens, self.max_context - len(ids))

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
    def prefill(self, cache: Cache, ids: list[int], proposer=None, scores: list | None = None, top: int = 0
                ) -> np.ndarray:
        """Run the prompt through the target; returns the logits of its last token. Its calls also
        bring what `proposer` wants from the target (EAGLE's features; Medusa's candidates at the last row).
        `scores`: a list that gets the prompt's logprobs (`chunk_logprobs`, with `top` alternatives each), every
        chunk computed then (none copied from a kept beginning: its rows' logits are not kept)."""
        chunks, fed = self.prefill_chunks(ids), 0
        if scores is not None:
            scores.append(None)  # the first token follows nothing
        while fed < len(chunks):
            fed, logits = self.prefill_next(cache, chunks, fed, proposer, every_row=scores is not None)
            if scores is not None:
                scores.extend(chunk_logprobs(chunks, fed - 1, logits, top))
        return logits[-1]

    def prefill_chunks(self, ids: list[int], size: int | None = None) -> list[list[int]]:
        """The prompt's target calls: chunks of at most `size` tokens (default PREFILL_CHUNK), cut where a message ends
        (runtime/prefix.py), the first token alone where the bundle asks."""
        size = PREFILL_CHUNK if size is None else size
        cuts = [0, *self.prefixes.split(ids), len(ids)]
        parts = [ids[a:b] for a, b in zip(cuts, cuts[1:])]
        if self.first_token_alone and len(parts[0]) > 1:
            parts[:1] = [parts[0][:1], parts[0][1:]]
        return [c[i:i + size] for c in parts for i in range(0, len(c), size)]

    def prefill_next(self, cache: Cache, chunks: list[list[int]], fed: int, proposer=None,
                     fused: bool | None = None, every_row: bool = False) -> tuple[int, np.ndarray]:
        """Feed the next of a prompt's `chunks` (`prefill_chunks`) into `cache`, which holds the first `fed` of them;
        returns how many it holds then and the logits of the last token fed ([1, V]; `every_row`: of every token
        fed, [len(chunk), V], and nothing copied). Chunks an earlier prompt began with are copied as its calls left
        them (`restore_kept`), the next computed and kept (`computed`). `fused`: whether the proposer's steps accept
        in the graph (what it wants from the target depends on it; default: this engine's graph)."""
        if fed == 0:
            self.prefixes.asked(sum(len(c) for c in chunks))
        if not every_row:
            fed = self.restore_kept(cache, chunks, fed, proposer, fused)
        extra = self._prefill_wants(proposer, fused)
        out = self.forward_chain(cache, chunks[fed], ("logits",) + extra, every_row)
        self.computed(cache, chunks, fed, out, proposer, fused)
        return fed + 1, out["logits"]

    def restore_kept(self, cache: Cache, chunks: list[list[int]], fed: int, proposer=None,
                     fused: bool | None = None) -> int:
        """Copy into `cache` (holding the first `fed` chunks) the leading chunks an earlier prompt kept, never the
        last (its logits are wanted): the same rows, as its calls left them (runtime/prefix.py); a proposer that
        reads the calls' outputs observes the kept ones. Returns the chunks the cache holds then."""
        extra = self._prefill_wants(proposer, fused)
        for out in self.prefixes.restore(cache, chunks[:len(chunks) - 1], extra):
            if extra:
                proposer.observe(out, range(len(chunks[fed])))
            fed += 1
        return fed

    def computed(self, cache: Cache, chunks: list[list[int]], fed: int, out: dict, proposer=None,
                 fused: bool | None = None) -> None:
        """Chunk `fed` was computed into `cache` (now holding `fed` + 1), with these outputs: kept for later prompts
        (unless it is the last), and observed by a proposer that reads them."""
        extra = self._prefill_wants(proposer, fused)
        if fed < len(chunks) - 1:
            self.prefixes.keep(cache, chunks[:fed + 1], {name: out[name] for name in extra})
        if extra:
            proposer.observe(out, range(len(chunks[fed])))

    def _prefill_wants(self, proposer, fused: bool | None) -> tuple[str, ...]:
        """What the proposer reads from the prompt's calls besides the logits."""
        return proposer.wants(self.accepting.graph if fused is None else fused) if proposer is not None else ()

    def forward_chain(self, cache: Cache, ids: list[int], want=("logits",), every_row: bool = False) -> dict:
        """Append a chain of tokens; returns the `want`ed outputs, the logits of the last row, [1, vocab]
        (`every_row`: of every row, [len(ids), vocab])."""
        t, past = len(ids), cache.length
        out = self.target.forward(cache, np.array([ids]), past + np.arange(t)[None], tree.causal_mask(t),
                                  np.arange(t) if every_row else np.array([t - 1]), want=want)
        cache.advance(t)
        return out

    def exact(self, draft: DraftTree, cache: Cache) -> DraftTree:
        """The tree without the nodes that a step after `cache`'s rows cannot lay out in lanes exactly, where the
        target lays trees out so (runtime/backends/layout.py); an unscored tree keeps a prefix of its nodes (a
        draft model reads its own numbering)."""
        if not getattr(self.target, "lanes", False) or len(draft) < 3:
            return draft
        nodes = exact_nodes(draft.parents, cache.length, self.target.info["head_dim"], prefix=draft.scores is None)
        return draft.truncated(nodes) if draft.scores is None else draft.kept(nodes)

    def verify(self, cache: Cache, draft: DraftTree, want=("logits",), accept: dict | None = None) -> dict:
        """One target call over the tree, every row selected; logits are [T, vocab]. `accept`: the fused
        acceptance's inputs (`verify.fused_inputs`), greedy when not given."""
        positions = cache.length + tree.depths(draft.parents)
        return self.target.forward(cache, np.array([draft.tokens]), positions[None], tree.ancestor_mask(draft.parents),
                                   np.arange(len(draft)), want=want, accept=accept)

    # -- the loop ------------------------------------------------------------------------------
    def step(self, cache: Cache, history: list[int], proposer: methods.Proposer, sampler: Sampler,
             governor: Governor | None = None, context: Context | None = None) -> StepRecord:
        """One speculative step: propose, verify, accept, commit. history[-1] is the root; `context`: what the rows
        follow, for the settings that depend on it (the penalties, min_tokens: runtime/sampling.conditioned). With
        a `governor` (runtime/governor.py) the step may skip proposing (the root verified alone) or verify part of
        the tree; a request sampled with a seed keeps its whole tree."""
        start, inside = time.perf_counter(), self.target.seconds
        seeded = not sampler.params.greedy and sampler.params.seed is not None
        if governor is None:
            plan = WHOLE
        else:
            with governor.lock:  # an engine's generations may run in several threads
                plan = governor.decide(1, sampled=int(not sampler.params.greedy), seeded=seeded)
        if plan.propose:
            draft = proposer.propose(history).truncated(cache.room())
            if governor is not None and len(draft) > 1:
                with governor.lock:
                    draft = governor.cut(plan, [draft], [seeded], [not sampler.params.greedy])[0]
            draft = self.exact(pruned(draft, sampler), cache)
        else:
            draft = DraftTree.root_only(history[-1])
        proposed = time.perf_counter()
        fused = self.accepting.route(sampler.params, draft.mode) is Route.GRAPH
        extra = proposer.wants(fused)
        if fused:  # verify and accept in one graph call: only the path and the bonus token come back
            feeds = fused_inputs(draft, sampler.params, sampler.rng)
            out = self.verify(cache, draft, want=("accept_rows", "bonus_token") + extra, accept=feeds)
            path = out["accept_rows"].tolist()
            acceptance = Acceptance(path, [draft.tokens[r] for r in path[1:]] + [int(out["bonus_token"][0])])
        else:
            out = self.verify(cache, draft, want=("logits",) + extra)
            acceptance = accept(draft, out["logits"], sampler.params, sampler.rng, context)
        verified = time.perf_counter()
        cache.commit(acceptance.path)
        if plan.propose:
            proposer.accepted(acceptance.path)
        if extra:
            proposer.observe(out, acceptance.path)
        record = StepRecord(draft, acceptance, len(history), proposed - start, verified - proposed,
                            time.perf_counter() - start)
        if governor is not None:
            call_s = self.target.seconds - inside  # (another thread's calls too, where generations share the engine)
            with governor.lock:
                governor.verified([draft], [acceptance.path], 1, len(draft), call_s, len(draft))
                governor.record(plan, record.step_s - call_s, 1)
        return record

    def generate(self, prompt: str | list[int], max_new_tokens: int = 128, sampling: SamplingParams | None = None,
                 stop: tuple[str, ...] = (), stop_ids: tuple[int, ...] | None = None, chat: bool = True,
                 on_text=None, plain: bool = False, on_step=None, cancel=None, on_tokens=None,
                 budget: bool = True) -> Generation:
        """Generate up to `max_new_tokens` with the bundle's method (`plain`: plain decoding); `budget`: the drafting
        governor decides each step's tree (runtime/governor.py), else every tree is verified whole. `on_text(text)`
        streams the text as it is accepted, `on_tokens(ids)` the token ids each step emitted (after their text);
        `on_step(StepRecord)` sees every step. `cancel`: a threading.Event or a
        callable returning True to stop, checked before each step, after the tokens of the previous one (or the
        prefill's token) are all emitted; generation then stops with stop_reason "cancelled" and keeps what it has."""
        cancelled = getattr(cancel, "is_set", cancel) or (lambda: False)
        ids, allowed = self.request(prompt, max_new_tokens, stop, chat)
        sampler = self.sampler(sampling)
        proposer = self.proposer(sampler, plain)
        cache = self.target.new_cache(len(ids) + allowed + proposer.max_drafts + MARGIN)  # backends/layout.py
        proposer.start(len(ids), cache.capacity)
        stats = Stats(prompt_tokens=len(ids))
        params = sampler.params
        output = Output(self.tokenizer, stop, stop_ids, max_new_tokens, allowed, on_text, params)

        def emit(tokens, scores) -> bool:
            before = len(output.tokens)
            if sampler.grammar is not None:
                sampler.grammar.advance(tokens)
            ended = output.emit(tokens, scores) is not None
            if on_tokens is not None:
                on_tokens(output.tokens[before:])
            return ended

        governor = self.governor() if budget and not plain else None
        start = time.perf_counter()
        conditional = params.conditional
        last = self.prefill(cache, ids, proposer, output.prompt_logprobs, params.prompt_logprobs or 0)
        pending = [sampler(last, Context(ids, len(ids), output.stop_ids, sampler.grammar))]
        scores = first_logprobs(last, pending[0], params)
        stats.ttft_s = time.perf_counter() - start
        while not emit(pending, scores):
            if cancelled():
                output.reason = "cancelled"
                break
            history = ids + output.tokens
            record = self.step(cache, history, proposer, sampler, governor,
                               Context(history, len(ids), output.stop_ids, sampler.grammar) if conditional else None)
            stats.record(record)
            if on_step is not None:
                on_step(record)
            pending, scores = record.acceptance.tokens, record.acceptance.logprobs
        stats.seconds = time.perf_counter() - start
        return output.close(stats)


class Output:
    """A generation's emitted tokens and text, and why it stops (`reason`: eos, stop_string, length, context,
    cancelled, or None while it goes on); the same for a batch-1 generation and a scheduled request."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], stop_ids, max_new_tokens: int, budget: int,
                 on_text=None, params: SamplingParams | None = None):
        self.stop_ids = set(tokenizer.eos_token_ids if stop_ids is None else stop_ids)
        self.text = TextStream(tokenizer, stop, on_text)
        self.max_new_tokens, self.budget = max_new_tokens, budget
        self.tokens: list[int] = []
        self.reason: str | None = None
        asked = params or SamplingParams()
        self.logprobs: list[TokenLogprob] | None = [] if asked.logprobs is not None else None
        self.prompt_logprobs: list | None = [] if asked.prompt_logprobs is not None else None  # filled by prefill

    def emit(self, tokens, scores: list[TokenLogprob] | None = None) -> str | None:
        """Append a step's tokens one by one (and their logprobs, `scores`, where asked); returns why generation
        stops, if it does (the rest are dropped)."""
        for i, token in enumerate(tokens):
            self.tokens.append(token)
            if self.logprobs is not None:
                self.logprobs.append(scores[i])
            if token in self.stop_ids:
                self.reason = "eos"
            elif self.text.push(token):
                self.reason = "stop_string"
            elif len(self.tokens) >= self.budget:
                self.reason = "length" if self.budget == self.max_new_tokens else "context"
            if self.reason:
                return self.reason
        return None

    def close(self, stats: Stats) -> Generation:
        stats.new_tokens = len(self.tokens)
        return Generation(self.tokens, self.text.close(flush=self.reason != "stop_string"), self.reason, stats,
                          self.logprobs, self.prompt_logprobs)


def pruned(draft: DraftTree, sampler: Sampler) -> DraftTree:
    """The tree without the drafts the sampler's grammar forbids, where cutting them changes nothing but the rows
    verified: greedy, or drafts chosen deterministically (runtime/grammar.py); else the tree as it is."""
    if sampler.grammar is None or not (sampler.params.greedy or draft.mode is tree.AcceptMode.TOPK):
        return draft
    return sampler.grammar.prune(draft)


def first_logprobs(logits: np.ndarray, token: int, params: SamplingParams) -> list[TokenLogprob] | None:
    """The logprob of a prompt's first new token, drawn from the prompt's last row `logits` [V], where asked."""
    return None if params.logprobs is None else logprobs(logits[None], [token], params.logprobs)


def chunk_logprobs(chunks: list[list[int]], fed: int, logits: np.ndarray, top: int) -> list[TokenLogprob]:
    """The logprobs of the prompt tokens that the rows of chunk `fed` (`logits` [len(chunk), V]) predict: its own
    tokens after the first, then the next chunk's first. E.g. chunks [[5, 6], [7]]: chunk 0's rows score 6 and 7."""
    following = chunks[fed][1:] + (chunks[fed + 1][:1] if fed + 1 < len(chunks) else [])
    return logprobs(logits[:len(following)], following, top)


class TextStream:
    """The text of the tokens emitted so far, streamed to `on_text` as it becomes final: stop strings are cut, and
    the last (longest stop string - 1) characters are held back until they cannot start one."""

    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...], on_text=None):
        self.decoder, self.stop, self.on_text = StreamDecoder(tokenizer), list(stop), on_text
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text, self.sent = "", 0

    def push(self, token: int) -> bool:
        """Add a token's text; True when a stop string appeared (the text is cut before it)."""
        self.text += self.decoder.push(token)
        cut = find_stop(self.text, self.stop) if self.stop else None
        if cut is not None:
            self.text = self.text[:cut]
            return True
        if self.on_text and len(self.text) - self.hold > self.sent:
            self.on_text(self.text[self.sent:len(self.text) - self.hold])
            self.sent = len(self.text) - self.hold
        return False

    def close(self, flush: bool) -> str:
        """The whole text, the held-back part sent; `flush`: add what the decoder still holds."""
        if flush:
            self.text += self.decoder.flush()
        if self.on_text and len(self.text) > self.sent:
            self.on_text(self.text[self.sent:])
        return self.text
