"""The tool-call parser (`fulmen_llm_proxy.backends.tool_calls`) and its schema checker, without a model."""

from __future__ import annotations

import json

import pytest

from fulmen_llm_proxy.backends.json_schema import validate
from fulmen_llm_proxy.backends.tool_calls import ContentGate, parse, plan, safe_prefix
from fulmen_llm_proxy.errors import ProxyError

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x"],
    "additionalProperties": False}}}  # fmt: skip
ECHO = {"type": "function", "function": {"name": "echo", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "enum": ["a", "b"]}}}}}  # fmt: skip
BODY = {"tools": [ADD, ECHO]}


def tools(**extra: object):
    result = plan({**BODY, **extra})
    assert result is not None
    return result


def test_a_valid_call_becomes_openai_tool_calls_with_text_outside_as_content() -> None:
    parsed = parse('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"x": 1, "y": 2}}\n</tool_call>\n', tools())
    assert parsed.error is None and parsed.content == "Let me add."
    [call] = parsed.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"x": 1, "y": 2}


def test_several_calls_and_arguments_given_as_a_json_string() -> None:
    text = ('<tool_call>{"name": "add", "arguments": "{\\"x\\": 3}"}</tool_call>'
            '<tool_call>{"name": "echo", "arguments": {"text": "a"}}</tool_call>')
    parsed = parse(text, tools())
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["add", "echo"]
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"x": 3}
    assert parsed.content is None  # nothing but calls: content null, as OpenAI sends it
    assert len({c["id"] for c in parsed.tool_calls}) == 2


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('<tool_call>{"name": "add", "arguments": {"x": 1}</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "add", "arguments": {"x": "1"}}</tool_call>', "expected integer"),
        ('<tool_call>{"name": "add", "arguments": {"y": 1}}</tool_call>', "missing required property 'x'"),
        ('<tool_call>{"name": "add", "arguments": {"x": 1, "z": 0}}</tool_call>', "unexpected property 'z'"),
        ('<tool_call>{"name": "echo", "arguments": {"text": "c"}}</tool_call>', "is not one of"),
        ('<tool_call>{"name": "sub", "arguments": {"x": 1}}</tool_call>', "not a tool offered"),
        ('<tool_call>{"name": "add", "arguments": [1]}</tool_call>', "must be a JSON object"),
        ('<tool_call>["add"]</tool_call>', 'with a "name"'),
        ('<tool_call>{"name": "add", "arguments": {"x": 1}}', "never closed"),  # cut by max_tokens
        ('<tool_call>{"name": "add", "argu', "never closed"),
    ],
)
def test_a_malformed_call_leaves_the_whole_output_as_plain_text(text: str, reason: str) -> None:
    parsed = parse("  " + text, tools())
    assert parsed.tool_calls == [] and parsed.content == text
    assert parsed.error is not None and reason in parsed.error


def test_one_bad_call_among_good_ones_makes_it_all_text() -> None:
    text = ('<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>'
            '<tool_call>{"name": "add", "arguments": {"x": true}}</tool_call>')
    parsed = parse(text, tools())
    assert parsed.tool_calls == [] and parsed.content == text and "expected integer" in (parsed.error or "")


def test_text_without_tags_is_content_and_no_error_under_auto() -> None:
    parsed = parse(" 42 \n", tools())
    assert (parsed.content, parsed.tool_calls, parsed.error) == ("42", [], None)


def test_tool_choice_required_and_named_report_an_output_without_the_call() -> None:
    required = parse("just text", tools(tool_choice="required"))
    assert required.tool_calls == [] and required.content == "just text"
    assert "tool_choice asks for a tool call" in (required.error or "")
    named = tools(tool_choice={"type": "function", "function": {"name": "echo"}})
    assert [t["function"]["name"] for t in named.rendered] == ["echo"]  # the template sees only it
    other = parse('<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>', named)
    assert other.tool_calls == [] and "not a tool offered" in (other.error or "")
    assert parse('<tool_call>{"name": "echo", "arguments": {}}</tool_call>', named).tool_calls


def test_parallel_tool_calls_false_refuses_two_calls() -> None:
    text = '<tool_call>{"name": "add", "arguments": {"x": 1}}</tool_call>' * 2
    parsed = parse(text, tools(parallel_tool_calls=False))
    assert parsed.tool_calls == [] and "parallel_tool_calls" in (parsed.error or "")
    assert len(parse(text, tools()).tool_calls) == 2


def test_tool_choice_none_renders_no_tools_and_plans_no_parsing() -> None:
    assert plan({**BODY, "tool_choice": "none"}) is None
    assert plan({"messages": []}) is None


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": [{"type": "retrieval", "function": {"name": "a"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a", "parameters": []}}]}, "tools"),
        ({"tools": [ADD, ADD]}, "tools"),
        ({**BODY, "tool_choice": "always"}, "tool_choice"),
        ({**BODY, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({**BODY, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ],
)
def test_malformed_tools_or_tool_choice_are_a_400_naming_the_field(body: dict, param: str) -> None:
    with pytest.raises(ProxyError) as caught:
        plan(body)
    assert caught.value.status == 400 and caught.value.param == param


def test_schema_subset() -> None:
    schema = {"type": "object", "properties": {
        "n": {"type": "number", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2},
        "mode": {"anyOf": [{"type": "null"}, {"const": "fast"}]},
    }}  # fmt: skip
    assert validate({"n": 2.5, "tags": ["ab"], "mode": None}, schema) is None
    assert validate({"n": True}, schema) == "$.n: expected number, got boolean"
    assert validate({"n": 11}, schema) == "$.n: 11 is above the maximum 10"
    assert validate({"tags": ["abcd"]}, schema) == "$.tags[0]: 4 characters, more than maxLength 3"
    assert validate({"tags": ["a", "b", "c"]}, schema) == "$.tags: 3 items, more than maxItems 2"
    assert validate({"mode": "slow"}, schema) == "$.mode: matches none of anyOf"
    assert validate(3, {"type": "integer"}) is None and validate(3.0, {"type": "integer"}) is None
    assert validate([1], {"type": ["object", "null"]}) == "$: expected object or null, got array"
    assert validate({"a": 1}, {}) is None  # parameters {}: any arguments


def test_streamed_content_stops_before_what_may_become_a_tool_call() -> None:
    assert safe_prefix("Sure <tool_") == len("Sure")
    assert safe_prefix("Sure <tool_call>{") == len("Sure")
    assert safe_prefix("a < b") == len("a < b")
    gate = ContentGate()
    sent = ""
    text = ""
    for piece in ["  ", "Hi", " there ", "<tool", '_call>{"name": "add"}', "</tool_call>", " bye"]:
        text += piece
        sent += gate.feed(text)
    final = parse(text, tools()).content
    assert sent == "Hi there" and final is not None and final.startswith(sent)
    assert sent + gate.rest(final) == final
