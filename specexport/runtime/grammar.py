"""Structured output: a grammar every emitted token must follow (a JSON schema, a regular expression, a Lark or GBNF
grammar, a choice of strings), on llguidance (its matcher computes the tokens the grammar allows next, from the
bundle's own tokenizer.json, with numpy: no torch).

Under speculation each row of a tree is masked for the grammar's state after that row's own path (the matcher
advanced along the path, then rolled back), so a row allows what constrained plain decoding would allow at its
position: greedy acceptance then picks what constrained greedy decoding picks, and sampling draws from the masked
target distribution, token for token and in distribution the same as constrained plain decoding. Drafts the grammar
forbids are cut from the tree before it is verified (`Matcher.prune`), where cutting changes nothing but the rows
computed: under greedy acceptance, and for drafts chosen deterministically (a forbidden child has probability 0 at
its parent, so it is rejected and removed from the distribution the next sibling is tested against, as cutting it
does). Drafts sampled from a draft distribution stay: their rejection updates the residual distribution.

E.g. Constraint.json_schema({"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]})
allows `{"age":` then only digits, and the end of sequence once the object is closed.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass

import numpy as np

from specexport.errors import UserError
from specexport.runtime.tree import DraftTree, path_tokens, subtree

KINDS = {"json_schema": "json_schema", "regex": "regex", "grammar": "grammar", "choice": "choice"}  # -> llguidance's
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Constraint:
    """What the output must match: `kind` (json_schema, regex, grammar: Lark or GBNF, choice: a JSON list of strings)
    and its `source` text. Immutable and hashable, as the sampling settings that carry it are."""

    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise UserError(f"a constraint's kind must be one of {', '.join(KINDS)}, got {self.kind}")
        if not isinstance(self.source, str) or not self.source:
            raise UserError(f"a {self.kind} constraint needs its text")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "Constraint":
        """A JSON schema (a dict; True: any JSON value)."""
        return cls("json_schema", json.dumps(schema))

    @classmethod
    def json_object(cls) -> "Constraint":
        """Any JSON object (OpenAI's response_format json_object)."""
        return cls.json_schema({"type": "object"})

    @classmethod
    def choice(cls, options: list[str]) -> "Constraint":
        """Exactly one of `options`."""
        if not options or not all(isinstance(o, str) for o in options):
            raise UserError("a choice constraint needs a non-empty list of strings")
        return cls("choice", json.dumps(options))

    def grammar(self) -> str:
        """llguidance's grammar text for it; one line for a source that does not parse. JSON is written as Python's
        json.dumps writes it (", " and ": ", no other whitespace: a small model given free whitespace can fill its
        budget with it) unless the schema's own "x-guidance" says otherwise."""
        import llguidance

        try:
            if self.kind == "json_schema":
                return llguidance.LLMatcher.grammar_from_json_schema(self.source, defaults=JSON_LAYOUT)
            return llguidance.grammar_from(KINDS[self.kind], self.source)
        except (ValueError, RuntimeError) as e:
            raise UserError(f"the {self.kind.replace('_', ' ')} does not parse: {one_line(str(e))}") from None


def one_line(message: str, limit: int = 300) -> str:
    """llguidance's message (a parser's, over several lines) on one line, at most `limit` characters."""
    text = " ".join(message.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


class Grammars:
    """An engine's grammars: llguidance's view of its tokenizer (made at the first constraint, about 0.2 s on
    SmolLM2's 49k tokens) and each constraint's matcher at its start, built once (the costly part: a complex grammar
    can take a second) and copied for each generation that asks for it."""

    KEPT = 256  # constraints whose matcher is kept

    def __init__(self, tokenizer_json: str, vocab: int, eos_ids):
        self.tokenizer_json, self.vocab, self.eos_ids = tokenizer_json, vocab, sorted(eos_ids)
        self._tokenizer = None
        self._built: dict[Constraint, object] = {}
        self._lock = threading.Lock()

    def matcher(self, constraint: Constraint) -> "Matcher":
        """A new matcher at the grammar's start; UserError (one line) for a constraint llguidance refuses. A front
        end calls it once in a worker thread before submitting (serve/app.py), so the submit only copies it."""
        import llguidance

        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab,
                                                         eos_token=self.eos_ids or None)
            built = self._built.get(constraint)
        if built is None:
            built = llguidance.LLMatcher(self._tokenizer, constraint.grammar(), log_level=0)
            if built.is_error():
                raise UserError(f"the {constraint.kind.replace('_', ' ')} is not usable: "
                                f"{one_line(built.get_error())}")
            with self._lock:
                if len(self._built) >= self.KEPT:
                    self._built.pop(next(iter(self._built)))
                self._built[constraint] = built
        return Matcher(built.deep_copy(), self.vocab)


class Matcher:
    """One generation's grammar state: advanced by the tokens it emits (`advance`); the tokens allowed after a tree
    row's path (`allowed`); a tree cut to the drafts the grammar allows (`prune`)."""

    def __init__(self, matcher, vocab: int):
        import llguidance.numpy

        self._m, self.vocab = matcher, vocab
        self._bits = llguidance.numpy.allocate_token_bitmask(1, vocab)
        self._fill = llguidance.numpy.fill_next_token_bitmask

    def allowed(self, path=()) -> np.ndarray | None:
        """[vocab] bools: the tokens the grammar allows after the emitted ones and then `path`; None where `path`
        itself breaks the grammar (a row no acceptance can reach)."""
        path = [int(t) for t in path]
        if path and self._m.validate_tokens(path) < len(path):
            return None
        if path:
            self._m.consume_tokens(path)
        try:
            self._fill(self._m, self._bits, 0)
        finally:
            if path:
                self._m.rollback(len(path))
        bits = np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")
        return bits[:self.vocab].astype(bool)

    def mask(self, logits: np.ndarray, paths: list[list[int]] | None = None) -> None:
        """In place: each row of `logits` [T, V] keeps the tokens the grammar allows after its path (`paths[i]`, or
        none), the others set to -inf; a row no acceptance can reach is left as it is."""
        for i, row in enumerate(logits):
            allowed = self.allowed(paths[i] if paths is not None else ())
            if allowed is not None:
                row[~allowed[:row.shape[-1]]] = -np.inf

    def prune(self, tree: DraftTree) -> DraftTree:
        """`tree` without the drafts the grammar forbids after their path (and their descendants). A tree whose
        proposer reads its own node numbers (one without scores, a draft model's) is cut at its first forbidden
        node, which keeps every number; a scored tree keeps each allowed node (renumbered, as `truncated` does)."""
        if len(tree) == 1:
            return tree
        paths = path_tokens(tree.tokens, tree.parents)
        ok = [True]
        for i in range(1, len(tree)):
            ok.append(ok[tree.parents[i]] and self._m.validate_tokens(paths[i]) == len(paths[i]))
        if all(ok):
            return tree
        if tree.scores is None:
            return tree.truncated(ok.index(False))
        keep = [i for i, good in enumerate(ok) if good]
        tokens, parents = subtree(tree.tokens, tree.parents, keep)
        q = None if tree.q is None else tree.q[keep]
        return DraftTree(tokens, parents, tree.mode, q, tree.candidates, [tree.scores[i] for i in keep])

    def advance(self, tokens) -> None:
        """The generation emitted `tokens` (each allowed: they were drawn from masked rows)."""
        self._m.consume_tokens([int(t) for t in tokens])

    @property
    def done(self) -> bool:
        """Whether the grammar is complete and allows nothing more (only the end of sequence)."""
        return self._m.is_stopped()
