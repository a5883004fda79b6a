"""Reading a JSON-lines task file (or a dataset's rows: `fulmen.tasks.datasets`) into rollout requests,
with a clear reason for every bad line.

No line can end the read: bytes that are not UTF-8, nesting or integers Python's json refuses,
values msgpack cannot hold are each one `BadLine` with its number, and the next line is read.
An id given twice in the file is a bad line (the first one stands); NaN or Infinity is a bad line
with ``strict`` and a `LineNote` (the task is queued) otherwise."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import IO, Any

from fulmen.errors import FulmenError
from fulmen.records import Priority, Rollout
from fulmen.store import RedisStore
from fulmen.tasks import Task, is_finite, own_id, parse_task_lines, task_id

# What building or sizing a rollout from a decoded task may raise on hostile values (a lone
# surrogate, an integer beyond 64 bits, nesting past the encoder's limit), besides FulmenError.
_ENCODING_ERRORS = (FulmenError, ValueError, TypeError, OverflowError, RecursionError)


@dataclass(frozen=True, slots=True)
class BadLine:
    line_number: int
    reason: str


@dataclass(frozen=True, slots=True)
class LineNote:
    """Something to report about a line whose task is queued all the same."""

    line_number: int
    reason: str


NON_FINITE = "holds NaN or Infinity, which JSON does not allow"


def parse_tasks(
    stream: IO[str] | IO[bytes], store: RedisStore, *, id_field: str | None, defaults: dict[str, Any],
    strict: bool = False, priority_field: str | None = None,
) -> Iterator[Rollout | BadLine | LineNote]:
    """`check_tasks` of a JSON-lines stream, line by line (numbered from 1)."""
    return check_tasks(parse_task_lines(stream), store, id_field=id_field, defaults=defaults, strict=strict,
                       priority_field=priority_field)


def check_tasks(
    numbered: Iterable[tuple[int, Task | str]], store: RedisStore, *, id_field: str | None,
    defaults: dict[str, Any], strict: bool = False, priority_field: str | None = None, unit: str = "line",
) -> Iterator[Rollout | BadLine | LineNote]:
    """One result per (number, task or reason) pair (a JSON line's, or a dataset row's from
    `fulmen.tasks.datasets`): a validated rollout request, or why that line or row cannot be one.

    A task is a JSON object, the task given to the agent as the rollout's input. Its rollout id is
    its `task_id` (the value of ``id_field`` if the task has one, else a hash of its content; the n-th
    copy of the same content gets its own): either way, pushing the same file twice enqueues nothing new.
    ``priority_field``: a task with this field is queued in the lane it names (urgent, normal, low; any
    other value is a bad line), over the ``priority`` of ``defaults``. ``unit``: what a number counts
    (line, row), in the reasons that name another one."""
    seen: Counter[str] = Counter()
    first_line: dict[str, int] = {}  # own id -> the line that gave it first
    for number, task in numbered:
        if isinstance(task, str):
            yield BadLine(number, task)
            continue
        value = task[id_field] if id_field and id_field in task else ""
        if not isinstance(value, str | int) or isinstance(value, bool):
            yield BadLine(number, f"field {id_field!r} must be a string or an integer to serve as rollout id")
            continue
        finite = is_finite(task)
        if not finite and strict:
            yield BadLine(number, NON_FINITE)
            continue
        try:
            rollout_id = task_id(task, id_field)
            if own_id(task, id_field) is None:  # named by its content: the n-th copy gets its own id
                seen[rollout_id] += 1
                rollout_id += f"-{seen[rollout_id]}" if seen[rollout_id] > 1 else ""
            elif rollout_id in first_line:
                yield BadLine(number, f"duplicate id {rollout_id!r} (first on {unit} {first_line[rollout_id]})")
                continue
            options = defaults
            if priority_field and priority_field in task:
                options = {**defaults, "priority": Priority.parse(task[priority_field])}
            rollout = store.rollouts.new_rollout(task, rollout_id=rollout_id, **options)
            rollout.to_hash(store.max_record_bytes)  # size check now, not halfway through the push
        except _ENCODING_ERRORS as e:
            yield BadLine(number, _reason(e))
            continue
        first_line.setdefault(rollout_id, number)
        if not finite:
            yield LineNote(number, NON_FINITE)
        yield rollout


def _reason(error: BaseException) -> str:
    text = str(error) or type(error).__name__
    if isinstance(error, RecursionError):
        text = "nested too deeply"
    return text if len(text) <= 300 else text[:297] + "..."
