"""Loading a task dataset: JSON lines, or a Hugging Face `datasets` folder saved with save_to_disk.

Every task gets a stable id (its ``id`` field, else a hash of its content): rollout ids are built
from it, which is what makes enqueuing idempotent and a restarted run enqueue nothing twice.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from fulmen.errors import InvalidInput

Task = dict[str, Any]


def task_id(task: Task) -> str:
    value = task.get("id")
    if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
        return str(value).replace(" ", "_")[:80]
    return "t-" + hashlib.blake2b(json.dumps(task, sort_keys=True).encode(), digest_size=8).hexdigest()


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
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                task = json.loads(line)
            except json.JSONDecodeError as e:
                raise InvalidInput(f"{path}:{number}: not valid JSON ({e.msg})") from None
            if not isinstance(task, dict):
                raise InvalidInput(f"{path}:{number}: a task must be a JSON object")
            tasks.append(task)
    if not tasks:
        raise InvalidInput(f"dataset {path} has no tasks")
    ids = [task_id(t) for t in tasks]
    if len(set(ids)) != len(ids):
        duplicates = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise InvalidInput(f"dataset {path} has duplicate task ids {duplicates}")
    return tasks
