"""One tracker's thread: entries wait in a bounded queue, each is tried a bounded number of times with
jittered backoff, and what the tracker cannot take is dropped and counted, never waited for.

`TrackerWorker.offer` never blocks: a tracker that hangs or fails fills its own queue and loses
entries; the reporter, the algorithm and the trainer never wait on it. Why: docs/design/telemetry.md.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from fulmen.errors import InvalidInput
from fulmen.telemetry.trackers.tracker import Entry, RunInfo, Tracker

log = logging.getLogger(__name__)

QUEUE_SIZE = 1000  # entries waiting per tracker: minutes of steps, the bound a hung tracker can hold
WAKE_S = 0.2  # how often an idle worker looks whether it is asked to close


@dataclass(frozen=True, slots=True)
class Retry:
    """How often one call to a tracker is tried, and the full-jitter backoff between two tries."""

    attempts: int = 3
    first_s: float = 1.0
    max_s: float = 10.0

    def __post_init__(self) -> None:
        if self.attempts < 1 or self.first_s < 0 or self.max_s < self.first_s:
            raise InvalidInput(f"invalid tracker retry {self}: attempts >= 1, 0 <= first_s <= max_s")

    def delay_s(self, retry: int, rng: random.Random) -> float:
        """The wait before try ``retry + 1`` (``retry`` >= 1): uniform up to first_s * 2^(retry-1), capped."""
        return rng.uniform(0.0, min(self.max_s, self.first_s * 2 ** (retry - 1)))


class TrackerWorker:
    """Feeds one `Tracker` from its own daemon thread: open the run, log entries in order, close."""

    def __init__(self, tracker: Tracker, run: RunInfo, *, queue_size: int = QUEUE_SIZE,
                 retry: Retry | None = None) -> None:
        self.tracker, self.run = tracker, run
        self.retry = retry or Retry()
        self.queue: queue.Queue[Entry] = queue.Queue(maxsize=queue_size)
        self.reported = 0
        self.refused = 0  # offered while the queue was full (counted by the offering thread)
        self.failed = 0  # tried and failed every time, or left when the run could not open (this thread)
        self.closing = threading.Event()
        self._warned: set[str] = set()
        self._broken = False  # the run could not be opened: entries are dropped as they come
        self._rng = random.Random()
        self.thread = threading.Thread(target=self._work, name=f"tracker-{tracker.name}", daemon=True)

    @property
    def name(self) -> str:
        return self.tracker.name

    @property
    def dropped(self) -> int:
        """Entries this tracker will never get (refused, failed, or still queued when it was left)."""
        return self.refused + self.failed

    def start(self) -> None:
        self.thread.start()

    def offer(self, entry: Entry) -> bool:
        """Queue ``entry`` without waiting; False (and counted) when the queue is full."""
        try:
            self.queue.put_nowait(entry)
        except queue.Full:
            self.refused += 1
            self._warn_once("full", "tracker %s is not keeping up (%d entries waiting): dropping entries until it does",
                            self.name, self.queue.qsize())
            return False
        return True

    def stop(self) -> None:
        """Ask the thread to log what is queued, close the run and end."""
        self.closing.set()

    def join(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the thread to end; False if it is still inside the tracker."""
        self.thread.join(max(0.0, timeout_s))
        return not self.thread.is_alive()

    def _work(self) -> None:
        self._broken = not self._attempt("open", lambda: self.tracker.open(self.run))
        if self._broken:
            log.error("tracker %s: the run could not be opened; it gets nothing in this process", self.name)
        while True:
            try:
                entry = self.queue.get(timeout=WAKE_S)
            except queue.Empty:
                if self.closing.is_set():
                    break
                continue
            if self._broken:
                self.failed += 1
            elif self._attempt("log", lambda e=entry: self.tracker.log(e)):  # type: ignore[misc]
                self.reported += 1
            else:
                self.failed += 1
        if not self._broken:
            self._attempt("close", self.tracker.close)

    def _attempt(self, what: str, call: Callable[[], None]) -> bool:
        """``call`` until it returns, up to the retry's attempts; the first error of this tracker is
        logged (with its name), later ones are only counted."""
        for n in range(1, self.retry.attempts + 1):
            try:
                call()
                return True
            except Exception as e:  # a tracker's error of any kind: reporting must never stop training
                self._warn_once("error", "tracker %s: %s failed (%s: %s); every call is tried %d times, then its "
                                "entry is dropped; further errors are counted, not logged",
                                self.name, what, type(e).__name__, e, self.retry.attempts)
                if n < self.retry.attempts:
                    # closing cuts the wait short: the drain at the end has a deadline of its own
                    self.closing.wait(self.retry.delay_s(n, self._rng))
        return False

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)


def join_all(workers: list[TrackerWorker], timeout_s: float) -> list[TrackerWorker]:
    """Stop every worker and wait for them together, up to ``timeout_s`` in all; those left behind."""
    for worker in workers:
        worker.stop()
    deadline = time.monotonic() + timeout_s
    return [w for w in workers if not w.join(deadline - time.monotonic())]
