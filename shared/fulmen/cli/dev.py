"""`fulmen dev`: every service of the Procfile as an asyncio task in this one process, on the embedded
Redis, so a debugger can stop in the agent, the adapter or the loss and step through one rollout.

Each task is a `Service`'s ``run(settings, stop)``, as its command runs it: the watchdog's, and those
each service's command carries (the ``fulmen.services`` entry points). Why: docs/design/dev.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fulmen.cli.service import Service, Stopped, opened_store, stop_on_signals
from fulmen.settings import CommonSettings, load_settings
from fulmen.store import RedisStore

log = logging.getLogger("fulmen.dev")

GROUP = "fulmen.services"
# The services `fulmen dev` runs, in the order their tasks start (the Procfile's; `fulmen dev` keeps
# one of algorithm and demo); the algorithm's end ends the whole run, as under honcho.
ORDER = ("watchdog", "llm-proxy", "runner", "adapter", "trainer", "evaluator", "dashboard", "algorithm", "demo")
STOP_GRACE_S = 10.0  # after stop, how long the services may take before they are cancelled
DRAIN_S = 30.0  # at the end of a run, how long the runners and the adapter may take to finish their work

ServiceMain = Callable[[asyncio.Event], Awaitable[object]]


def read_dotenv(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines of a .env file (comments and blank lines skipped), as honcho reads them."""
    values = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        name, _, value = line.partition("=")
        values[name.strip()] = value.strip().strip("'\"")
    return values


def apply_dotenv(path: Path) -> None:
    """Fill the environment from ``path``; what the environment already sets wins (as with honcho)."""
    if path.is_file():
        for name, value in read_dotenv(path).items():
            os.environ.setdefault(name, value)


def as_task(service: Service[Any]) -> ServiceMain:
    """``service`` as a task: its settings read from the environment, as its command reads them (a bad
    one fails the task, which stops `fulmen dev` with its message), then its ``run``."""

    async def main(stop: asyncio.Event) -> object:
        try:
            return await service.run(load_settings(service.settings), stop)
        except Stopped:  # stopped while starting: as cleanly as a service stopped later
            return None

    return main


def load_services() -> dict[str, ServiceMain]:
    """The services of ORDER that are installed, as tasks, in that order."""
    from importlib.metadata import entry_points

    from fulmen.cli import watchdog

    found: dict[str, Service[Any]] = {watchdog.SERVICE.name: watchdog.SERVICE}
    for ep in entry_points(group=GROUP):
        if ep.name in ORDER:
            found[ep.name] = ep.load().service
    return {name: as_task(found[name]) for name in ORDER if name in found}


async def run_all(services: dict[str, ServiceMain], ends_run: str = "algorithm",
                  results: dict[str, object] | None = None) -> int:
    """Run every service until ``ends_run`` returns or one fails; 0 if the run ended normally.
    ``results`` gets what each service that ended on its own returned. A run that ended normally
    drains first: the runners finish what they hold, the adapter samples every finished rollout."""
    stop = asyncio.Event()
    stop_on_signals(stop.set)
    events = {name: asyncio.Event() for name in services}
    tasks = {asyncio.create_task(main(events[name]), name=name): name for name, main in services.items()}
    code, ended, pending = await _until_one_ends(tasks, stop, ends_run, results)
    by_name = {name: task for task, name in tasks.items() if task in pending}
    if code == 0 and ended and {"runner", "adapter"} <= by_name.keys():
        pending -= await _drain(by_name, events)
    for event in events.values():
        event.set()
    if pending:
        await _stop(pending, tasks)
    return code


async def _until_one_ends(tasks: dict[asyncio.Task[object], str], stop: asyncio.Event, ends_run: str,
                          results: dict[str, object] | None) -> tuple[int, bool, set[asyncio.Task[object]]]:
    """Wait until a service ends or fails (or ``stop`` is set by a signal), then set ``stop``: the exit
    code, whether ``ends_run`` ended normally, and the tasks still running."""
    code, ended = 0, False
    pending: set[asyncio.Task[Any]] = set(tasks)
    while pending and not stop.is_set():
        stopping = asyncio.create_task(stop.wait())
        done, pending = await asyncio.wait(pending | {stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        pending.discard(stopping)
        for task in done - {stopping}:
            name = tasks[task]
            failed = _ended(name, task, ends_run, results)
            code = max(code, failed)
            ended = ended or (name == ends_run and not failed)
            stop.set()
    return code, ended, pending


def _ended(name: str, task: asyncio.Task[object], ends_run: str, results: dict[str, object] | None) -> int:
    """Log how a service's task ended and keep its result: 0 if ``ends_run`` returned, else 1 (a service
    that ends on its own, unasked, is a failure: honcho says so too)."""
    error = task.exception() if not task.cancelled() else None
    if error is not None:
        log.error("%s failed: %s: %s; stopping every service", name, type(error).__name__, error, exc_info=error)
        return 1
    log.info("%s ended; stopping every service", name)
    if results is not None:
        results[name] = task.result()
    return 0 if name == ends_run else 1


async def _stop(pending: set[asyncio.Task[object]], tasks: dict[asyncio.Task[object], str]) -> None:
    """Give the stopped services STOP_GRACE_S to end, then cancel those still running."""
    done, late = await asyncio.wait(pending, timeout=STOP_GRACE_S)
    for task in late:
        log.warning("%s did not stop within %.0f s: cancelled", tasks[task], STOP_GRACE_S)
        task.cancel()
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            log.error("%s failed while stopping: %r", tasks[task], task.exception())
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*late, return_exceptions=True)


async def _drain(tasks: dict[str, asyncio.Task[object]], events: dict[str, asyncio.Event]) -> set[asyncio.Task[object]]:
    """The runners stop (finishing what they hold, within their grace), then the adapter gets until
    DRAIN_S to sample every finished rollout, so none of the run's rollouts goes unused. The stopped
    tasks."""
    from fulmen.errors import FulmenError

    events["runner"].set()
    done, _ = await asyncio.wait({tasks["runner"]}, timeout=DRAIN_S)
    settings = load_settings(CommonSettings).model_copy(update={"redis_wait_s": 2.0})
    try:
        async with opened_store(settings) as store:
            deadline = time.monotonic() + DRAIN_S
            while time.monotonic() < deadline and not await _adapter_caught_up(store):
                await asyncio.sleep(0.2)
    except FulmenError as e:
        log.warning("the adapter could not be waited for (%s): the last rollouts may go unsampled", e)
    return set(done)


async def _adapter_caught_up(store: RedisStore) -> bool:
    """Whether the adapter's group has read and acknowledged every finished rollout, in every shard."""
    from fulmen import keys as k

    for shard in store.keys.shards:
        last = await store.redis.xrevrange(shard.finished, count=1)
        if not last:
            continue
        groups = {_text(g["name"]): g for g in await store.redis.xinfo_groups(shard.finished)}
        group = groups.get(k.ADAPTER_GROUP)
        if group is None or int(group["pending"]) or _entry_id(group["last-delivered-id"]) < _entry_id(last[0][0]):
            return False
    return True


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _entry_id(value: object) -> tuple[int, int]:
    ms, _, seq = _text(value).partition("-")
    return int(ms), int(seq or 0)


def exit_leaving_threads(code: int) -> None:
    """Exit now, even with a thread still inside a blocking call (the evaluator's validation pass, a
    sync agent): honcho would SIGKILL that process; its work is in the store and is taken up again."""
    import sys
    import threading

    others = [t for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()]
    sys.stdout.flush()
    sys.stderr.flush()
    if others:
        log.info("leaving %d thread(s) behind", len(others))
        logging.shutdown()
        os._exit(code)
    raise SystemExit(code)
