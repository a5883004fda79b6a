"""The demo folder's preparation lock: two demos started in one folder prepare it once, in turn."""

from __future__ import annotations

import threading
import time
from pathlib import Path

from fulmen.demo.warm_start import preparing


def test_a_second_preparation_waits_for_the_first_to_finish(tmp_path: Path) -> None:
    """While one process prepares a folder, another one's preparation starts only after it ends."""
    order: list[str] = []
    first_in, second_tried = threading.Event(), threading.Event()

    def first() -> None:
        with preparing(tmp_path / "demo"):
            order.append("first in")
            first_in.set()
            second_tried.wait(10)
            time.sleep(0.2)  # without the lock, the second would be in by now
            order.append("first out")

    def second() -> None:
        first_in.wait(10)
        second_tried.set()
        with preparing(tmp_path / "demo"):  # flock: a second open file of the same lock conflicts
            order.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert order == ["first in", "first out", "second in"]


def test_a_lock_left_by_a_dead_process_does_not_block(tmp_path: Path) -> None:
    """The lock is the OS's, not a file's presence: a lock file left behind is taken at once."""
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / ".prepare.lock").write_text("")
    with preparing(tmp_path / "demo"):
        entered = True
    assert entered
