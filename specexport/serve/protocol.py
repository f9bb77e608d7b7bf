"""The OpenAI API as this server speaks it: requests checked field by field into a `Job`, responses and stream chunks
built as the official client parses them, errors as OpenAI's error object. No web framework here.

A request field is either supported (model, messages/prompt, max_tokens, max_completion_tokens, temperature, top_p,
seed, stop, stream, stream_options, user, and our `top_k`), accepted only at its neutral value (n 1, no logprobs,
zero penalties, no tools, text responses, ...: clients such as LangChain send them), or refused with a 400 naming it.
A field asking for something this server does not do is never silently ignored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from specexport.errors import UserError, first_line
from specexport.runtime.generate import Engine, Generation
from specexport.runtime.sampling import SamplingParams

MAX_STOPS = 16  # stop strings per request (OpenAI takes 4; each costs a search of the text held back)
MAX_STOP_CHARS = 256  # characters per stop string (the stream holds back the longest one's length)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
# finish reasons by the runtime's stop reasons
FINISH = {"eos": "stop", "stop_string": "stop", "length": "length", "context": "length"}
EXTRAS_KEY = "specexport"  # the one key under which responses carry what OpenAI's objects have no field for

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error",
               429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    """A request refused: its HTTP status and OpenAI's error object (message, type, param, code)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param)


# -- bodies ------------------------------------------------------------------------------------------
def parse_body(raw: bytes, content_type: str | None) -> dict:
    """The JSON object of a POST body (400 for anything else; 415 for a content type that is not JSON)."""
    kind = (content_type or "").split(";")[0].strip().lower()
    if kind and kind != "application/json" and not kind.endswith("+json"):
        raise ApiError(415, f"the body must be JSON: send Content-Type: application/json (got {kind})")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise bad("the body is not UTF-8 text") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise bad(f"the body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(body, dict):
        raise bad("the body must be a JSON object")
    return body


# -- neutral values of the fields we do not support --------------------------------------------------
def _none(v) -> bool:
    return v is None


def _false(v) -> bool:
    return v is None or v is False


def _one(v) -> bool:
    return v is None or (type(v) is int and v == 1)


def _zero(v) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v == 0)


def _empty(v) -> bool:
    return v is None or v == [] or v == {}


def _anything(v) -> bool:  # tags that ask for no behaviour (metadata, cache keys)
    return True


NO_TOOL_CALLS = {None, "none", "auto"}  # tool_choice values that ask for no call (auto, with no tools given)
NEUTRAL_COMMON = {
    "n": (_one, "1"), "frequency_penalty": (_zero, "0"), "presence_penalty": (_zero, "0"),
    "logit_bias": (_empty, "empty"), "metadata": (_anything, ""), "store": (_false, "false"),
    "service_tier": (lambda v: v in (None, "auto", "default"), "auto"),
    "prompt_cache_key": (_anything, ""), "safety_identifier": (_anything, ""),
}
NEUTRAL_CHAT = {
    **NEUTRAL_COMMON,
    "logprobs": (_false, "false"), "top_logprobs": (lambda v: v is None or (type(v) is int and v == 0), "0"),
    "tools": (_empty, "empty"), "functions": (_empty, "empty"),
    "tool_choice": (lambda v: v in NO_TOOL_CALLS, "none"),
    "function_call": (lambda v: v in NO_TOOL_CALLS, "none"),
    "parallel_tool_calls": (lambda v: v is None or isinstance(v, bool), "a boolean"),
    "response_format": (lambda v: v is None or v == {"type": "text"}, '{"type": "text"}'),
    "modalities": (lambda v: v is None or v == ["text"], '["text"]'),
    "reasoning_effort": (_none, "null"), "prediction": (_none, "null"), "audio": (_none, "null"),
    "web_search_options": (_none, "null"), "verbosity": (_none, "null"),
}
NEUTRAL_COMPLETION = {
    **NEUTRAL_COMMON,
    "best_of": (_one, "1"), "logprobs": (_none, "null"), "echo": (_false, "false"),
    "suffix": (lambda v: v is None or v == "", "empty"),
}
SUPPORTED_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
                    "stream_options", "user"}
SUPPORTED_CHAT = SUPPORTED_COMMON | {"messages", "max_completion_tokens"}
SUPPORTED_COMPLETION = SUPPORTED_COMMON | {"prompt"}


@dataclass
class Job:
    """A checked request: its prompts (chat messages, text or token ids; several for a completions list), how
    many tokens, how to sample, and how to answer."""

    chat: bool
    prompts: list
    max_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    model: str | None


def chat_request(body: dict) -> Job:
    _check_fields(body, SUPPORTED_CHAT, NEUTRAL_CHAT)
    if "messages" not in body:
        raise bad("messages is required", "messages")
    given = [body.get("max_tokens"), body.get("max_completion_tokens")]
    if None not in given and given[0] != given[1]:
        raise bad("max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
    field = "max_completion_tokens" if given[1] is not None else "max_tokens"
    return _job(body, True, [_messages(body["messages"])], field)


def completion_request(body: dict) -> Job:
    _check_fields(body, SUPPORTED_COMPLETION, NEUTRAL_COMPLETION)
    if "prompt" not in body:
        raise bad("prompt is required", "prompt")
    return _job(body, False, _prompts(body["prompt"]), "max_tokens")


def _check_fields(body: dict, supported: set, neutral: dict) -> None:
    for name, value in body.items():
        if name in supported:
            continue
        if name not in neutral:
            raise bad(f"unrecognized request argument: {name}", name)
        ok, what = neutral[name]
        if not ok(value):
            raise bad(f"{name} is not supported by this server (only {what})" if what else
                      f"{name} is not supported by this server", name)


def _job(body: dict, chat: bool, prompts: list, max_field: str) -> Job:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    if body.get("user") is not None and not isinstance(body["user"], str):
        raise bad("user must be a string", "user")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad("stream must be a boolean", "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise bad("stream_options takes include_usage only", "stream_options")
        if options.get("continuous_usage_stats"):
            raise bad("stream_options.continuous_usage_stats is not supported by this server", "stream_options")
        if not isinstance(options.get("include_usage", False), bool):
            raise bad("stream_options.include_usage must be a boolean", "stream_options")
    max_tokens = body.get(max_field)
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise bad(f"{max_field} must be an integer >= 1, got {json.dumps(max_tokens)}", max_field)
    return Job(chat, prompts, max_tokens, _sampling(body), _stops(body.get("stop")), bool(stream),
               bool((options or {}).get("include_usage")), model)


def _number(body: dict, name: str, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad(f"{name} must be a finite number, got {json.dumps(value)}", name)
    return float(value)


def _sampling(body: dict) -> SamplingParams:
    temperature = _number(body, "temperature", 1.0)  # OpenAI's default; 0 is greedy
    if not 0 <= temperature <= 2:
        raise bad(f"temperature must be in [0, 2], got {temperature:g}", "temperature")
    top_p = _number(body, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise bad(f"top_p must be in (0, 1], got {top_p:g}", "top_p")
    top_k = body.get("top_k")
    if top_k is not None and (type(top_k) is not int or top_k < -1):
        raise bad(f"top_k must be an integer >= 0 (0 or -1: off), got {json.dumps(top_k)}", "top_k")
    seed = body.get("seed")
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
        raise bad(f"seed must be an integer in [0, 2^63), got {json.dumps(seed)}", "seed")
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=max(top_k or 0, 0), seed=seed)


def _stops(stop) -> tuple[str, ...]:
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("stop must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOPS:
        raise bad(f"stop takes at most {MAX_STOPS} strings, got {len(stops)}", "stop")
    if any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise bad(f"each stop string must have 1 to {MAX_STOP_CHARS} characters", "stop")
    return tuple(stops)


def _messages(messages) -> list[dict]:
    """The chat template's messages ({"role", "content"[, "name"]}) from OpenAI's."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"{where} must be an object", where)
        role = message.get("role")
        if role in ("tool", "function"):
            raise bad(f"{where}: {role} messages are not supported (this server does not call tools)", where)
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {json.dumps(role)}", f"{where}.role")
        for key, value in message.items():
            if key not in ("role", "content", "name") and not _empty(value):
                raise bad(f"{where}.{key} is not supported by this server", f"{where}.{key}")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise bad(f"{where}.name must be a string", f"{where}.name")
        entry = {"role": ROLES[role], "content": _content(message.get("content"), f"{where}.content")}
        if name is not None:
            entry["name"] = name
        out.append(entry)
    return out


def _content(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"{where}: only text parts are supported ({{\"type\": \"text\", \"text\": ...}})", where)
            texts.append(part["text"])
        return "\n".join(texts)
    raise bad(f"{where} must be a string or a list of text parts", where)


def _prompts(prompt) -> list:
    """A completions prompt: a string, a list of token ids, or a non-empty list of either (one choice each)."""
    def token_list(v) -> bool:
        return isinstance(v, list) and bool(v) and all(type(t) is int for t in v)

    if isinstance(prompt, str) or token_list(prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) or token_list(p) for p in prompt):
        return list(prompt)
    raise bad("prompt must be a string, a list of token ids, or a non-empty list of either", "prompt")


# -- prompts to token ids ----------------------------------------------------------------------------
def prompt_ids(engine: Engine, job: Job, prompt) -> list[int]:
    """The prompt's token ids, checked against the context: 400 when it, plus max_tokens, does not fit."""
    param = "messages" if job.chat else "prompt"
    try:
        if job.chat:
            if not engine.tokenizer.has_chat_template:
                raise UserError("this model has no chat template; use /v1/completions")
            ids = engine.encode(engine.tokenizer.encode_chat(prompt), chat=False)
        else:
            ids = engine.encode(prompt, chat=False)
    except UserError as e:
        raise bad(first_line(e), param) from None
    if job.max_tokens is not None and len(ids) + job.max_tokens > engine.max_context:
        raise bad(f"this model's maximum context length is {engine.max_context} tokens; the prompt has {len(ids)} "
                  f"and max_tokens asks for {job.max_tokens} more", "max_tokens")
    return ids


# -- responses ---------------------------------------------------------------------------------------
def outcome(result: Generation | None) -> str:
    """How a request ended, as metrics and logs name it: stop, length, abort (cancelled) or error (no result)."""
    if result is None:
        return "error"
    return "abort" if result.stop_reason == "cancelled" else FINISH[result.stop_reason]


def usage(results: list[Generation]) -> dict:
    """OpenAI's usage, with the speculation's figures under EXTRAS_KEY: target steps, tokens per step (tau),
    draft tokens verified and accepted."""
    prompt = sum(r.stats.prompt_tokens for r in results)
    completion = sum(r.stats.new_tokens for r in results)
    steps = sum(r.stats.steps for r in results)
    accept_lengths = [n for r in results for n in r.stats.accept_lengths]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            EXTRAS_KEY: {"steps": steps, "tau": round(sum(accept_lengths) / len(accept_lengths), 3)
                         if accept_lengths else 0.0,
                         "draft_tokens": sum(r.stats.drafted for r in results),
                         "accepted_tokens": sum(r.stats.accepted for r in results)}}


def completion(job: Job, rid: str, created: int, model: str, results: list[Generation]) -> dict:
    if job.chat:
        choices = [{"index": i, "message": {"role": "assistant", "content": r.text}, "logprobs": None,
                    "finish_reason": FINISH[r.stop_reason]} for i, r in enumerate(results)]
    else:
        choices = [{"index": i, "text": r.text, "logprobs": None, "finish_reason": FINISH[r.stop_reason]}
                   for i, r in enumerate(results)]
    return {"id": rid, "object": "chat.completion" if job.chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage(results), "system_fingerprint": None}


def chunk(job: Job, rid: str, created: int, model: str, index: int, text: str | None = None, role: bool = False,
          finish: str | None = None) -> dict:
    """One stream event's object: a piece of text of choice `index` (the first chat chunk carries the role), or its
    end (`finish`, no text)."""
    if job.chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish}
    event = {"id": rid, "object": "chat.completion.chunk" if job.chat else "text_completion", "created": created,
             "model": model, "choices": [choice], "system_fingerprint": None}
    if job.include_usage:
        event["usage"] = None
    return event


def usage_chunk(job: Job, rid: str, created: int, model: str, results: list[Generation]) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if job.chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(results), "system_fingerprint": None}
