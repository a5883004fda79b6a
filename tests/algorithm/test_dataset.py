"""The algorithm's task loader on Hugging Face datasets: folders, DatasetDict splits, parquet, arrow,
the column mapping, and row-numbered errors for bad rows."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest

from fulmen.errors import InvalidInput
from fulmen_algorithm.dataset import load_tasks

datasets = pytest.importorskip("datasets")

ROWS = [{"id": "a", "prompt": "1+1", "solution": "2"}, {"id": "b", "prompt": "2+2", "solution": "4"}]
TASKS = [{"id": "a", "question": "1+1", "answer": "2"}, {"id": "b", "question": "2+2", "answer": "4"}]
COLUMNS = "question=prompt,answer=solution"


def _folder(tmp_path: Path, rows: list[dict], name: str = "ds") -> Path:
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / name))
    return tmp_path / name


def test_a_folder_parquet_and_arrow_give_the_same_tasks(tmp_path: Path) -> None:
    """save_to_disk folder, .parquet and .arrow (an IPC stream and an IPC file) read the same rows."""
    import pyarrow as pa
    import pyarrow.ipc as ipc

    folder = _folder(tmp_path, ROWS)
    ds = datasets.Dataset.from_list(ROWS)
    ds.to_parquet(str(tmp_path / "t.parquet"))
    table = pa.Table.from_pylist(ROWS)
    with ipc.new_file(str(tmp_path / "file.arrow"), table.schema) as w:
        w.write_table(table)
    stream = next(folder.glob("*.arrow"))  # what datasets writes: an Arrow IPC stream
    for path in (folder, tmp_path / "t.parquet", tmp_path / "file.arrow", stream):
        assert load_tasks(path, columns=COLUMNS) == TASKS, path
    assert load_tasks(folder) == ROWS  # no mapping: the rows as they are


def test_a_dataset_dict_takes_its_split_and_names_the_splits_it_has(tmp_path: Path) -> None:
    """A DatasetDict: train by default, --split picks another; without train, the error lists the splits."""
    both = datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:1]),
                                 "test": datasets.Dataset.from_list(ROWS[1:])})
    both.save_to_disk(str(tmp_path / "both"))
    assert [t["id"] for t in load_tasks(tmp_path / "both")] == ["a"]
    assert [t["id"] for t in load_tasks(tmp_path / "both", split="test")] == ["b"]
    datasets.DatasetDict({"test": datasets.Dataset.from_list(ROWS), "dev": datasets.Dataset.from_list(ROWS)}
                         ).save_to_disk(str(tmp_path / "notrain"))
    with pytest.raises(InvalidInput, match=r"no split 'train'.*its splits are \['dev', 'test'\]"):
        load_tasks(tmp_path / "notrain")
    with pytest.raises(InvalidInput, match=r"no split 'validation'"):
        load_tasks(tmp_path / "both", split="validation")


def test_column_mapping_errors(tmp_path: Path) -> None:
    """A mapping to a missing column names the columns there are; a malformed pair is refused."""
    folder = _folder(tmp_path, ROWS)
    with pytest.raises(InvalidInput, match=r"no column 'question'.*\['id', 'prompt', 'solution'\]"):
        load_tasks(folder, columns="q=question")
    with pytest.raises(InvalidInput, match="not field=column"):
        load_tasks(folder, columns="question")
    with pytest.raises(InvalidInput, match="apply to a dataset"):
        (tmp_path / "t.jsonl").write_text('{"id": 1}\n')
        load_tasks(tmp_path / "t.jsonl", columns=COLUMNS)


def test_bad_rows_are_named_by_their_row_number(tmp_path: Path) -> None:
    """Not a mapping after the mapping, an empty id, duplicate ids, NaN, a timestamp: each names its row."""
    nested = _folder(tmp_path, [{"task": {"id": "a", "q": "1"}}, {"task": None}], "nested")
    with pytest.raises(InvalidInput, match=r"nested row 1: column 'task' holds NoneType, where a task must be a mapping"):
        load_tasks(nested, columns="=task")
    cases = {
        "noid": ([{"id": "a", "q": "1"}, {"id": None, "q": "2"}], r"noid row 1: no id"),
        "dup": ([{"id": "a"}, {"id": "b"}, {"id": "a"}], r"duplicate task ids: 'a' \(rows 0 and 2\)"),
        "nan": ([{"id": "a", "x": 1.0}, {"id": "b", "x": float("nan")}], r"nan row 1: holds NaN"),
        "time": ([{"id": "a", "t": datetime.datetime(2024, 1, 1)}], r"time row 0: cannot encode as msgpack"),
    }
    for name, (rows, message) in cases.items():
        with pytest.raises(InvalidInput, match=message):
            load_tasks(_folder(tmp_path, rows, name))


def test_a_dataset_without_rows_and_a_file_that_is_not_one(tmp_path: Path) -> None:
    """A dataset without rows has no tasks; a .parquet that is not parquet is refused, naming the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"id": pa.array([], pa.string())}), str(tmp_path / "empty.parquet"))
    with pytest.raises(InvalidInput, match="has no tasks"):
        load_tasks(tmp_path / "empty.parquet")
    (tmp_path / "x.parquet").write_text("not parquet")
    with pytest.raises(InvalidInput, match=r"x\.parquet is not a readable parquet file"):
        load_tasks(tmp_path / "x.parquet")


def test_the_run_reads_its_datasets_with_its_settings(tmp_path: Path) -> None:
    """train_split, val_split and task_columns reach the loader for the training and validation data."""
    from fulmen.settings import AlgorithmSettings
    from fulmen_algorithm.start import algorithm_inputs

    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS[:1]), "test": datasets.Dataset.from_list(ROWS[1:])}
                         ).save_to_disk(str(tmp_path / "both"))
    settings = AlgorithmSettings(train_data=tmp_path / "both", val_data=tmp_path / "both", val_split="test",
                                 task_columns=COLUMNS, total_steps=1, model_dir=tmp_path, data_dir=tmp_path)
    inputs = algorithm_inputs(settings)
    assert inputs.tasks == TASKS[:1] and inputs.val_tasks == TASKS[1:]
