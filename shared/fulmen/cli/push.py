"""`fulmen push`'s work: a JSON-lines task file or a Hugging Face dataset (`fulmen.tasks.datasets`) queued
as rollouts in batches, every bad line or row reported with its number, then a summary and the exit
code. Checking each task: `fulmen.cli.tasks_file`."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import IO, Any

import typer

from fulmen import progress
from fulmen.cli.service import err, error_exit, out, run_on_store
from fulmen.cli.tasks_file import BadLine, LineNote, check_tasks, parse_tasks
from fulmen.errors import FulmenError, InvalidInput
from fulmen.records import Rollout
from fulmen.settings import CommonSettings
from fulmen.store import RedisStore
from fulmen.tasks.datasets import TaskRows, is_dataset, open_rows, parse_columns


@dataclass(frozen=True)
class PushOptions:
    defaults: dict[str, Any]  # every rollout's mode, resources_id, priority and config
    id_field: str | None  # the task field used as rollout id (None: a hash of the task)
    strict: bool  # any bad line refuses the whole file
    batch_size: int  # rollouts per round trip
    priority_field: str | None  # the task field that names a line's own priority
    unit: str = "line"  # what the numbers in messages count: JSON lines, or a dataset's rows


@dataclass
class Pushed:
    created: int = 0
    existed: int = 0  # rollouts already in the store under the same id, left unchanged
    bad: list[BadLine] = field(default_factory=list)


@contextmanager
def task_stream(file: str) -> Iterator[tuple[IO[bytes], int | None]]:
    """The file's bytes (standard input for ``-``) and its number of non-blank lines (None for
    standard input), closed after; a file that cannot be read exits 2."""
    # Bytes, decoded line by line (`fulmen.tasks.parse_task_lines`): a line that is not UTF-8 is one
    # bad line, where a text stream would raise on it and end the whole push.
    stdin = getattr(sys.stdin, "buffer", sys.stdin)
    try:
        stream = stdin if file == "-" else open(file, "rb")  # noqa: SIM115 - closed below
        total = None
        if stream is not stdin:
            total = sum(1 for line in stream if line.strip())  # for the progress bar
            stream.seek(0)
    except OSError as e:
        err.print(f"[red]error:[/red] cannot read {file}: {e.strerror}")
        raise typer.Exit(2) from None
    try:
        yield stream, total
    finally:
        if stream is not stdin:
            stream.close()


def open_dataset(file: str, split: str | None, columns: dict[str, str]) -> TaskRows:
    """The dataset's rows to read (`fulmen.tasks.datasets.open_rows`); one that cannot be opened, or
    lacks the split or a mapped column, exits 2 saying why."""
    try:
        return open_rows(file, split, columns)
    except FulmenError as e:
        err.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None


def push_file(settings: CommonSettings, file: str, split: str | None, column: list[str] | None,
              options: PushOptions) -> None:
    """`fulmen push FILE`: a dataset (with its split and column mapping) or JSON lines, queued, then
    the report and its exit code."""
    dataset = file != "-" and is_dataset(file)
    try:
        columns = parse_columns(column)
    except InvalidInput as e:
        raise error_exit(str(e)) from None
    if not dataset and (split or columns):
        raise error_exit("--split and --column apply to a dataset (a folder, .parquet or .arrow), not JSON lines")
    options = replace(options, unit="row" if dataset else "line")
    if dataset:
        rows = open_dataset(file, split, columns)
        pushed = run_on_store(settings, lambda store: push_tasks(store, rows, rows.total, options))
    else:
        with task_stream(file) as (stream, total):
            pushed = run_on_store(settings, lambda store: push_tasks(store, stream, total, options))
    report(pushed, options.strict, settings.experiment, options.unit)


async def push_tasks(store: RedisStore, stream: IO[bytes] | TaskRows, total: int | None,
                     options: PushOptions) -> Pushed:
    """Queue the tasks of a JSON-lines stream or a dataset's rows; with ``options.strict``, nothing at
    all when a line or row is bad."""
    await store.queue.ensure()
    check = {"id_field": options.id_field, "defaults": options.defaults, "strict": options.strict,
             "priority_field": options.priority_field}
    items: Iterable[Rollout | BadLine | LineNote] = (
        check_tasks(stream.rows(), store, unit=options.unit, **check) if isinstance(stream, TaskRows)
        else parse_tasks(stream, store, **check)
    )
    if options.strict:
        items = list(items)  # validate everything before queuing anything
        bad = [x for x in items if isinstance(x, BadLine)]
        if bad:
            return Pushed(bad=bad)
    return await _queue_in_batches(store, items, total, options.batch_size, options.unit)


async def _queue_in_batches(
    store: RedisStore, items: Iterable[Rollout | BadLine | LineNote], total: int | None, batch_size: int,
    unit: str = "line",
) -> Pushed:
    """Enqueue the rollouts ``batch_size`` at a time, each bad line (row) or note printed as it comes,
    under a progress bar (on a terminal) of ``total`` lines (rows)."""
    pushed = Pushed()
    with progress.bar("push", total) as bar:
        batch: list[Rollout] = []
        for item in itertools.chain(items, [None]):  # the bar moves as the file is read
            if isinstance(item, LineNote):
                err.print(f"[yellow]{unit} {item.line_number}:[/yellow] {item.reason} (queued)")
                continue
            if isinstance(item, BadLine):
                pushed.bad.append(item)
                err.print(f"[yellow]{unit} {item.line_number}:[/yellow] {item.reason} (skipped)")
                bar.advance()
                continue
            if item is not None:
                batch.append(item)
            if batch and (item is None or len(batch) >= batch_size):
                results = await store.rollouts.enqueue_rollouts(batch)
                pushed.created += sum(results)
                pushed.existed += len(results) - sum(results)
                bar.advance(len(batch))
                batch = []
    return pushed


def report(pushed: Pushed, strict: bool, experiment: str, unit: str = "line") -> None:
    """Print what the push did; exit 1 when lines (rows) were refused and nothing was queued or present."""
    if strict and pushed.bad:
        for b in pushed.bad:
            err.print(f"[red]{unit} {b.line_number}:[/red] {b.reason}")
        err.print(f"[red]refused:[/red] {len(pushed.bad)} bad {unit}(s) and --strict; nothing was queued")
        raise typer.Exit(1)
    summary = f"queued {pushed.created} rollout(s) in experiment {experiment!r}"
    if pushed.existed:
        summary += f"; {pushed.existed} already present (same id), left unchanged"
    if pushed.bad:
        summary += f"; skipped {len(pushed.bad)} bad {unit}(s)"
    out.print(summary)
    if pushed.bad and not pushed.created and not pushed.existed:
        raise typer.Exit(1)
