"""Upstream attempt timeouts on one timer (`fulmen_llm_proxy.backends.upstream.deadlines`)."""

from __future__ import annotations

import asyncio

import pytest

from fulmen_llm_proxy.backends.upstream.deadlines import Deadlines


async def _wait(deadlines: Deadlines, delay_s: float, sleep_s: float) -> str:
    """Sleep ``sleep_s`` under a ``delay_s`` deadline: "done", or "timed out"."""
    task = deadlines.start(delay_s)
    try:
        await asyncio.sleep(sleep_s)
        return "done"
    except asyncio.CancelledError:
        if not deadlines.expired(task):
            raise
        return "timed out"
    finally:
        deadlines.stop(task)


async def test_each_await_ends_at_its_own_deadline() -> None:
    """Concurrent awaits with their own deadlines, later and earlier ones mixed: each one that
    outlives its deadline times out, near it, and the others finish."""
    deadlines = Deadlines()
    loop = asyncio.get_running_loop()
    started = loop.time()

    async def timed(delay_s: float, sleep_s: float) -> tuple[str, float]:
        outcome = await _wait(deadlines, delay_s, sleep_s)
        return outcome, loop.time() - started

    results = await asyncio.gather(timed(0.4, 1.0), timed(0.1, 1.0), timed(1.0, 0.05), timed(0.2, 0.3))
    assert [r[0] for r in results] == ["timed out", "timed out", "done", "timed out"]
    for (outcome, elapsed), expected in zip(results, [0.4, 0.1, 0.05, 0.2], strict=True):
        assert expected - 0.01 <= elapsed < expected + 0.5, (outcome, elapsed, expected)  # a busy machine is late


async def test_calls_with_later_deadlines_share_the_armed_timer() -> None:
    """A deadline later than the armed one arms nothing new; a sooner one re-arms."""
    deadlines = Deadlines()
    assert await _wait(deadlines, 30.0, 0) == "done"
    armed = deadlines._timer
    assert await _wait(deadlines, 30.0, 0) == "done"
    assert deadlines._timer is armed
    assert await _wait(deadlines, 0.05, 0.2) == "timed out"
    assert deadlines._timer is not armed


async def test_a_cancellation_from_elsewhere_is_not_a_timeout() -> None:
    """The task cancelled by its caller while it waits: the CancelledError propagates and the task
    is not left cancelling."""
    deadlines = Deadlines()
    task = asyncio.ensure_future(_wait(deadlines, 10.0, 10.0))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert deadlines._deadlines == {}


async def test_a_timed_out_task_is_not_left_cancelling() -> None:
    """After a timeout the task goes on as if never cancelled: a later await works."""
    deadlines = Deadlines()

    async def twice() -> tuple[str, str, int]:
        first = await _wait(deadlines, 0.05, 1.0)
        second = await _wait(deadlines, 1.0, 0.01)
        current = asyncio.current_task()
        assert current is not None
        return first, second, current.cancelling()

    assert await twice() == ("timed out", "done", 0)
