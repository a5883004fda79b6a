"""The `fulmen` command line against a real Redis."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis as syncredis
from typer.testing import CliRunner

from fulmen.cli import main as cli
from fulmen.cli.main import app
from fulmen.store import RedisStore
from fulmen.store.redis.connection import async_client
from fulmen.store.redis.embedded import free_port, wait_for_port

runner = CliRunner()


@pytest.fixture
def env(redis_url: str, experiment: str, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("FULMEN_EXPERIMENT", experiment)
    return {"REDIS_URL": redis_url, "FULMEN_EXPERIMENT": experiment}


def _tasks(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "tasks.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _status(env: dict[str, str]) -> dict:
    result = runner.invoke(app, ["status", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_push_skips_bad_lines_with_their_numbers(env: dict[str, str], tmp_path: Path) -> None:
    """Bad lines are named by line number and skipped; good ones are queued; a summary ends it."""
    path = _tasks(tmp_path, ['{"id": "a", "q": 1}', "not json", "[1, 2]", "", '{"q": 2}'])
    result = runner.invoke(app, ["push", str(path)])
    assert result.exit_code == 0, result.output
    assert "line 2: not valid JSON" in result.stderr
    assert "line 3: a task must be a JSON object, got list" in result.stderr
    assert "queued 2 rollout(s)" in result.stdout and "skipped 2 bad line(s)" in result.stdout
    assert _status(env)["rollouts"]["queuing"] == 2


def test_push_twice_adds_nothing(env: dict[str, str], tmp_path: Path) -> None:
    """Pushing the same file again queues nothing new, with or without an id field."""
    path = _tasks(tmp_path, ['{"id": "a", "q": 1}', '{"q": 2}', '{"q": 2}'])
    assert "queued 3" in runner.invoke(app, ["push", str(path)]).stdout
    again = runner.invoke(app, ["push", str(path)])
    assert "queued 0" in again.stdout and "3 already present" in again.stdout
    assert _status(env)["total_rollouts"] == 3


def test_push_strict_refuses_the_whole_file(env: dict[str, str], tmp_path: Path) -> None:
    """With --strict one bad line means nothing is queued, and the exit code says so."""
    path = _tasks(tmp_path, ['{"id": "a"}', "{oops"])
    result = runner.invoke(app, ["push", "--strict", str(path)])
    assert result.exit_code == 1
    assert "line 2" in result.stderr and "nothing was queued" in result.stderr
    assert _status(env)["total_rollouts"] == 0


def test_push_from_stdin_with_options(env: dict[str, str]) -> None:
    """`push -` reads standard input; mode and retry options reach the rollouts."""
    result = runner.invoke(
        app,
        [
            "push",
            "-",
            "--mode",
            "val",
            "--max-attempts",
            "3",
            "--retry-on",
            "timeout",
            "--timeout-seconds",
            "5",
        ],
        input='{"id": "v1"}\n',
    )
    assert result.exit_code == 0, result.output
    listing = runner.invoke(app, ["rollouts", "--json"])
    [row] = json.loads(listing.stdout)
    assert (row["rollout_id"], row["mode"], row["status"]) == ("v1", "val", "queuing")


def test_push_refuses_oversize_and_bad_config(env: dict[str, str], tmp_path: Path, monkeypatch) -> None:
    """An oversize task is a bad line; an invalid retry condition is a clear error."""
    monkeypatch.setenv("FULMEN_MAX_RECORD_BYTES", "1024")
    path = _tasks(tmp_path, [json.dumps({"id": "big", "text": "x" * 4000}), '{"id": "ok"}'])
    result = runner.invoke(app, ["push", str(path)])
    assert "line 1" in result.stderr and "limit" in result.stderr
    assert "queued 1" in result.stdout
    bad = runner.invoke(app, ["push", str(path), "--retry-on", "sometimes"])
    assert bad.exit_code == 1 and "retry_condition" in bad.stderr


def test_push_priority_and_its_validation(env: dict[str, str], tmp_path: Path) -> None:
    """--priority sets the lane of every task; --priority-field lets a line name its own, and a line
    naming an unknown one is skipped with its number; an unknown --priority refuses the push."""
    path = _tasks(tmp_path, ['{"id": "a", "p": "urgent"}', '{"id": "b", "p": "asap"}', '{"id": "c"}',
                             '{"id": "d", "p": 3}'])
    bad = runner.invoke(app, ["push", str(path), "--priority", "asap"])
    assert bad.exit_code == 2 and "--priority" in bad.output and "asap" in bad.output
    result = runner.invoke(app, ["push", str(path), "--priority", "low", "--priority-field", "p"])
    assert result.exit_code == 0, result.output
    assert "line 2: priority 'asap' unknown; use urgent, normal, low (skipped)" in result.stderr
    assert "line 4: priority 3 unknown" in result.stderr
    assert "queued 2" in result.stdout

    async def lanes() -> dict[str, str]:
        store = RedisStore(async_client(env["REDIS_URL"]), env["FULMEN_EXPERIMENT"])
        try:
            return {r.rollout_id: r.priority.value for r in await store.rollouts.query_rollouts()}
        finally:
            await store.aclose()

    assert asyncio.run(lanes()) == {"a": "urgent", "c": "low"}


def test_push_missing_file(env: dict[str, str]) -> None:
    """A file that cannot be read gives exit code 2 and says why."""
    result = runner.invoke(app, ["push", "/nonexistent/tasks.jsonl"])
    assert result.exit_code == 2
    assert "cannot read /nonexistent/tasks.jsonl" in result.stderr


def test_unknown_environment_variable_is_an_error(env: dict[str, str], monkeypatch) -> None:
    """A misspelled FULMEN_ variable is refused rather than silently ignored."""
    monkeypatch.setenv("FULMEN_EXPERIMNT", "x")
    result = runner.invoke(app, ["status"])
    assert result.exit_code == 2
    assert "FULMEN_EXPERIMNT" in result.stderr


def test_status_rollouts_and_spans_screens(env: dict[str, str], tmp_path: Path) -> None:
    """status, rollouts and spans print what the store holds."""
    runner.invoke(app, ["push", str(_tasks(tmp_path, ['{"id": "r1", "q": "1+1"}']))])
    table = runner.invoke(app, ["status"])
    assert table.exit_code == 0 and "queue depth" in table.stdout and env["FULMEN_EXPERIMENT"] in table.stdout
    listing = runner.invoke(app, ["rollouts", "--status", "queuing"])
    assert "r1" in listing.stdout
    assert runner.invoke(app, ["rollouts", "--status", "failed"]).stdout.strip().endswith("no rollouts match")
    assert "has no spans" in runner.invoke(app, ["spans", "r1"]).stdout
    missing = runner.invoke(app, ["spans", "r1", "--attempt", "latest"])
    assert missing.exit_code == 0


def test_every_command_has_help() -> None:
    """`--help` works on every command (as a real subprocess, the way users run it)."""
    for command in [
        "",
        "redis",
        "push",
        "status",
        "rollouts",
        "spans",
        "dead-letters",
        "watchdog",
        "experiments",
        "trim",
    ]:
        args = [sys.executable, "-m", "fulmen.cli.main", *([command] if command else []), "--help"]
        result = subprocess.run(args, capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        assert "Usage" in result.stdout


def test_a_service_help_shows_only_its_own_options() -> None:
    """`fulmen runner --help` lists the runner's settings, each with its environment name and the
    field's default, and none of another service's."""
    cli._add_service_commands()

    def help_text(command: str) -> str:  # the help with rich's box and line wrapping taken out
        result = CliRunner().invoke(app, [command, "--help"])
        assert result.exit_code == 0, result.output
        return " ".join(result.stdout.replace("│", " ").split())

    text = help_text("runner")
    assert "--concurrency" in text and "(env FULMEN_CONCURRENCY; default 8)" in text
    assert "--learning-rate" not in text and "--backend" not in text and "--redis-port" not in text
    trainer_help = help_text("trainer")
    assert "--learning-rate" in trainer_help and "default 0.0001" in trainer_help
    assert "--concurrency" not in trainer_help and "--proxy-api-keys" not in trainer_help


def test_no_option_help_has_a_dangling_default() -> None:
    """Every command's help: no option text ends in " ." or shows an empty default unquoted."""
    cli._add_service_commands()
    import typer.main

    for name in typer.main.get_command(app).commands:  # type: ignore[attr-defined]
        result = CliRunner().invoke(app, [name, "--help"], env={"COLUMNS": "300"})
        assert result.exit_code == 0, (name, result.output)
        text = " ".join(result.stdout.replace("│", " ").split())
        assert not re.search(r" \.(\s|\)|$)|default \)|default ;", text), (name, text)  # a dot left alone
    assert "(env FULMEN_EXPERIMENT; default 'default')" in " ".join(
        CliRunner().invoke(app, ["status", "--help"], env={"COLUMNS": "300"}).stdout.replace("│", " ").split())


def test_redis_command_runs_embedded_server_with_aof(tmp_path: Path) -> None:
    """`fulmen redis` runs redis-server on loopback with AOF, and exits on SIGTERM."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL" and not k.startswith("FULMEN_")}
    env |= {"FULMEN_REDIS_PORT": str(port), "FULMEN_DATA_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "fulmen.cli.main", "redis"], env=env)
    try:
        wait_for_port(port, 30, proc)
        client = syncredis.Redis(port=port)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
        assert Path(client.config_get("dir")["dir"]) == tmp_path / "redis"
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def test_redis_command_idles_when_redis_url_is_set(tmp_path: Path, redis_url: str) -> None:
    """With REDIS_URL set, `fulmen redis` starts nothing, stays up, and exits 0 on SIGTERM."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")} | {"REDIS_URL": redis_url}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fulmen.cli.main", "redis"], env=env, stderr=subprocess.PIPE, text=True
    )
    assert proc.stderr is not None
    # its message comes once it is up (imports take seconds on a busy machine): SIGTERM before
    # that would test Python's default handler, not ours
    seen: list[str] = []
    for line in iter(proc.stderr.readline, ""):
        if "REDIS_URL is set" in line:
            seen.append(line)
            break
    assert seen, "`fulmen redis` exited without saying it idles"
    time.sleep(0.3)
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0


def test_push_survives_hostile_lines(env: dict[str, str], tmp_path: Path) -> None:
    """Invalid UTF-8, 200,000-deep nesting, a 5,000-digit integer, a lone surrogate, an integer
    beyond 64 bits: each one bad line with its number; the lines around them are queued."""
    lines = [
        b'{"id": "a"}',
        b'{"id": "x", "q": "\xff\xfe"}',
        b"[" * 200_000 + b"]" * 200_000,
        b'{"id": "y", "n": ' + b"7" * 5000 + b"}",
        b'{"id": "z", "q": "\\ud800"}',
        b'{"id": "w", "n": ' + str(2**70).encode() + b"}",
        b'{"id": "b"}',
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    result = runner.invoke(app, ["push", str(path)])
    assert result.exit_code == 0, result.output
    assert "line 2: not valid UTF-8" in result.stderr
    assert "line 3: not valid JSON (nested too deeply)" in result.stderr
    assert "line 4: not valid JSON" in result.stderr and "digits" in result.stderr
    for number in (5, 6):
        assert f"line {number}:" in result.stderr
    assert "queued 2 rollout(s)" in result.stdout and "skipped 5 bad line(s)" in result.stdout
    strict = runner.invoke(app, ["push", "--strict", str(path)])
    assert strict.exit_code == 1 and not isinstance(strict.exception, Exception)  # SystemExit only
    assert "nothing was queued" in strict.stderr


def test_push_reports_duplicate_ids(env: dict[str, str], tmp_path: Path) -> None:
    """An id given twice in one file is reported with both lines; --strict refuses the file."""
    path = _tasks(tmp_path, ['{"id": "a", "q": 1}', '{"id": "b"}', '{"id": "a", "q": 2}'])
    strict = runner.invoke(app, ["push", "--strict", str(path)])
    assert strict.exit_code == 1
    assert "line 3: duplicate id 'a' (first on line 1)" in strict.stderr
    assert _status(env)["total_rollouts"] == 0
    result = runner.invoke(app, ["push", str(path)])
    assert result.exit_code == 0, result.output
    assert "line 3: duplicate id 'a' (first on line 1)" in result.stderr
    assert "queued 2 rollout(s)" in result.stdout and "skipped 1 bad line(s)" in result.stdout


def test_push_non_finite_numbers(env: dict[str, str], tmp_path: Path) -> None:
    """NaN and Infinity are refused with --strict and reported (the task queued) otherwise."""
    path = _tasks(tmp_path, ['{"id": "a", "x": NaN}', '{"id": "b", "x": 1e999}', '{"id": "c", "x": 1}'])
    strict = runner.invoke(app, ["push", "--strict", str(path)])
    assert strict.exit_code == 1
    assert "line 1: holds NaN or Infinity" in strict.stderr and "line 2: holds NaN" in strict.stderr
    assert _status(env)["total_rollouts"] == 0
    result = runner.invoke(app, ["push", str(path)])
    assert result.exit_code == 0, result.output
    assert "line 1: holds NaN or Infinity" in result.stderr and "line 2:" in result.stderr
    assert "queued 3 rollout(s)" in result.stdout
