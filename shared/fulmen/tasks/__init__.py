"""Tasks as Fulmen reads them: one JSON object per line, and one id per task.

`task_id` is the only way a task is named: `fulmen push` builds rollout ids from it, the algorithm
its GRPO group ids, the adapter its fallback group key. A task's id is stable across processes and
restarts (which is what makes pushing a file twice, or restarting a run, enqueue nothing new).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

Task = dict[str, Any]

# The field a task names itself with, unless told otherwise.
DEFAULT_ID_FIELD = "id"
# A task without an id is named by its content: this prefix and the first hex digits of a SHA-1 of
# its canonical JSON. `fulmen push` has named tasks so from the start: experiments already stored
# hold these ids, and pushing their files again must find them.
CONTENT_ID_PREFIX = "task-"
CONTENT_ID_HEX = 16


def own_id(task: Mapping[str, Any], id_field: str | None = DEFAULT_ID_FIELD) -> str | None:
    """The id a task gives itself: its ``id_field`` when that is a non-empty string or an integer."""
    value = task.get(id_field) if id_field else None
    if isinstance(value, str | int) and not isinstance(value, bool) and str(value):
        return str(value)
    return None


def is_finite(task: Any) -> bool:
    """False when the task holds NaN or ±Infinity (JSON has no such numbers; Python's json reads
    them): one C-level pass of the encoder, which refuses them with allow_nan=False."""
    try:
        json.dumps(task, allow_nan=False, default=str)
    except ValueError:
        return False
    return True


def content_id(task: Any) -> str:
    """The id of a task by its content alone: equal tasks, equal ids (key order does not matter)."""
    text = json.dumps(task, sort_keys=True, default=str)
    return CONTENT_ID_PREFIX + hashlib.sha1(text.encode()).hexdigest()[:CONTENT_ID_HEX]


def task_id(task: Any, id_field: str | None = DEFAULT_ID_FIELD) -> str:
    """The task's own id if it has one, else its content id."""
    found = own_id(task, id_field) if isinstance(task, Mapping) else None
    return found if found is not None else content_id(task)


def parse_task_lines(lines: Iterable[str | bytes]) -> Iterator[tuple[int, Task | str]]:
    """(line number, the task or why the line is not one) for every non-blank line. Lines may be
    bytes (a file read in binary): each is decoded on its own, so one line that is not UTF-8 is one
    bad line, not the end of the file."""
    for number, line in enumerate(lines, start=1):
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield number, f"not valid UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})"
                continue
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except json.JSONDecodeError as e:
            yield number, f"not valid JSON ({e.msg} at column {e.colno})"
            continue
        except RecursionError:
            yield number, "not valid JSON (nested too deeply)"
            continue
        except ValueError as e:  # an integer longer than Python converts (sys.int_info.str_digits_check_threshold)
            yield number, f"not valid JSON ({str(e).split(';')[0]})"
            continue
        if not isinstance(task, dict):
            yield number, f"a task must be a JSON object, got {type(task).__name__}"
            continue
        yield number, task
