"""Loading a task dataset: JSON lines, or a Hugging Face dataset (a save_to_disk folder, a .parquet or an
.arrow file, with a split and a column mapping: `fulmen.tasks.datasets`).

Every task gets a stable id (`fulmen.tasks.task_id`: its ``id`` field, else a hash of its content):
rollout ids are built from it, which is what makes enqueuing idempotent and a restarted run enqueue
nothing twice.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from fulmen.codec import pack
from fulmen.errors import FulmenError, InvalidInput
from fulmen.tasks import DEFAULT_ID_FIELD, Task, is_finite, own_id, parse_task_lines
from fulmen.tasks import task_id as library_task_id

__all__ = ["Task", "load_tasks", "task_id"]

# A task's id becomes part of its rollout ids: kept short and free of spaces.
MAX_ID_CHARS = 80
# How many duplicate ids an error message lists.
SHOWN_DUPLICATES = 5


def task_id(task: Task) -> str:
    """The task's id as a part of rollout ids (`fulmen.tasks.task_id`, spaces replaced, shortened)."""
    return library_task_id(task).replace(" ", "_")[:MAX_ID_CHARS]


def load_tasks(path: str | Path, split: str | None = None, columns: str | dict[str, str] | None = None) -> list[Task]:
    """Tasks from a .jsonl file or a dataset (``split`` of a DatasetDict folder, default train;
    ``columns``: task field = dataset column, `fulmen.tasks.datasets.parse_columns`); a clear error
    names the bad line (from 1) or row (from 0, as ``dataset[n]``)."""
    from fulmen.tasks.datasets import is_dataset, open_rows, parse_columns

    path = Path(path)
    if not path.exists():
        raise InvalidInput(f"dataset {path} does not exist")
    mapping = parse_columns(columns) if isinstance(columns, str) or columns is None else dict(columns)
    if is_dataset(path):
        tasks, unit = _dataset_tasks(path, open_rows(path, split, mapping).rows()), "row"
    else:
        if split or mapping:
            raise InvalidInput(f"{path}: a split and a column mapping apply to a dataset (a folder, .parquet or "
                               ".arrow), not JSON lines")
        tasks, unit = _jsonl_tasks(path), "line"
    if not tasks:
        raise InvalidInput(f"dataset {path} has no tasks")
    ids = [task_id(t) for t in tasks]
    if len(set(ids)) != len(ids):
        first: dict[str, int] = {}
        duplicates = [f"{i!r} ({unit}s {first[i]} and {n})" for n, i in _numbered(ids, unit)
                      if first.setdefault(i, n) != n][:SHOWN_DUPLICATES]
        raise InvalidInput(f"dataset {path} has duplicate task ids: {', '.join(duplicates)}")
    return tasks


def _numbered(ids: list[str], unit: str) -> list[tuple[int, str]]:
    """Each id with its line (from 1) or row (from 0) number."""
    return list(enumerate(ids, start=1 if unit == "line" else 0))


def _jsonl_tasks(path: Path) -> list[Task]:
    tasks = []
    with path.open() as f:
        for number, task in parse_task_lines(f):
            if isinstance(task, str):
                raise InvalidInput(f"{path}:{number}: {task}")
            tasks.append(task)
    return tasks


def _dataset_tasks(path: Path, rows: Iterator[tuple[int, Task | str]]) -> list[Task]:
    """The rows' tasks; the first bad one raises InvalidInput naming its row: not a mapping, an empty
    ``id``, NaN or Infinity, a value msgpack cannot carry (a timestamp, a decimal)."""
    tasks = []
    for number, task in rows:
        reason = task if isinstance(task, str) else _bad_row(task)
        if reason is not None:
            raise InvalidInput(f"{path} row {number}: {reason}")
        tasks.append(task)
    return tasks


def _bad_row(task: Task) -> str | None:
    if DEFAULT_ID_FIELD in task and own_id(task) is None:
        return f"no id: its {DEFAULT_ID_FIELD!r} is {task[DEFAULT_ID_FIELD]!r}, where a string or an integer must be"
    if not is_finite(task):
        return "holds NaN or Infinity where a number must be (a missing value?)"
    try:
        pack(task)
    except FulmenError as e:
        return str(e)
    return None
