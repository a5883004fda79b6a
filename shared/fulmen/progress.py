"""Progress bars for the long commands: `fulmen push`, `export`, `archive`, `restore`, `eval`, the demos'
warm start and the final model's export all draw through `bar`.

A bar is drawn on stderr only when stderr is a terminal, and only one at a time per process; it is
transient (gone when the work ends, the command's summary line stays). Under honcho, in a pipe, a
log file or CI nothing is drawn: the log holds its usual lines only. While a bar is drawn, log lines
and prints go above it. Tests draw on a console of their own with `drawn_on`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import IO, Any, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

T = TypeVar("T")

COLUMNS = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
           TextColumn("{task.fields[note]}"))

_console: Console | None = None  # `drawn_on`'s, in place of stderr
_one_at_a_time = threading.Lock()  # `fulmen dev` runs every service in one process: a second bar stays silent


class Bar:
    """What a long job tells its bar as it goes; every call does nothing when no bar is drawn."""

    def __init__(self, progress: Progress | None = None, task: TaskID | None = None) -> None:
        self._progress, self._task = progress, task

    @property
    def drawn(self) -> bool:
        """Whether a bar is on screen (a job may skip the work of counting its total when not)."""
        return self._progress is not None

    def advance(self, steps: int = 1) -> None:
        if self._progress is not None and self._task is not None:
            self._progress.advance(self._task, steps)

    def each(self, items: Iterable[T]) -> Iterator[T]:
        """``items``, one by one, the bar a step further as each is consumed."""
        for item in items:
            yield item
            self.advance()

    def update(self, *, total: int | None = None, completed: int | None = None, what: str | None = None,
               note: str | None = None) -> None:
        """Set what is given: the total (None: left as it is), the steps done, the label, the text after the bar."""
        if self._progress is None or self._task is None:
            return
        fields: dict[str, Any] = {} if note is None else {"note": note}
        self._progress.update(self._task, total=total, completed=completed, description=what, **fields)


SILENT = Bar()  # the bar of a job nobody watches: the default of every job that takes one


def terminal() -> Console | None:
    """The console bars are drawn on now, or None when they are not drawn (stderr is no terminal)."""
    if _console is not None:
        return _console if _console.is_terminal else None
    # rich takes FORCE_COLOR (which CI systems set) as a terminal: a bar there would land in the log
    if not _isatty(sys.stderr):
        return None
    console = Console(stderr=True)
    return console if console.is_terminal and not console.is_dumb_terminal else None


@contextlib.contextmanager
def bar(what: str, total: int | None = None) -> Iterator[Bar]:
    """A bar labelled ``what`` of ``total`` steps (None: unknown, the count alone), drawn while the
    block runs when stderr is a terminal and no other bar is; gone when the block ends."""
    console = terminal()
    if console is None or not _one_at_a_time.acquire(blocking=False):
        yield SILENT
        return
    try:
        with Progress(*COLUMNS, console=console, transient=True) as progress, _logs_above():
            yield Bar(progress, progress.add_task(what, total=total, note=""))
    finally:
        _one_at_a_time.release()


@contextlib.contextmanager
def drawn_on(console: Console) -> Iterator[Console]:
    """Bars drawn on ``console`` while the block runs, if it is a terminal: a test's
    ``Console(file=StringIO(), force_terminal=True)`` shows what a terminal would."""
    global _console
    previous, _console = _console, console
    try:
        yield console
    finally:
        _console = previous


@contextlib.contextmanager
def _logs_above() -> Iterator[None]:
    """Log handlers that write to the terminal write through rich's stand-in for stderr while the
    bar is drawn (it prints their lines above the bar), not across the bar."""
    proxy = sys.stderr  # rich's stand-in for the terminal, from the start of the bar to its end
    real = getattr(proxy, "rich_proxied_file", None)
    moved = [h for h in logging.getLogger().handlers
             if real is not None and type(h) is logging.StreamHandler and h.stream is real]
    for handler in moved:
        handler.setStream(proxy)
    try:
        yield
    finally:
        for handler in moved:
            handler.setStream(real)  # type: ignore[arg-type]


def _isatty(stream: IO[str] | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except ValueError:  # closed
        return False
