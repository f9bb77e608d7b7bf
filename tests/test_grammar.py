"""Structured output's grammar state (runtime/grammar.py) on the tiny byte-level tokenizer: the tokens it allows
after a path, trees cut to the drafts it allows, and constraints that do not parse, in one line."""

import json

import numpy as np
import pytest
from conftest import TOKENIZER_VOCAB, byte_level_tokenizer

from specexport.errors import UserError
from specexport.runtime.grammar import Constraint, Grammars
from specexport.runtime.tree import DraftTree

EOS = 1  # <|im_end|>


@pytest.fixture(scope="module")
def grammars():
    return Grammars(byte_level_tokenizer().backend_tokenizer.to_str(), TOKENIZER_VOCAB, {EOS})


def token(c: str) -> int:
    """The tiny tokenizer's id of one printable ASCII character (2 + its byte: the byte-level alphabet's order)."""
    return 2 + ord(c) - ord("!")


def allowed_chars(matcher, path=()) -> set:
    allowed = matcher.allowed(path)
    return None if allowed is None else {i for i in np.flatnonzero(allowed)}


def test_the_tokens_allowed_follow_the_path_and_the_emitted_tokens(grammars):
    m = grammars.matcher(Constraint("regex", "ab[0-9]"))
    assert allowed_chars(m) == {token("a")}
    assert allowed_chars(m, [token("a")]) == {token("b")}
    assert allowed_chars(m, [token("a"), token("b")]) == {token(d) for d in "0123456789"}
    assert allowed_chars(m, [token("a"), token("b"), token("7")]) == {EOS}  # complete: only the end
    assert m.allowed([token("b")]) is None  # a path the grammar forbids: no acceptance reaches its row
    m.advance([token("a")])
    assert allowed_chars(m) == {token("b")} and not m.done
    m.advance([token("b"), token("3")])
    assert m.done


def test_rows_are_masked_on_their_own_paths(grammars):
    m = grammars.matcher(Constraint.choice(["ab", "ac"]))
    logits = np.zeros((3, TOKENIZER_VOCAB))
    m.mask(logits, [[], [token("a")], [token("z")]])
    assert set(np.flatnonzero(np.isfinite(logits[0]))) == {token("a")}
    assert set(np.flatnonzero(np.isfinite(logits[1]))) == {token("b"), token("c")}
    assert np.isfinite(logits[2]).all()  # unreachable: left as it was


def test_trees_lose_the_drafts_the_grammar_forbids(grammars):
    m = grammars.matcher(Constraint("regex", "a[bc]d"))
    a, b, c, x, d = (token(ch) for ch in "abcxd")
    # root, a, x, (a)b, (a)c, (ab)d, (x)d: x is forbidden, and its child with it
    tokens, parents = [7, a, x, b, c, d, d], [-1, 0, 0, 1, 1, 3, 2]
    unscored = m.prune(DraftTree(tokens, parents))
    assert unscored.tokens == [7, a] and unscored.parents == [-1, 0]  # cut at the first forbidden node: numbers kept
    scored = m.prune(DraftTree(tokens, parents, scores=[0, -1, -1, -2, -2, -3, -3]))
    assert scored.tokens == [7, a, b, c, d] and scored.parents == [-1, 0, 1, 1, 2]
    assert scored.scores == [0, -1, -2, -2, -3]
    whole = DraftTree([7, a, b, d], [-1, 0, 1, 2])
    assert m.prune(whole) is whole


def test_json_is_laid_out_as_json_dumps_writes_it(grammars):
    m = grammars.matcher(Constraint.json_schema({"type": "object", "properties": {"k": {"type": "integer"}},
                                                 "required": ["k"], "additionalProperties": False}))
    ids = byte_level_tokenizer()(json.dumps({"k": 12}), add_special_tokens=False)["input_ids"]
    m.advance(ids)
    assert allowed_chars(m) == {EOS}
    compact = byte_level_tokenizer()('{"k":12}', add_special_tokens=False)["input_ids"]
    fresh = grammars.matcher(Constraint.json_object())
    assert fresh.allowed(compact[:5]) is not None  # any object: {"k": ...
    strict = grammars.matcher(Constraint.json_schema({"type": "object", "properties": {"k": {"type": "integer"}}}))
    assert strict.allowed(compact) is None  # no space after the colon: not how json.dumps writes it


@pytest.mark.parametrize("constraint, match", [
    (("regex", "(ab"), "the regex is not usable"),
    (("json_schema", "{not json"), "the json schema does not parse"),
    (("json_schema", '{"type": "no such type"}'), "the json schema is not usable"),
    (("grammar", "start: @@@"), "the grammar is not usable"),
])
def test_constraints_that_do_not_parse_are_one_line(grammars, constraint, match):
    with pytest.raises(UserError, match=match) as e:
        grammars.matcher(Constraint(*constraint))
    assert "\n" not in str(e.value)


def test_bad_constraints_are_refused_when_made():
    with pytest.raises(UserError, match="kind must be one of"):
        Constraint("xml", "<a/>")
    with pytest.raises(UserError, match="needs its text"):
        Constraint("regex", "")
    with pytest.raises(UserError, match="non-empty list of strings"):
        Constraint.choice([])
