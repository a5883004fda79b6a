"""`fulmen archive --every`: an archive pass every so often until stopped (SIGTERM), a line per pass.

A pass that fails (Redis unreachable, a full disk) is logged and tried again sooner, with backoff up
to the interval; only bad input (`InvalidInput`: another experiment's directory) ends the loop. When
stopped, the pass in hand (or a last one, so that a run's end is archived) gets `FINAL_PASS_S`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

from redis.exceptions import RedisError

from fulmen.archive.write import DEFAULT_CHUNK, archive
from fulmen.errors import FulmenError, InvalidInput
from fulmen.store.redis_store import RedisStore

log = logging.getLogger("fulmen.archive")

RETRY_S = 5.0  # the first wait after a failed pass (doubling, up to the interval)
FINAL_PASS_S = 3.0  # honcho sends SIGKILL 5 s after SIGTERM; an interrupted pass leaves whole files only


async def archive_every(store: RedisStore, directory: Path, every_s: float, stop: asyncio.Event, *,
                        chunk: int = DEFAULT_CHUNK, samples: bool = True, retry_s: float = RETRY_S) -> int:
    """Archive ``store`` into ``directory`` every ``every_s`` until ``stop`` is set; the passes that succeeded."""
    passes = failures = 0
    log.info("archiving experiment %s to %s every %gs", store.experiment, directory, every_s)
    while not stop.is_set():
        task = asyncio.create_task(_pass(store, directory, chunk, samples))
        stopped = asyncio.create_task(stop.wait())
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not task.done():  # stopped mid-pass: it ends, briefly, and is the last
            return passes + await _bounded(task)
        ok = task.result()
        passes, failures = passes + ok, 0 if ok else failures + 1
        wait_s = every_s if ok else min(every_s, retry_s * 2 ** (failures - 1))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), wait_s)
    # stopped between passes: a last one, so that what happened since (a run's end) is archived
    return passes + await _bounded(asyncio.create_task(_pass(store, directory, chunk, samples)))


async def _pass(store: RedisStore, directory: Path, chunk: int, samples: bool) -> bool:
    """One pass, logged; False if it failed (and will be tried again)."""
    try:
        report = await archive(store, directory, chunk=chunk, samples=samples)
    except InvalidInput:
        raise  # it will not get better by waiting
    except (RedisError, OSError, FulmenError) as e:
        log.warning("archive pass failed, trying again: %s: %s", type(e).__name__, e)
        return False
    log.info("archived %s", report.summary())
    return True


async def _bounded(task: asyncio.Task[bool]) -> int:
    """Wait up to FINAL_PASS_S for a pass, then cancel it (its files are written whole or not at
    all); 1 if it succeeded. InvalidInput from it is raised."""
    done, _ = await asyncio.wait({task}, timeout=FINAL_PASS_S)
    if done:
        return int(task.result())
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    log.warning("stopped during an archive pass: the next run goes on from its last whole file")
    return 0
