"""The OpenAI API as this server speaks it: requests checked field by field into a `Job`, responses and stream chunks
built as the official client parses them, errors as OpenAI's error object. No web framework here.

A request field is either supported (model, messages/prompt, max_tokens, max_completion_tokens, temperature, top_p,
seed, stop, stream, stream_options, user, n, logit_bias, frequency_penalty, presence_penalty, logprobs and
top_logprobs (chat), logprobs and echo (completions); vLLM's `top_k`, `min_p`, `repetition_penalty`,
`stop_token_ids`, `ignore_eos`, `min_tokens`, `chat_template_kwargs` and `add_generation_prompt`), or known and
checked by serve/fields.py: accepted only at its neutral value (no tools, text responses, ...: clients such as
LangChain send them), a hint
accepted with any value, or an unknown field, accepted and named (`Job.ignored`: the X-Specexport-Ignored-Fields
header), or with serve --strict refused. A known field asking for something this server does not do is never
ignored; an unknown one is ignored only where the response says so.

/tokenize and /detokenize take vLLM's requests and give its answers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass, field

from specexport.errors import UserError, first_line
from specexport.runtime.generate import Engine, Generation
from specexport.runtime.grammar import Constraint
from specexport.runtime.sampling import MAX_TOP_LOGPROBS, SamplingParams
from specexport.serve import fields, logprobs
from specexport.serve.tools import Parser, ToolCall

MAX_STOPS = 16  # stop strings per request (OpenAI takes 4; each costs a search of the text held back)
MAX_STOP_CHARS = 256  # characters per stop string (the stream holds back the longest one's length)
ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
TOOL_CHOICES = ("none", "auto", "required")  # OpenAI's tool_choice strings (or a named function); "none": no calls
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's rule for a function's name
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


# structured output: OpenAI's response_format; vLLM's guided_* and structured_outputs; llama-server's json_schema and
# grammar; SGLang's regex and ebnf (one of them per request)
CONSTRAINT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                     "structured_outputs", "json_schema", "grammar", "regex", "ebnf")
SUPPORTED_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "stream",
                    "stream_options", "user", "n", "min_p", "logit_bias", "ignore_eos", "min_tokens",
                    "frequency_penalty", "presence_penalty", "repetition_penalty", *CONSTRAINT_FIELDS}
SUPPORTED_CHAT = SUPPORTED_COMMON | {"messages", "max_completion_tokens", "chat_template_kwargs",
                                     "add_generation_prompt", "logprobs", "top_logprobs", "tools", "tool_choice",
                                     "parallel_tool_calls"}
SUPPORTED_COMPLETION = SUPPORTED_COMMON | {"prompt", "logprobs", "echo"}
SUPPORTED_TOKENIZE = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                      "chat_template_kwargs", "return_token_strs"}
STREAM_OPTIONS = {"include_usage", "continuous_usage_stats", "include_obfuscation"}
RESERVED_TEMPLATE_NAMES = ("messages", "add_generation_prompt")  # what the server itself passes the template
MAX_STOP_IDS = 64
MAX_LOGIT_BIAS = 1024  # tokens a request may bias
MAX_N = 16  # choices per prompt (each is a sequence in the batch)


@dataclass
class Job:
    """A checked request: its prompts (chat messages, text or token ids; several for a completions list), how
    many tokens, how to sample, and how to answer. `ignored`: the fields it sent that this server does not know
    (serve/fields.py)."""

    chat: bool
    prompts: list
    max_tokens: int | None
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    model: str | None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False  # the model's end-of-sequence ids do not end it (stop_token_ids still do)
    template: dict = field(default_factory=dict)  # chat_template_kwargs: the chat template's variables
    add_generation_prompt: bool = True
    ignored: tuple[str, ...] = ()
    n: int = 1  # choices per prompt
    echo: bool = False  # completions: the prompt comes first in each choice's text (and logprobs)
    constraint_param: str | None = None  # the field that gave the sampling's constraint (structured output)
    tools: list = field(default_factory=list)  # OpenAI's {"type": "function", "function": {...}}, for the template
    tool_choice: str = "none"  # "none", "auto", "required", or the name of the function to call
    parallel_tool_calls: bool = True

    @property
    def calls_tools(self) -> bool:
        """Whether the answer is read for tool calls (tools given, and tool_choice not "none")."""
        return bool(self.tools) and self.tool_choice != TOOL_CHOICES[0]

    @property
    def logprobs(self) -> int | None:
        """The alternatives each token's logprob lists (None: no logprobs)."""
        return self.sampling.logprobs

    def choice_sampling(self, j: int) -> SamplingParams:
        """The sampling of a prompt's j-th choice: its own random stream where the request is seeded (seed + j), so
        that n seeded choices differ from each other and each is reproducible."""
        if j == 0 or self.sampling.seed is None:
            return self.sampling
        return dataclasses.replace(self.sampling, seed=(self.sampling.seed + j) % 2**63)


def chat_request(body: dict, strict: bool = False) -> Job:
    ignored = _check_fields(body, SUPPORTED_CHAT, fields.CHAT, strict)
    if "messages" not in body:
        raise bad("messages is required", "messages")
    given = [body.get("max_tokens"), body.get("max_completion_tokens")]
    if None not in given and given[0] != given[1]:
        raise bad("max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
    field_name = "max_completion_tokens" if given[1] is not None else "max_tokens"
    job = _job(body, True, [_messages(body["messages"])], field_name, ignored, strict)
    job.template, job.add_generation_prompt = _template_variables(body), _flag(body, "add_generation_prompt", True)
    job.tools, job.tool_choice = _tools(body.get("tools"), body.get("tool_choice"))
    job.parallel_tool_calls = _flag(body, "parallel_tool_calls", True)
    top = body.get("top_logprobs")
    if top is not None and (type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS):
        raise bad(f"top_logprobs must be an integer in 0..{MAX_TOP_LOGPROBS}, got {json.dumps(top)}", "top_logprobs")
    if _flag(body, "logprobs", False):
        job.sampling = dataclasses.replace(job.sampling, logprobs=top or 0)
    elif top:
        raise bad("top_logprobs needs logprobs: true", "top_logprobs")
    return job


def completion_request(body: dict, strict: bool = False) -> Job:
    ignored = _check_fields(body, SUPPORTED_COMPLETION, fields.COMPLETION, strict)
    if "prompt" not in body:
        raise bad("prompt is required", "prompt")
    job = _job(body, False, _prompts(body["prompt"]), "max_tokens", ignored, strict)
    top, job.echo = body.get("logprobs"), _flag(body, "echo", False)
    if top is not None:
        if type(top) is not int or not 0 <= top <= MAX_TOP_LOGPROBS:
            raise bad(f"logprobs must be an integer in 0..{MAX_TOP_LOGPROBS} (the alternatives listed per token), "
                      f"got {json.dumps(top)}", "logprobs")
        job.sampling = dataclasses.replace(job.sampling, logprobs=top, prompt_logprobs=top if job.echo else None)
        if job.echo and job.stream:
            raise bad("echo with logprobs is answered whole: send stream false (or drop logprobs)", "echo")
    return job


def _check_fields(body: dict, supported: set, known: dict, strict: bool) -> list[str]:
    """The fields of `body` that this server does not know (ignored); a 400 for a known one it cannot honour, or for
    an unknown one when `strict` (serve/fields.py)."""
    try:
        return fields.check(body, supported, known, strict)
    except fields.FieldError as e:
        raise bad(str(e), e.param) from None


def _tools(tools, choice) -> tuple[list, str]:
    """OpenAI's tools ([{"type": "function", "function": {"name", "description", "parameters", "strict"}}]) checked,
    and tool_choice: "none", "auto" (the default with tools), "required", or {"type": "function", "function": {"name":
    ...}} (returned as the name)."""
    tools = tools or []
    if not isinstance(tools, list):
        raise bad("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    names = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(function, dict):
            raise bad(f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}', where)
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad(f"{where}.function.name must be 1 to 64 letters, digits, _, . or -", where)
        if name in names:
            raise bad(f"{where}: two tools are named {name}", where)
        names.append(name)
        if function.get("parameters") is not None and not isinstance(function["parameters"], dict):
            raise bad(f"{where}.function.parameters must be a JSON schema (an object)", where)
        if function.get("description") is not None and not isinstance(function["description"], str):
            raise bad(f"{where}.function.description must be a string", where)
    if choice is None:
        return tools, "auto" if tools else TOOL_CHOICES[0]
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise bad(f'tool_choice must be "none", "auto", "required" or a function, got {json.dumps(choice)[:40]}',
                      "tool_choice")
        if choice == "required" and not tools:
            raise bad('tool_choice "required" needs tools', "tool_choice")
        return tools, choice
    named = choice.get("function", {}).get("name") if isinstance(choice, dict) and choice.get("type") == "function" \
        and isinstance(choice.get("function"), dict) else None
    if not isinstance(named, str):
        raise bad('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
                  "tool_choice")
    if named not in names:
        raise bad(f"tool_choice names {named}, which is not among the tools", "tool_choice")
    return tools, named


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(f"{name} must be a boolean, got {json.dumps(value)}", name)
    return value


def _template_variables(body: dict) -> dict:
    """chat_template_kwargs: an object whose entries become the chat template's variables (Qwen3's enable_thinking)."""
    variables = body.get("chat_template_kwargs")
    if variables is None:
        return {}
    if not isinstance(variables, dict):
        raise bad("chat_template_kwargs must be an object (the chat template's variables)", "chat_template_kwargs")
    taken = [name for name in RESERVED_TEMPLATE_NAMES if name in variables]
    if taken:
        raise bad(f"chat_template_kwargs must not set {taken[0]} (the server passes it; add_generation_prompt is a "
                  f"field of its own)", "chat_template_kwargs")
    return dict(variables)


def _job(body: dict, chat: bool, prompts: list, max_field: str, ignored: list[str], strict: bool) -> Job:
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
        if not isinstance(options, dict):
            raise bad("stream_options must be an object", "stream_options")
        for name in options:
            if name not in STREAM_OPTIONS:
                if strict:
                    raise bad(f"unrecognized request argument: stream_options.{name}", "stream_options")
                ignored.append(f"stream_options.{name}")
        for name in ("include_usage", "continuous_usage_stats", "include_obfuscation"):
            if options.get(name) is not None and not isinstance(options[name], bool):
                raise bad(f"stream_options.{name} must be a boolean", "stream_options")
        if options.get("continuous_usage_stats"):
            raise bad("stream_options.continuous_usage_stats is not supported by this server (only false; "
                      "include_usage gives the usage in the last chunk)", "stream_options")
    max_tokens = body.get(max_field)
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise bad(f"{max_field} must be an integer >= 1, got {json.dumps(max_tokens)}", max_field)
    n = body.get("n")
    if n is not None and (type(n) is not int or not 1 <= n <= MAX_N):
        raise bad(f"n must be an integer in 1..{MAX_N}, got {json.dumps(n)}", "n")
    ignore_eos, stop_token_ids = _flag(body, "ignore_eos", False), _stop_ids(body.get("stop_token_ids"))
    constraint, constraint_param = _constraint(body)
    sampling = dataclasses.replace(_sampling(body), constraint=constraint)
    if max_tokens is not None and sampling.min_tokens > max_tokens:
        raise bad(f"min_tokens must be <= {max_field} ({max_tokens}), got {sampling.min_tokens}", "min_tokens")
    return Job(chat, prompts, max_tokens, sampling, _stops(body.get("stop")), bool(stream),
               bool((options or {}).get("include_usage")), model, stop_token_ids, ignore_eos,
               ignored=tuple(ignored), n=n or 1, constraint_param=constraint_param)


def _stop_ids(ids) -> tuple[int, ...]:
    """stop_token_ids (vLLM's): token ids that end the generation as the end-of-sequence token does."""
    if ids is None:
        return ()
    if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise bad("stop_token_ids must be a list of token ids (integers >= 0)", "stop_token_ids")
    if len(ids) > MAX_STOP_IDS:
        raise bad(f"stop_token_ids takes at most {MAX_STOP_IDS} ids, got {len(ids)}", "stop_token_ids")
    return tuple(sorted(set(ids)))


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
    min_p = _number(body, "min_p", 0.0)
    if not 0 <= min_p <= 1:
        raise bad(f"min_p must be in [0, 1], got {min_p:g}", "min_p")
    penalties = {name: _number(body, name, 0.0) for name in ("frequency_penalty", "presence_penalty")}
    for name, value in penalties.items():
        if not -2 <= value <= 2:
            raise bad(f"{name} must be in [-2, 2], got {value:g}", name)
    repetition = _number(body, "repetition_penalty", 1.0)
    if not 0 < repetition <= 2:
        raise bad(f"repetition_penalty must be in (0, 2], got {repetition:g}", "repetition_penalty")
    min_tokens = body.get("min_tokens")
    if min_tokens is not None and (type(min_tokens) is not int or min_tokens < 0):
        raise bad(f"min_tokens must be an integer >= 0, got {json.dumps(min_tokens)}", "min_tokens")
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=max(top_k or 0, 0), seed=seed, min_p=min_p,
                          logit_bias=_logit_bias(body.get("logit_bias")), repetition_penalty=repetition,
                          min_tokens=min_tokens or 0, **penalties)


def _constraint(body: dict) -> tuple[Constraint | None, str | None]:
    """The grammar the output must follow and the field that gave it, from whichever structured-output field the
    request uses (at most one; response_format {"type": "text"} and an empty llama-server grammar ask for none).
    Whether it compiles is checked when the request is prepared (serve/app.py), also a 400."""
    given = [name for name in CONSTRAINT_FIELDS if body.get(name) not in (None, "")
             and body.get(name) != {"type": "text"}]
    if not given:
        return None, None
    if len(given) > 1:
        raise bad(f"send one structured-output field, got {' and '.join(given)}", given[1])
    name = given[0]
    return _constraint_in(name, body[name]), name


def _constraint_in(name: str, value) -> Constraint | None:
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        if not isinstance(value, dict) or len([k for k, v in value.items() if v not in (None, False)]) != 1:
            raise bad("structured_outputs must be an object with one of json, regex, choice, grammar, json_object",
                      name)
        key, inner = next((k, v) for k, v in value.items() if v not in (None, False))
        if key == "json_object":
            return Constraint.json_object()
        if key not in ("json", "regex", "choice", "grammar"):
            raise bad(f"structured_outputs.{key} is not supported (json, regex, choice, grammar, json_object)", name)
        return _constraint_of(key, inner, f"{name}.{key}")
    kind = {"guided_json": "json", "json_schema": "json", "guided_regex": "regex", "regex": "regex",
            "guided_choice": "choice", "guided_grammar": "grammar", "grammar": "grammar", "ebnf": "grammar"}[name]
    return _constraint_of(kind, value, name)


def _constraint_of(kind: str, value, param: str) -> Constraint:
    """json: a schema (an object, or its JSON text); regex and grammar (Lark or GBNF): text; choice: a list of
    strings."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise bad(f"{param} is not valid JSON: {e.msg}", param) from None
        if not isinstance(value, (dict, bool)):
            raise bad(f"{param} must be a JSON schema (an object)", param)
        return Constraint.json_schema(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
            raise bad(f"{param} must be a non-empty list of strings", param)
        return Constraint.choice(value)
    if not isinstance(value, str):
        raise bad(f"{param} must be a string", param)
    return Constraint(kind, value)


def _response_format(value) -> Constraint | None:
    """OpenAI's response_format: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema", "json_schema":
    {"name", "schema", "strict", "description"}}."""
    param = "response_format"
    if not isinstance(value, dict) or "type" not in value:
        raise bad('response_format must be an object with a "type": text, json_object or json_schema', param)
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint.json_object()
    if kind != "json_schema":
        raise bad(f"response_format.type must be text, json_object or json_schema, got {json.dumps(kind)[:40]}", param)
    spec = value.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema"), (dict, bool)):
        raise bad('response_format json_schema needs "json_schema": {"name": ..., "schema": {...}}', param)
    return Constraint.json_schema(spec["schema"])


def _logit_bias(biases) -> tuple[tuple[int, float], ...]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}, added to those tokens' logits."""
    if biases is None:
        return ()
    if not isinstance(biases, dict):
        raise bad("logit_bias must be an object of token ids (as strings) to biases", "logit_bias")
    if len(biases) > MAX_LOGIT_BIAS:
        raise bad(f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(biases)}", "logit_bias")
    out = []
    for key, bias in biases.items():
        if not (key.isascii() and key.isdigit()):
            raise bad(f"logit_bias keys must be token ids (integers >= 0, as strings), got {json.dumps(key[:40])}",
                      "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
            raise bad(f"logit_bias values must be numbers in [-100, 100], got {json.dumps(bias)} for token {key}",
                      "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(sorted(out))


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
    """The chat template's messages from OpenAI's: {"role", "content"[, "name"]}, a tool's result with its
    "tool_call_id", an assistant's "tool_calls" with their arguments as objects (as templates read them)."""
    if not isinstance(messages, list) or not messages:
        raise bad("messages must be a non-empty list", "messages")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise bad(f"{where} must be an object", where)
        role = message.get("role")
        if role == "function":
            raise bad(f"{where}: function messages are not supported (send tool messages, with tool_call_id)", where)
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {json.dumps(role)}", f"{where}.role")
        allowed = {"role", "content", "name"} | ({"tool_calls"} if role == "assistant" else set()) | \
            ({"tool_call_id"} if role == "tool" else set())
        for key, value in message.items():
            if key not in allowed and value not in (None, [], {}):
                raise bad(f"{where}.{key} is not supported by this server", f"{where}.{key}")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise bad(f"{where}.name must be a string", f"{where}.name")
        calls = _history_calls(message.get("tool_calls"), where) if role == "assistant" else []
        content = message.get("content")
        entry = {"role": ROLES[role], "content": "" if calls and content in (None, "") else
                 _content(content, f"{where}.content")}
        if calls:
            entry["tool_calls"] = calls
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise bad(f"{where}.tool_call_id must be the id of the call this answers", f"{where}.tool_call_id")
            entry["tool_call_id"] = message["tool_call_id"]
        if name is not None:
            entry["name"] = name
        out.append(entry)
    return out


def _history_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls for the template: {"id", "type", "function": {"name", "arguments"}}, the
    arguments parsed from their JSON text."""
    if calls in (None, []):
        return []
    if not isinstance(calls, list):
        raise bad(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for k, call in enumerate(calls):
        here = f"{where}.tool_calls[{k}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f'{here} must be {{"id", "type": "function", "function": {{"name", "arguments"}}}}', here)
        arguments = function.get("arguments", "{}")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            raise bad(f"{here}.function.arguments must be JSON text", here) from None
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": function["name"], "arguments": arguments}})
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
def render_chat(engine: Engine, messages: list[dict], add_generation_prompt: bool = True,
                variables: dict | None = None) -> str:
    """The chat template's text for `messages` (the bundle's template, or serve --chat-template's), with
    `variables` (chat_template_kwargs); a 400 when there is no template or it fails on these messages."""
    tokenizer = engine.tokenizer
    if not tokenizer.has_chat_template:
        raise bad("this model has no chat template; use /v1/completions", "messages")
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt, **(variables or {}))
    except UserError as e:
        raise bad(first_line(e), "messages") from None
    except Exception as e:  # noqa: BLE001 - a template's own fault (a TypeError on a variable's value, ...)
        raise bad(f"chat template: {type(e).__name__}: {first_line(e)}", "messages") from None


def prompt_ids(engine: Engine, job: Job, prompt) -> list[int]:
    """The prompt's token ids, checked against the context: 400 when it, plus max_tokens, does not fit."""
    param = "messages" if job.chat else "prompt"
    if job.chat:
        variables = {**job.template, **({"tools": job.tools} if job.tools else {})}
        text = render_chat(engine, prompt, job.add_generation_prompt, variables)
        prompt = engine.tokenizer.encode(text, add_special_tokens=False)  # the template writes any BOS
    try:
        ids = engine.encode(prompt, chat=False)
    except UserError as e:
        raise bad(first_line(e), param) from None
    if job.max_tokens is not None and len(ids) + job.max_tokens > engine.max_context:
        raise bad(f"this model's maximum context length is {engine.max_context} tokens; the prompt has {len(ids)} "
                  f"and max_tokens asks for {job.max_tokens} more", "max_tokens")
    return ids


def stop_ids(engine: Engine, job: Job) -> tuple[int, ...] | None:
    """The token ids that end the job's generations: the model's end-of-sequence ids (unless ignore_eos) and its
    stop_token_ids (None: the model's alone); the job's token ids checked against the vocabulary."""
    vocab = engine.bundle.manifest["model"]["vocab"]
    for name, ids in (("stop_token_ids", job.stop_token_ids), ("logit_bias", [t for t, _ in job.sampling.logit_bias])):
        if ids and max(ids) >= vocab:
            raise bad(f"{name}: token ids must be in 0..{vocab - 1}, got {max(ids)}", name)
    if job.ignore_eos:
        return job.stop_token_ids
    if not job.stop_token_ids:
        return None
    return tuple(sorted(engine.tokenizer.eos_token_ids | set(job.stop_token_ids)))


# -- /tokenize and /detokenize (vLLM's shapes) ---------------------------------------------------------
@dataclass
class Tokenize:
    """A checked /tokenize request: a text `prompt`, or chat `messages` rendered by the chat template."""

    model: str | None
    prompt: str | None
    messages: list | None
    add_special_tokens: bool
    add_generation_prompt: bool
    template: dict
    token_strs: bool
    ignored: tuple[str, ...]


def tokenize_request(body: dict, strict: bool = False) -> Tokenize:
    ignored = _check_fields(body, SUPPORTED_TOKENIZE, fields.TOKENIZE, strict)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise bad("send prompt (a text) or messages (a chat), one of them", "prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise bad("prompt must be a string", "prompt")
    chat = messages is not None
    return Tokenize(model, prompt, _messages(messages) if chat else None,
                    _flag(body, "add_special_tokens", not chat), _flag(body, "add_generation_prompt", True),
                    _template_variables(body), _flag(body, "return_token_strs", False), tuple(ignored))


def tokenize(engine: Engine, request: Tokenize) -> dict:
    """{"count", "max_model_len", "tokens"[, "token_strs"]}: the ids /v1/completions (a prompt) or
    /v1/chat/completions (messages, add_special_tokens false) computes for it, whatever their length."""
    tokenizer = engine.tokenizer
    text = request.prompt if request.messages is None else \
        render_chat(engine, request.messages, request.add_generation_prompt, request.template)
    ids = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
    out = {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids}
    if request.token_strs:
        out["token_strs"] = [tokenizer.backend.id_to_token(i) for i in ids]
    return out


def detokenize_request(body: dict, strict: bool = False) -> tuple[str | None, list[int], tuple[str, ...]]:
    """(model, tokens, ignored fields) of a /detokenize request."""
    ignored = _check_fields(body, {"model", "tokens"}, {}, strict)
    model, tokens = body.get("model"), body.get("tokens")
    if model is not None and not isinstance(model, str):
        raise bad("model must be a string", "model")
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise bad("tokens must be a list of token ids (integers)", "tokens")
    return model, tokens, tuple(ignored)


def detokenize(engine: Engine, tokens: list[int]) -> dict:
    """{"prompt": the text of `tokens`}, special tokens included (what /tokenize's ids were)."""
    vocab = engine.bundle.manifest["model"]["vocab"]
    wrong = next((t for t in tokens if not 0 <= t < vocab), None)
    if wrong is not None:
        raise bad(f"tokens must be in 0..{vocab - 1}, got {wrong}", "tokens")
    return {"prompt": engine.tokenizer.decode(tokens, skip_special_tokens=False)}


# -- responses ---------------------------------------------------------------------------------------
def outcome(result: Generation | None) -> str:
    """How a request ended, as metrics and logs name it: stop, length, abort (cancelled) or error (no result)."""
    if result is None:
        return "error"
    return "abort" if result.stop_reason == "cancelled" else FINISH[result.stop_reason]


def usage(results: list[Generation], n: int = 1) -> dict:
    """OpenAI's usage (prompt_tokens_details.cached_tokens: the prompt tokens copied from the prefix cache, not
    computed: runtime/prefix.py), with the speculation's figures under EXTRAS_KEY: target steps, tokens per step
    (tau), draft tokens verified and accepted. `results` come n choices per prompt, whose prompt counts once."""
    groups = [results[i:i + n] for i in range(0, len(results), n)]
    prompt = sum(g[0].stats.prompt_tokens for g in groups)
    completion = sum(r.stats.new_tokens for r in results)
    steps = sum(r.stats.steps for r in results)
    accept_lengths = [k for r in results for k in r.stats.accept_lengths]
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(max(r.stats.cached_tokens for r in g) for g in groups)},
            EXTRAS_KEY: {"steps": steps, "tau": round(sum(accept_lengths) / len(accept_lengths), 3)
                         if accept_lengths else 0.0,
                         "draft_tokens": sum(r.stats.drafted for r in results),
                         "accepted_tokens": sum(r.stats.accepted for r in results)}}


@dataclass(frozen=True)
class Prompt:
    """A completion prompt as its choices echo it: its text (as sent, or its ids' text) and its token ids."""

    text: str
    ids: list[int]


def echo_prompts(engine: Engine, job: Job, prompts: list[list[int]]) -> list[Prompt]:
    """What each prompt's choices echo (empty unless the job asks for echo)."""
    if not job.echo:
        return []
    return [Prompt(p if isinstance(p, str) else engine.tokenizer.decode(ids, skip_special_tokens=False), ids)
            for p, ids in zip(job.prompts, prompts)]


def answer(job: Job, result: Generation, parser: Parser | None) -> tuple[str | None, list[ToolCall], str]:
    """A chat choice's content, its tool calls (read by `parser` where the job calls tools) and its finish reason
    ("tool_calls" where it made some)."""
    finish = FINISH[result.stop_reason]
    if not job.calls_tools or parser is None:
        return result.text, [], finish
    content, calls = parser.parse(result.text)
    return content, calls, "tool_calls" if calls and finish == "stop" else finish


def completion(job: Job, rid: str, created: int, model: str, results: list[Generation],
               texts: logprobs.Texts | None = None, echoed: list[Prompt] | None = None,
               parser: Parser | None = None) -> dict:
    """The whole response: one choice per result (n per prompt, in order), each with its logprobs where asked
    (`texts`: the tokens' text), for an echoing completion its prompt first (`echoed`, one per prompt), and for a
    chat that calls tools its calls as `parser` reads them."""
    choices = []
    for i, r in enumerate(results):
        if job.chat:
            content, calls, finish = answer(job, r, parser)
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = [c.as_openai() for c in calls]
            choices.append({"index": i, "message": message, "finish_reason": finish,
                            "logprobs": logprobs.chat(texts, r.logprobs) if r.logprobs is not None else None})
            continue
        prompt = echoed[i // job.n] if echoed else None
        scored = list(zip(r.logprobs, r.tokens)) if r.logprobs is not None else None
        if prompt is not None and scored is not None:
            scored = list(zip(r.prompt_logprobs, prompt.ids)) + scored
        choices.append({"index": i, "text": (prompt.text if prompt else "") + r.text,
                        "logprobs": logprobs.completion(texts, scored) if scored is not None else None,
                        "finish_reason": FINISH[r.stop_reason]})
    return {"id": rid, "object": "chat.completion" if job.chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": usage(results, job.n), "system_fingerprint": None}


def chunk(job: Job, rid: str, created: int, model: str, index: int, text: str | None = None, role: bool = False,
          finish: str | None = None, scores: dict | None = None, calls: list[ToolCall] = ()) -> dict:
    """One stream event's object: a piece of text of choice `index` (the first chat chunk carries the role), or its
    end (`finish`, no text), or the logprobs of the tokens a step emitted (`scores`: the choice's logprobs object for
    them, serve/logprobs.py), in a chunk of its own: the text is held back where a stop string may begin, the
    logprobs are not."""
    if job.chat:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text is not None else {})
        if calls:
            delta["tool_calls"] = [c.as_openai(k) for k, c in enumerate(calls)]
        choice = {"index": index, "delta": delta, "logprobs": scores, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": scores, "finish_reason": finish}
    event = {"id": rid, "object": "chat.completion.chunk" if job.chat else "text_completion", "created": created,
             "model": model, "choices": [choice], "system_fingerprint": None}
    if job.include_usage:
        event["usage"] = None
    return event


def usage_chunk(job: Job, rid: str, created: int, model: str, results: list[Generation]) -> dict:
    return {"id": rid, "object": "chat.completion.chunk" if job.chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage(results, job.n), "system_fingerprint": None}
