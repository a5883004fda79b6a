"""Property-based fuzz of `fulmen push`: any file gives per-line errors and an exit code, no traceback."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from fulmen.cli.main import app

runner = CliRunner()
_LINE = (
    st.binary(max_size=200)
    | st.text(st.characters(codec=None, exclude_categories=()), max_size=60).map(lambda t: t.encode("utf-8", "surrogatepass"))
    | st.dictionaries(st.sampled_from(["id", "q", "n"]), st.integers() | st.floats() | st.text() | st.booleans(), max_size=3).map(
        lambda d: json.dumps(d).encode()
    )
    | st.integers(min_value=1, max_value=300_000).map(lambda n: b"[" * n)
    | st.integers(min_value=4000, max_value=6000).map(lambda n: b'{"n": ' + b"9" * n + b"}")
)  # fmt: skip


@pytest.fixture
def env(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(lines=st.lists(_LINE, max_size=8), strict=st.booleans())
def test_push_on_random_bytes(env: None, tmp_path: Path, lines: list[bytes], strict: bool) -> None:
    """Random bytes: exit code 0, 1 or 2, never a traceback; every bad line is named by number."""
    path = tmp_path / f"{uuid.uuid4().hex}.jsonl"
    data = b"\n".join(lines)
    path.write_bytes(data)
    args = ["push", "--experiment", f"fz-{uuid.uuid4().hex[:8]}", str(path)]
    result = runner.invoke(app, [*args[:1], "--strict", *args[1:]] if strict else args)
    assert result.exit_code in (0, 1, 2), result.output
    assert not isinstance(result.exception, Exception), result.exception  # SystemExit only
    assert "Traceback" not in result.output
    for match in re.finditer(r"line (\d+):", result.stderr):
        assert 1 <= int(match.group(1)) <= data.count(b"\n") + 1  # a generated line may hold newlines
