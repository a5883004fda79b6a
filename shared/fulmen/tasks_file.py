"""Reading a JSON-lines task file into rollout requests, with a clear reason for every bad line."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO, Any

from fulmen.errors import FulmenError
from fulmen.records import Rollout
from fulmen.store import RedisStore


@dataclass(frozen=True, slots=True)
class BadLine:
    line_number: int
    reason: str


def parse_tasks(
    stream: IO[str], store: RedisStore, *, id_field: str | None, defaults: dict[str, Any]
) -> Iterator[Rollout | BadLine]:
    """One result per non-blank line: a validated rollout request, or why the line cannot be one.

    A line is a JSON object, the task given to the agent as the rollout's input. Its rollout id is
    the value of ``id_field`` if the task has one, else a hash of the task's content (the n-th copy of
    the same task gets its own): either way, pushing the same file twice enqueues nothing new."""
    seen: Counter[str] = Counter()
    for number, line in enumerate(stream, start=1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except json.JSONDecodeError as e:
            yield BadLine(number, f"not valid JSON ({e.msg} at column {e.colno})")
            continue
        if not isinstance(task, dict):
            yield BadLine(number, f"a task must be a JSON object, got {type(task).__name__}")
            continue
        rollout_id = None
        if id_field and id_field in task:
            value = task[id_field]
            if not isinstance(value, str | int) or isinstance(value, bool):
                yield BadLine(
                    number, f"field {id_field!r} must be a string or an integer to serve as rollout id"
                )
                continue
            rollout_id = str(value)
        else:
            digest = hashlib.sha1(json.dumps(task, sort_keys=True).encode()).hexdigest()[:16]
            seen[digest] += 1
            rollout_id = f"task-{digest}" + (f"-{seen[digest]}" if seen[digest] > 1 else "")
        try:
            rollout = store.new_rollout(task, rollout_id=rollout_id, **defaults)
            rollout.to_hash(store.max_record_bytes)  # size check now, not halfway through the push
        except FulmenError as e:
            yield BadLine(number, str(e))
            continue
        yield rollout
