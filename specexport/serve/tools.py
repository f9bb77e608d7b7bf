"""Tool calling: how a model family writes its tool calls, read back from its text (`Parser.parse`) and, where the
request forces a call (tool_choice "required" or a named function), made the only thing it can write
(`Parser.constraint`: a grammar for runtime/grammar.py, so the call is valid JSON with the function's parameters).

One parser per template family, in a registry as the methods are, chosen from the chat template's text (the markers
it writes) or by `serve --tool-call-parser`:

- hermes (Hermes, Qwen 2.5 and 3, SmolLM3, ...): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one
  block per call;
- llama3_json (Llama 3.1 to 3.3's JSON calls): `{"name": ..., "parameters": {...}}`, calls separated by "; ";
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.

E.g. hermes parses 'Let me look.<tool_call>\\n{"name": "weather", "arguments": {"city": "Oslo"}}\\n</tool_call>' into
the content "Let me look." and one call weather({"city": "Oslo"}).
"""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass

from specexport.runtime.grammar import JSON_LAYOUT, Constraint


@dataclass(frozen=True)
class ToolCall:
    """One call as OpenAI's response gives it: its id, the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str

    @classmethod
    def of(cls, name: str, arguments) -> "ToolCall":
        text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        return cls(name, text, "call_" + secrets.token_hex(12))

    def as_openai(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def _call_schema(tool: dict, arguments: str) -> dict:
    """A JSON schema of one call of `tool` (OpenAI's {"type": "function", "function": {...}}), its arguments under
    the key `arguments` (or the family's name for it)."""
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, arguments: parameters},
            "required": ["name", arguments], "additionalProperties": False}


def _calls_schema(tools: list[dict], only: str | None, arguments: str) -> dict:
    chosen = [t for t in tools if only is None or t["function"]["name"] == only]
    schemas = [_call_schema(t, arguments) for t in chosen]
    return {**(schemas[0] if len(schemas) == 1 else {"anyOf": schemas}), "x-guidance": JSON_LAYOUT}


def _json_objects(text: str) -> list | None:
    """The JSON values `text` holds one after another (separated by whitespace or ";"), or None if it holds other
    text."""
    decoder, values, k = json.JSONDecoder(), [], 0
    while True:
        while k < len(text) and text[k] in " \t\r\n;":
            k += 1
        if k == len(text):
            return values
        try:
            value, k = decoder.raw_decode(text, k)
        except json.JSONDecodeError:
            return None
        values.append(value)


class Parser:
    """A family's tool-call format: `parse(text)` -> (content or None, calls); `constraint(tools, only, parallel)`:
    the grammar that makes the model write one call (of `only`, or of any of `tools`), or several where `parallel`."""

    name = ""
    markers: tuple[str, ...] = ()  # what a chat template of this family writes

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def constraint(self, tools: list[dict], only: str | None, parallel: bool) -> Constraint:
        raise NotImplementedError


class Hermes(Parser):
    name, markers = "hermes", ("<tool_call>",)
    BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text):
        calls = []
        for body in self.BLOCK.findall(text):
            try:
                value = json.loads(body)
            except json.JSONDecodeError:
                return text, []
            if not isinstance(value, dict) or not isinstance(value.get("name"), str):
                return text, []
            calls.append(ToolCall.of(value["name"], value.get("arguments", {})))
        if not calls:
            return text, []
        content = text[:text.index("<tool_call>")].strip()
        return content or None, calls

    def constraint(self, tools, only, parallel):
        body = json.dumps(_calls_schema(tools, only, "arguments"))
        repeat = "+" if parallel else ""
        return Constraint("grammar", f'start: call{repeat}\ncall: "<tool_call>\\n" body "\\n</tool_call>" "\\n"?\n'
                                     f"body: %json {body}\n")


class Llama3Json(Parser):
    name, markers = "llama3_json", ("<|python_tag|>", "ipython")

    def parse(self, text):
        stripped = text.strip().removeprefix("<|python_tag|>").strip()
        values = _json_objects(stripped) if stripped.startswith("{") else None
        if not values or not all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in values):
            return text, []
        return None, [ToolCall.of(v["name"], v.get("parameters", v.get("arguments", {}))) for v in values]

    def constraint(self, tools, only, parallel):
        body = json.dumps(_calls_schema(tools, only, "parameters"))
        more = ' ("; " body)*' if parallel else ""
        return Constraint("grammar", f"start: body{more}\nbody: %json {body}\n")


class Mistral(Parser):
    name, markers = "mistral", ("[TOOL_CALLS]",)

    def parse(self, text):
        stripped = text.strip()
        head = stripped.removeprefix("[TOOL_CALLS]").strip()  # (the marker is a special token: usually not in text)
        if not head.startswith("[{"):
            return text, []
        try:
            values = json.loads(head)
        except json.JSONDecodeError:
            return text, []
        if not all(isinstance(v, dict) and isinstance(v.get("name"), str) for v in values):
            return text, []
        return None, [ToolCall.of(v["name"], v.get("arguments", {})) for v in values]

    def constraint(self, tools, only, parallel):
        schema = _calls_schema(tools, only, "arguments")
        array = {"type": "array", "items": {k: v for k, v in schema.items() if k != "x-guidance"}, "minItems": 1,
                 "x-guidance": JSON_LAYOUT, **({} if parallel else {"maxItems": 1})}
        return Constraint.json_schema(array)


PARSERS: dict[str, Parser] = {p.name: p for p in (Hermes(), Llama3Json(), Mistral())}


def parser_for(template: str | None, name: str | None = None) -> Parser | None:
    """The parser `name` (serve --tool-call-parser), else the one whose markers the chat template writes (None: the
    template writes no tool calls this server can read)."""
    if name is not None:
        return PARSERS[name]
    if not template:
        return None
    return next((p for p in PARSERS.values() if any(m in template for m in p.markers)), None)


def renders_tools(template: str | None) -> bool:
    """Whether a chat template renders the request's tools (it reads a `tools` variable)."""
    return bool(template) and re.search(r"\btools\b", template) is not None
