"""Reading a JSON-lines task file into rollout requests, with a clear reason for every bad line."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from fulmen.errors import FulmenError
from fulmen.records import Rollout
from fulmen.store import RedisStore
from fulmen.tasks import own_id, parse_task_lines, task_id


@dataclass(frozen=True, slots=True)
class BadLine:
    line_number: int
    reason: str


def parse_tasks(
    stream: IO[str], store: RedisStore, *, id_field: str | None, defaults: dict[str, Any]
) -> Iterator[Rollout | BadLine]:
    """One result per non-blank line: a validated rollout request, or why the line cannot be one.

    A line is a JSON object, the task given to the agent as the rollout's input. Its rollout id is
    its `task_id` (the value of ``id_field`` if the task has one, else a hash of its content; the n-th
    copy of the same content gets its own): either way, pushing the same file twice enqueues nothing new."""
    seen: Counter[str] = Counter()
    for number, task in parse_task_lines(stream):
        if isinstance(task, str):
            yield BadLine(number, task)
            continue
        value = task[id_field] if id_field and id_field in task else ""
        if not isinstance(value, str | int) or isinstance(value, bool):
            yield BadLine(number, f"field {id_field!r} must be a string or an integer to serve as rollout id")
            continue
        rollout_id = task_id(task, id_field)
        if own_id(task, id_field) is None:  # named by its content: the n-th copy gets its own id
            seen[rollout_id] += 1
            rollout_id += f"-{seen[rollout_id]}" if seen[rollout_id] > 1 else ""
        try:
            rollout = store.new_rollout(task, rollout_id=rollout_id, **defaults)
            rollout.to_hash(store.max_record_bytes)  # size check now, not halfway through the push
        except FulmenError as e:
            yield BadLine(number, str(e))
            continue
        yield rollout
