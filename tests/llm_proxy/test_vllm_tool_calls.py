"""Tool calls vLLM's parser returns, held to the request's tools by the proxy's vllm backend as the
torch backend holds its own (the parser's rules: tests/llm_proxy/test_tool_call_parser.py; the real
server: tests/vllm_sync/test_real_vllm.py)."""

from __future__ import annotations

import copy
import json
from typing import Any

from fulmen_llm_proxy.backends.base import Call, Result
from fulmen_llm_proxy.backends.upstream.vllm import VllmBackend

CALC = {"type": "function", "function": {"name": "calculator", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
MESSAGES = [{"role": "user", "content": "What is 2+3?"}]


def _call(**body: Any) -> Call:
    body = {"messages": MESSAGES, "tools": [CALC], **body}
    return Call(operation="chat", body=body, model="m", stream=False, max_tokens=16, temperature=1.0, top_p=1.0,
                seed=None, stop=[], n=int(body.get("n", 1)))


def _choice(index: int, arguments: Any, name: str = "calculator") -> dict[str, Any]:
    calls = [] if arguments is None else [{"id": f"chatcmpl-tool-{index}", "type": "function", "function": {
        "name": name, "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}]
    return {"index": index, "message": {"role": "assistant", "content": None if calls else "5", "tool_calls": calls},
            "finish_reason": "tool_calls" if calls else "stop", "token_ids": [7, 8, 9],
            "logprobs": {"content": [{"logprob": -0.1}, {"logprob": -0.2}, {"logprob": -0.3}]}}


def _read(call: Call, *choices: dict[str, Any]) -> tuple[dict[str, Any], list[Result]]:
    body = {"id": "chatcmpl-1", "model": "m", "prompt_token_ids": [1, 2, 3], "choices": list(choices)}
    result = Result()
    VllmBackend(["http://127.0.0.1:1"]).read_response(call, body, result)
    return body, [result, *result.more]


def test_a_call_that_fits_its_schema_is_kept_and_recorded() -> None:
    sent = _choice(0, {"expression": "2+3"})
    body, (result,) = _read(_call(), copy.deepcopy(sent))
    assert body["choices"][0] == sent  # passed on as vLLM answered
    assert result.tool_calls == sent["message"]["tool_calls"] and result.finish_reason == "tool_calls"
    assert "tool_error" not in result.extra and result.token_ids == [7, 8, 9] and result.fidelity == "exact"


def test_a_call_its_schema_refuses_comes_back_as_text_with_the_reason() -> None:
    """An unknown tool, arguments of the wrong type, arguments that are not JSON, tool_choice unmet:
    each is plain content (the calls as the model wrote them), finish_reason stop, and a
    fulmen_tool_error, in the answer and in the span; the token ids stay the model's."""
    cases = [
        (_call(), _choice(0, {"expression": 5}), "the arguments of 'calculator' do not fit its schema"),
        (_call(), _choice(0, {"expression": "1"}, name="search"), "names 'search', which is not a tool offered"),
        (_call(), _choice(0, "{not json"), "the arguments of 'calculator' are a string that is not JSON"),
        (_call(tool_choice="required"), _choice(0, None), "tool_choice asks for a tool call; the output holds none"),
    ]
    for call, choice, reason in cases:
        body, (result,) = _read(call, choice)
        answered = body["choices"][0]
        assert reason in answered["fulmen_tool_error"] and reason in result.extra["tool_error"], reason
        assert answered["finish_reason"] == result.finish_reason == "stop"
        assert answered["message"]["tool_calls"] == [] and result.tool_calls is None
        assert answered["message"]["content"] == result.text
        if choice["message"]["tool_calls"]:
            assert result.text.startswith("<tool_call>{") and result.text.endswith("</tool_call>")
        assert result.token_ids == [7, 8, 9]


def test_each_of_n_choices_is_held_to_the_tools_on_its_own() -> None:
    body, results = _read(_call(n=2), _choice(0, {"expression": "2+3"}), _choice(1, {"x": 1}))
    assert [bool(r.tool_calls) for r in results] == [True, False]
    assert "fulmen_tool_error" not in body["choices"][0] and "required property" in body["choices"][1]["fulmen_tool_error"]


def test_without_tools_or_with_tool_choice_none_nothing_is_checked() -> None:
    plain = _choice(0, None)
    for call in (Call(operation="chat", body={"messages": MESSAGES}, model="m", stream=False, max_tokens=4,
                      temperature=1.0, top_p=1.0, seed=None, stop=[], n=1), _call(tool_choice="none")):
        body, (result,) = _read(call, copy.deepcopy(plain))
        assert body["choices"][0] == plain and "tool_error" not in result.extra
