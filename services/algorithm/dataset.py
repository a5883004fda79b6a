"""Loading a task dataset: JSON lines, or a Hugging Face `datasets` folder saved with save_to_disk.

Every task gets a stable id (`fulmen.tasks.task_id`: its ``id`` field, else a hash of its content):
rollout ids are built from it, which is what makes enqueuing idempotent and a restarted run enqueue
nothing twice.
"""

from __future__ import annotations

from pathlib import Path

from fulmen.errors import InvalidInput
from fulmen.tasks import Task, parse_task_lines
from fulmen.tasks import task_id as library_task_id

__all__ = ["Task", "load_tasks", "task_id"]

# A task's id becomes part of its rollout ids: kept short and free of spaces.
MAX_ID_CHARS = 80
# How many duplicate ids an error message lists.
SHOWN_DUPLICATES = 5


def task_id(task: Task) -> str:
    """The task's id as a part of rollout ids (`fulmen.tasks.task_id`, spaces replaced, shortened)."""
    return library_task_id(task).replace(" ", "_")[:MAX_ID_CHARS]


def load_tasks(path: str | Path) -> list[Task]:
    """Tasks from a .jsonl file or a `datasets` folder; a clear error names the bad line."""
    path = Path(path)
    if not path.exists():
        raise InvalidInput(f"dataset {path} does not exist")
    if path.is_dir():
        try:
            import datasets  # optional: only for Hugging Face folders
        except ImportError:
            raise InvalidInput(
                f"{path} is a folder: reading a Hugging Face dataset needs `pip install datasets`"
            ) from None
        return [dict(row) for row in datasets.load_from_disk(str(path))]
    tasks = []
    with path.open() as f:
        for number, task in parse_task_lines(f):
            if isinstance(task, str):
                raise InvalidInput(f"{path}:{number}: {task}")
            tasks.append(task)
    if not tasks:
        raise InvalidInput(f"dataset {path} has no tasks")
    ids = [task_id(t) for t in tasks]
    if len(set(ids)) != len(ids):
        duplicates = sorted({i for i in ids if ids.count(i) > 1})[:SHOWN_DUPLICATES]
        raise InvalidInput(f"dataset {path} has duplicate task ids {duplicates}")
    return tasks
