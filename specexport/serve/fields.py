"""The request fields this server knows, beyond those it acts on, and what it does with each; and with the rest.

Clients written for OpenAI, vLLM, SGLang or llama-server send fields of their own. Each field is one of:

- supported: acted on (serve/protocol.py reads them: SUPPORTED_CHAT, SUPPORTED_COMPLETION).
- neutral only: a feature this server does not have (best_of > 1, llama-server's penalties, the deprecated
  functions, vLLM's and llama-server's other samplers, ...), accepted only at the value that asks for nothing, and a 400 naming it at
  any other: an unsupported feature silently ignored would answer something else than what was asked.
  llama-server's `min_keep` also at temperature 0: greedy decoding keeps the most likely token.
- a hint: any value of its type is accepted and nothing is done with it, because it cannot change the text (a tag,
  a cache or scheduling hint, a setting of a feature that is off: `cache_prompt`, `user`, `metadata`, `priority`,
  `mirostat_tau` while `mirostat` is 0, ...).
- unknown: anything else. Accepted and named (the response's X-Specexport-Ignored-Fields header and the request's
  access-log line), as vLLM accepts and logs them; `serve --strict` refuses them with a 400.

A null value is an absent field. docs/serving/compat.md lists every field with vLLM's and llama-server's support.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from typing import Callable

IGNORED_HEADER = "X-Specexport-Ignored-Fields"
SHOWN = 16  # unknown fields named in the header (and the log line); past that, how many more
PLAIN_NAME = re.compile(r"[A-Za-z0-9_.\-\[\]]{1,64}")


@dataclass(frozen=True)
class Rule:
    """How a known field is taken: `valid(value)`, its type and range (else a 400 saying it must be `kind`);
    `neutral(value)`, whether it asks for nothing this server lacks (else a 400: not supported, only `what`), None
    for a hint (any valid value); `greedy_noop`: also accepted with any valid value at temperature 0."""

    kind: str
    valid: Callable
    neutral: Callable | None = None
    what: str = ""
    greedy_noop: bool = False


def _bool(v) -> bool:
    return isinstance(v, bool)


def _int(v) -> bool:
    return type(v) is int


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _string(v) -> bool:
    return isinstance(v, str)


def _object(v) -> bool:
    return isinstance(v, dict)


def _list(v) -> bool:
    return isinstance(v, list)


def _any(v) -> bool:
    return True


def _is(value) -> Callable:
    """Equal to `value`, a boolean only to a boolean (False is not 0)."""
    return lambda v: v == value and isinstance(v, bool) == isinstance(value, bool)


def _empty(v) -> bool:
    return v == [] or v == {} or v == ""


BOOL, INT, NUMBER, STRING = ("a boolean", _bool), ("an integer", _int), ("a number", _number), ("a string", _string)
OBJECT, LIST, ANY = ("an object", _object), ("a list", _list), ("any JSON value", _any)


def hint(kind) -> Rule:
    return Rule(kind[0], kind[1])


def neutral(kind, check: Callable, what: str, greedy_noop: bool = False) -> Rule:
    return Rule(kind[0], kind[1], check, what, greedy_noop)


def off(kind=ANY) -> Rule:
    """A feature asked for by any value but null."""
    return Rule(kind[0], kind[1], lambda v: False, "null")


NO_TOOL_CALLS = ("none", "auto")  # tool_choice values that ask for no call (auto, with no tools given)

COMMON = {
    # OpenAI
    "metadata": hint(ANY), "store": hint(BOOL), "prompt_cache_key": hint(ANY), "safety_identifier": hint(ANY),
    "service_tier": neutral(STRING, lambda v: v in ("auto", "default"), '"auto" or "default"'),
    # vLLM (and SGLang)
    "length_penalty": hint(NUMBER),  # beam search's only, and use_beam_search is off
    "use_beam_search": neutral(BOOL, _is(False), "false"),
    "include_stop_str_in_output": neutral(BOOL, _is(False), "false"),
    "skip_special_tokens": neutral(BOOL, _is(True), "true"),
    "spaces_between_special_tokens": hint(BOOL),  # special tokens are never in the text (skip_special_tokens)
    "truncate_prompt_tokens": off(INT),
    "prompt_logprobs": off(INT),
    "allowed_token_ids": neutral(LIST, _empty, "empty"),
    "bad_words": neutral(LIST, _empty, "empty"),
    "guided_decoding_backend": hint(STRING),  # one backend here: llguidance (runtime/grammar.py)
    "guided_whitespace_pattern": off(), "structural_tag": off(),
    "logits_processors": off(), "vllm_xargs": off(), "kv_transfer_params": off(), "lora_path": off(),
    "return_tokens_as_token_ids": neutral(BOOL, _is(False), "false"),
    "return_token_ids": neutral(BOOL, _is(False), "false"),
    "no_stop_trim": neutral(BOOL, _is(False), "false"),
    "priority": hint(INT), "request_id": hint(STRING), "cache_salt": hint(STRING),
    # llama-server
    "cache_prompt": hint(BOOL),  # prompts' beginnings are always kept (runtime/prefix.py)
    "n_predict": neutral(INT, _is(-1), "-1: send max_tokens"),
    "n_keep": hint(INT), "n_cache_reuse": hint(INT),  # what to keep when the context overflows: it never does here
    "n_indent": neutral(INT, _is(0), "0"),
    "n_probs": neutral(INT, _is(0), "0"),
    "n_cmpl": neutral(INT, _is(1), "1"),
    "repeat_penalty": neutral(NUMBER, _is(1), "1"),
    "repeat_last_n": hint(INT), "penalize_nl": hint(BOOL),  # settings of the penalties, which are off
    "typical_p": neutral(NUMBER, _is(1), "1"),
    "tfs_z": neutral(NUMBER, _is(1), "1"),
    "dynatemp_range": neutral(NUMBER, _is(0), "0"), "dynatemp_exponent": hint(NUMBER),
    "mirostat": neutral(INT, _is(0), "0"), "mirostat_tau": hint(NUMBER), "mirostat_eta": hint(NUMBER),
    "dry_multiplier": neutral(NUMBER, _is(0), "0"), "dry_base": hint(NUMBER), "dry_allowed_length": hint(INT),
    "dry_penalty_last_n": hint(INT), "dry_sequence_breakers": hint(LIST),
    "xtc_probability": neutral(NUMBER, _is(0), "0"), "xtc_threshold": hint(NUMBER),
    "min_keep": neutral(INT, lambda v: v <= 1, "0 or 1", greedy_noop=True),
    "samplers": off(), "lora": neutral(LIST, _empty, "empty"), "response_fields": off(),
    "t_max_predict_ms": neutral(INT, _is(0), "0"),
    "return_tokens": neutral(BOOL, _is(False), "false"),
    "id_slot": hint(INT), "timings_per_token": hint(BOOL), "return_progress": hint(BOOL),
    "post_sampling_probs": hint(BOOL), "sse_ping_interval": hint(NUMBER),
}

CHAT = {
    **COMMON,
    # OpenAI
    "functions": neutral(LIST, _empty, "empty: send tools"),
    "function_call": neutral(ANY, lambda v: v in NO_TOOL_CALLS, '"none", or "auto" with no functions: send tool_choice'),
    "modalities": neutral(LIST, lambda v: v == ["text"], '["text"]'),
    "reasoning_effort": off(), "prediction": off(), "audio": off(), "web_search_options": off(), "verbosity": off(),
    # vLLM
    "echo": neutral(BOOL, _is(False), "false"),
    "continue_final_message": neutral(BOOL, _is(False), "false"),
    "add_special_tokens": neutral(BOOL, _is(False), "false"),
    "documents": neutral(LIST, _empty, "empty"),
    "chat_template": off(STRING),
    "mm_processor_kwargs": neutral(OBJECT, _empty, "empty"), "media_io_kwargs": neutral(OBJECT, _empty, "empty"),
    # llama-server
    "reasoning_format": neutral(STRING, _is("none"), '"none": the reasoning stays in the content'),
}

COMPLETION = {
    **COMMON,
    # OpenAI
    "best_of": neutral(INT, _is(1), "1"),
    "suffix": neutral(STRING, _empty, "empty"),
    # vLLM
    "add_special_tokens": neutral(BOOL, _is(True), "true"),
}

TOKENIZE = {
    "continue_final_message": CHAT["continue_final_message"], "chat_template": CHAT["chat_template"],
    "tools": neutral(LIST, _empty, "empty"), "mm_processor_kwargs": CHAT["mm_processor_kwargs"],
}

CHAT_TEMPLATE_REFUSED = "a chat template in the request is not taken; start the server with --chat-template FILE"


class FieldError(ValueError):
    """A field refused: the message and the field's name (serve/protocol.py makes it a 400)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def check(body: dict, supported: set, known: dict, strict: bool) -> list[str]:
    """Check every field of `body` that is not `supported` (those the caller reads) against its rule in `known`;
    returns the unknown ones (ignored), or, `strict`, raises FieldError for the first. FieldError for a known field
    with a bad value or a value that asks for what this server lacks."""
    unknown = []
    greedy = _number(body.get("temperature")) and body["temperature"] == 0
    for name, value in body.items():
        if name in supported or value is None:
            continue
        rule = known.get(name)
        if rule is None:
            if strict:
                raise FieldError(f"unrecognized request argument: {name}", name)
            unknown.append(name)
            continue
        if not rule.valid(value):
            raise FieldError(f"{name} must be {rule.kind}, got {_shown(value)}", name)
        if rule.neutral is None or rule.neutral(value) or (rule.greedy_noop and greedy):
            continue
        if name == "chat_template":
            raise FieldError(CHAT_TEMPLATE_REFUSED, name)
        also = ", or any value at temperature 0" if rule.greedy_noop else ""
        raise FieldError(f"{name} is not supported by this server (only {rule.what}{also}), got {_shown(value)}",
                         name)
    return unknown


def named(fields: list[str], shown: int = SHOWN) -> str:
    """Field names as a header value: plain names as they are, others as JSON strings (ASCII, no line breaks), the
    first `shown` and how many more."""
    out = [f if PLAIN_NAME.fullmatch(f) else json.dumps(f[:64]) for f in fields[:shown]]
    if len(fields) > shown:
        out.append(f"and {len(fields) - shown} more")
    return ", ".join(out)


def _shown(value) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."
