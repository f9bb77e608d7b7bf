"""Tool calls (serve/tools.py): each family's parser on recorded outputs of its templates, the grammar that forces a
call (valid calls pass, anything else does not), and the parser a chat template's markers choose."""

import json

import pytest
from conftest import TOKENIZER_VOCAB, byte_level_tokenizer

from specexport.runtime.grammar import Grammars
from specexport.serve.tools import PARSERS, parser_for, renders_tools

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city.",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}}}]

# (parser, text as the family's models write it, content, [(name, arguments)])
RECORDED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>', None,
     [("get_weather", {"city": "Paris"})]),
    ("hermes", 'I will check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>', "I will check both.",
     [("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})]),
    ("hermes", "The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',  # broken JSON: content
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>', []),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Rome"}}', None, [("get_weather", {"city": "Rome"})]),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Bern"}}', None,
     [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Bern"})]),
    ("llama3_json", "It is {warm} today.", "It is {warm} today.", []),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima"}}]', None,
     [("get_weather", {"city": "Lima"})]),
    ("mistral", '[{"name": "get_time", "arguments": {"zone": "CET"}}, {"name": "get_weather", "arguments": '
                '{"city": "Kyiv"}}]', None, [("get_time", {"zone": "CET"}), ("get_weather", {"city": "Kyiv"})]),
    ("mistral", "[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", []),
]


@pytest.mark.parametrize("name, text, content, calls", RECORDED)
def test_recorded_outputs_parse_into_content_and_calls(name, text, content, calls):
    got_content, got_calls = PARSERS[name].parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert len({c.id for c in got_calls}) == len(got_calls) and all(c.id.startswith("call_") for c in got_calls)


@pytest.fixture(scope="module")
def grammars():
    return Grammars(byte_level_tokenizer().backend_tokenizer.to_str(), TOKENIZER_VOCAB, {1})


def accepts(grammars, constraint, text: str) -> bool:
    """Whether the grammar takes `text` whole and may then end."""
    matcher = grammars.matcher(constraint)
    ids = byte_level_tokenizer()(text, add_special_tokens=False)["input_ids"]
    if matcher.allowed(ids) is None:
        return False
    matcher.advance(ids)
    return bool(matcher.allowed()[1])  # the end of sequence is allowed: the call is complete


@pytest.mark.parametrize("name, one, two, bad", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>\n'
     '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     '<tool_call>\n{"name": "get_time", "arguments": {"zone": "PST"}}\n</tool_call>'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     '{"name": "get_time", "parameters": {"zone": "UTC"}}; {"name": "get_weather", "parameters": {"city": "Oslo"}}',
     '{"name": "get_weather", "parameters": {}}'),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Oslo"}}]',
     '[{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "get_weather", "arguments": {"city": "Oslo"}}]',
     '[{"name": "set_alarm", "arguments": {}}]'),
])
def test_a_forced_call_is_the_only_thing_the_grammar_allows(grammars, name, one, two, bad):
    parser = PARSERS[name]
    required = parser.constraint(TOOLS, None, parallel=True)
    assert accepts(grammars, required, one) and accepts(grammars, required, two)
    assert not accepts(grammars, required, bad) and not accepts(grammars, required, "Sure, here it is.")
    single = parser.constraint(TOOLS, None, parallel=False)
    assert accepts(grammars, single, one) and not accepts(grammars, single, two)
    named = parser.constraint(TOOLS, "get_time", parallel=False)
    assert not accepts(grammars, named, one)
    content, calls = parser.parse(two)
    assert [c.name for c in calls] == ["get_time", "get_weather"]


def test_the_template_names_its_parser():
    from pathlib import Path

    hermes = (Path(__file__).parent / "templates" / "hermes_tools.jinja").read_text()
    assert parser_for(hermes).name == "hermes" and renders_tools(hermes)
    assert parser_for("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert parser_for("{% if m.role == 'ipython' %}{% endif %}").name == "llama3_json"
    plain = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert parser_for(plain) is None and not renders_tools(plain)
    assert parser_for(plain, "mistral").name == "mistral"
