"""`fulmen push` of Hugging Face datasets against a real Redis: folders, splits, parquet, arrow, the
column mapping, and bad rows reported with their row number."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from fulmen.cli.main import app

datasets = pytest.importorskip("datasets")
runner = CliRunner()


def said(result: Any) -> str:
    """What a command wrote to stderr, on one line (rich wraps it at the console's width: a long
    temporary path moves the break)."""
    return " ".join(result.stderr.split())

ROWS = [{"id": "a", "prompt": "1+1", "solution": "2"}, {"id": "b", "prompt": "2+2", "solution": "4"}]


@pytest.fixture
def env(redis_url: str, experiment: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("FULMEN_EXPERIMENT", experiment)


def _status() -> dict:
    result = runner.invoke(app, ["status", "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def _inputs() -> dict[str, dict]:
    """Each queued rollout's input (the task), by rollout id."""
    result = runner.invoke(app, ["rollouts", "--json", "--limit", "50"])
    assert result.exit_code == 0, result.output
    return {r["rollout_id"]: r["input"] for r in json.loads(result.stdout)}


def test_push_a_parquet_file_with_a_column_mapping(env: None, tmp_path: Path) -> None:
    """Rows queued as tasks with the mapped fields (other columns kept); pushing twice adds nothing."""
    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "t.parquet"))
    args = ["push", str(tmp_path / "t.parquet"), "--column", "question=prompt", "--column", "answer=solution"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "queued 2 rollout(s)" in result.stdout
    assert _inputs()["a"] == {"id": "a", "question": "1+1", "answer": "2"}
    assert "2 already present" in runner.invoke(app, args).stdout


def test_push_a_split_of_a_dataset_dict_and_an_arrow_file(env: None, tmp_path: Path) -> None:
    """--split picks a DatasetDict's split; without train and --split the error names the splits."""
    splits = datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS), "dev": datasets.Dataset.from_list(ROWS[:1])})
    splits.save_to_disk(str(tmp_path / "dd"))
    missing = runner.invoke(app, ["push", str(tmp_path / "dd")])
    assert missing.exit_code == 2 and "its splits are ['dev', 'test']" in said(missing)
    result = runner.invoke(app, ["push", str(tmp_path / "dd"), "--split", "dev"])
    assert result.exit_code == 0, result.output
    assert "queued 1 rollout(s)" in result.stdout
    arrow = next((tmp_path / "dd" / "test").glob("*.arrow"))
    assert "queued 1 rollout(s)" in runner.invoke(app, ["push", str(arrow)]).stdout  # b; a is there already
    assert _status()["total_rollouts"] == 2


def test_push_reports_bad_rows_with_their_numbers(env: None, tmp_path: Path) -> None:
    """An empty id, a duplicate id and a value msgpack cannot carry are each a numbered bad row;
    NaN is noted (queued) as in JSON lines, and refused with --strict."""
    import datetime

    rows = [{"id": "a", "x": 1.0, "t": None}, {"id": None, "x": 1.0, "t": None}, {"id": "a", "x": 2.0, "t": None},
            {"id": "c", "x": float("nan"), "t": None}, {"id": "d", "x": 1.0, "t": datetime.datetime(2024, 1, 1)}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "bad"))
    strict = runner.invoke(app, ["push", "--strict", str(tmp_path / "bad")])
    assert strict.exit_code == 1 and "bad row(s) and --strict" in said(strict)
    assert "row 3: holds NaN" in said(strict)
    result = runner.invoke(app, ["push", str(tmp_path / "bad")])
    assert result.exit_code == 0, result.output
    assert "row 1: field 'id' must be a string or an integer" in said(result)
    assert "row 2: duplicate id 'a' (first on row 0)" in said(result)
    assert "row 3: holds NaN or Infinity" in said(result) and "(queued)" in said(result)
    assert "row 4: cannot encode as msgpack" in said(result)
    assert "queued 2 rollout(s)" in result.stdout and "skipped 3 bad row(s)" in result.stdout


def test_push_a_whole_task_column_and_option_errors(env: None, tmp_path: Path) -> None:
    """--column =task takes the task from one column (a row whose value is not a mapping is bad);
    --split on JSON lines and a mapping to a missing column are refused with exit 2."""
    datasets.Dataset.from_list([{"task": {"id": "a", "q": "1"}}, {"task": None}]).save_to_disk(str(tmp_path / "n"))
    result = runner.invoke(app, ["push", str(tmp_path / "n"), "--column", "=task"])
    assert result.exit_code == 0, result.output
    assert "row 1: column 'task' holds NoneType, where a task must be a mapping" in said(result)
    assert _inputs()["a"] == {"id": "a", "q": "1"}
    (tmp_path / "t.jsonl").write_text('{"id": "z"}\n')
    assert runner.invoke(app, ["push", str(tmp_path / "t.jsonl"), "--split", "train"]).exit_code == 2
    nocol = runner.invoke(app, ["push", str(tmp_path / "n"), "--column", "q=question"])
    assert nocol.exit_code == 2 and "no column 'question'" in said(nocol)
