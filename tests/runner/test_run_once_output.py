"""What `fulmen run-once` prints for an LLM call: the prompt and the response, not only token counts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from fulmen import tokens
from fulmen.records import Span
from fulmen.telemetry import semconv
from fulmen_runner import cli as runner_cli


def test_run_once_prints_each_calls_prompt_and_response(capsys: pytest.CaptureFixture[str]) -> None:
    """The call's line says tokens and version; the next lines show the last message sent and the reply."""
    call = Span("r1", "r1.1", "s1", "chat tiny", attributes={
        semconv.SPAN_KIND: semconv.KIND_LLM_CALL, semconv.MODEL_VERSION: "v7",
        semconv.REQUEST_JSON: json.dumps({"messages": [{"role": "user", "content": "What is 2+2?"}]}),
        semconv.RESPONSE_JSON: json.dumps({"role": "assistant", "content": "4, of course"}),
        semconv.PROMPT_TOKEN_IDS: tokens.pack_ids([1, 2, 3]), semconv.RESPONSE_TOKEN_IDS: tokens.pack_ids([4]),
    }, sequence_id=1)
    runner_cli._print_run("r1", SimpleNamespace(status=None, reward=1.0, error=None), [call], as_json=False)
    printed = " ".join(capsys.readouterr().out.split())  # rich wraps at the terminal's width
    assert "3 prompt + 1 response tokens, model version v7" in printed
    assert "What is 2+2?" in printed and "4, of course" in printed
