"""`fulmen dev`: every service of the Procfile as an asyncio task in this one process, on the embedded
Redis, so a debugger can stop in the agent, the adapter or the loss and step through one rollout.

Services register ``async def main(stop)`` under the ``fulmen.cli.dev`` entry points. Why: docs/design/dev.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fulmen.settings import CommonSettings
from fulmen.store import RedisStore
from fulmen.store.redis.connection import connect, connect_weights
from fulmen.versions.model_version import wait_for_model_dir

log = logging.getLogger("fulmen.dev")

GROUP = "fulmen.dev"
# The order tasks start in; the algorithm's end ends the whole run, as under honcho.
ORDER = ("watchdog", "llm-proxy", "runner", "adapter", "trainer", "evaluator", "dashboard", "algorithm")
STOP_GRACE_S = 10.0  # after stop, how long the services may take before they are cancelled
DRAIN_S = 30.0  # at the end of a run, how long the runners and the adapter may take to finish their work
MODEL_POLL_S = 0.5
MODEL_HINT_EVERY_S = 30.0  # the demo's warm start takes minutes: say what is awaited, not often

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


async def open_store(settings: CommonSettings) -> RedisStore:
    """The experiment's store on a client of its own (the services each have theirs)."""
    client = await connect(settings)
    return RedisStore(client, settings.experiment, max_record_bytes=settings.max_record_bytes,
                      weights_redis=await connect_weights(settings))


async def wait_for_model(folder: Path | None, stop: asyncio.Event) -> bool:
    """Wait for the demo's model folder without blocking the loop; False if stopped first."""
    if folder is None:
        return True
    from fulmen.versions.model_version import model_dir_hint

    said = 0.0
    while not (Path(folder) / "config.json").exists():
        if stop.is_set():
            return False
        if time.monotonic() - said > MODEL_HINT_EVERY_S:
            log.warning("%s", model_dir_hint(Path(folder)))
            said = time.monotonic()
        await asyncio.sleep(MODEL_POLL_S)
    wait_for_model_dir(folder)  # there now: returns at once (kept for its single code path)
    return True


def when_stopped(stop: asyncio.Event, action: Callable[[], object]) -> asyncio.Task[None]:
    """Call ``action`` once ``stop`` is set (for services stopped by a method, not an event)."""

    async def wait() -> None:
        await stop.wait()
        action()

    return asyncio.create_task(wait())


async def serve_http(server: Any, sock: Any, stop: asyncio.Event) -> None:
    """Run a uvicorn server on ``sock`` until ``stop`` is set, leaving the signals to `fulmen dev`
    (uvicorn's ``serve`` would take SIGINT and SIGTERM over and raise them again when it ends)."""
    server.capture_signals = contextlib.nullcontext
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    server.should_exit = True
    await serving


def load_services() -> dict[str, ServiceMain]:
    from importlib.metadata import entry_points

    found = {ep.name: ep.load() for ep in entry_points(group=GROUP)}
    return {name: found[name] for name in ORDER if name in found} | {
        name: main for name, main in found.items() if name not in ORDER
    }


async def run_all(services: dict[str, ServiceMain], ends_run: str = "algorithm",
                  results: dict[str, object] | None = None) -> int:
    """Run every service until ``ends_run`` returns or one fails; 0 if the run ended normally.
    ``results`` gets what each service that ended on its own returned. A run that ended normally
    drains first: the runners finish what they hold, the adapter samples every finished rollout."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    events = {name: asyncio.Event() for name in services}
    tasks = {asyncio.create_task(main(events[name]), name=name): name for name, main in services.items()}
    code, ended = 0, False
    pending = set(tasks)
    while pending and not stop.is_set():
        stopping = asyncio.create_task(stop.wait())
        done, pending = await asyncio.wait(pending | {stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        pending.discard(stopping)
        for task in done - {stopping}:
            name = tasks[task]
            error = task.exception() if not task.cancelled() else None
            if error is not None:
                log.error("%s failed: %s: %s; stopping every service", name, type(error).__name__, error,
                          exc_info=error)
                code = 1
            else:
                log.info("%s ended; stopping every service", name)
                if results is not None:
                    results[name] = task.result()
                if name != ends_run:
                    code = 1  # a service that ends on its own, unasked, is a failure (honcho says so too)
                ended = ended or name == ends_run
            stop.set()
    by_name = {name: task for task, name in tasks.items() if task in pending}
    if code == 0 and ended and {"runner", "adapter"} <= by_name.keys():
        pending -= await _drain(by_name, events)
    for event in events.values():
        event.set()
    if pending:
        done, late = await asyncio.wait(pending, timeout=STOP_GRACE_S)
        for task in late:
            log.warning("%s did not stop within %.0f s: cancelled", tasks[task], STOP_GRACE_S)
            task.cancel()
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                log.error("%s failed while stopping: %r", tasks[task], task.exception())
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*late, return_exceptions=True)
    return code


async def _drain(tasks: dict[str, asyncio.Task[object]], events: dict[str, asyncio.Event]) -> set[asyncio.Task[object]]:
    """The runners stop (finishing what they hold, within their grace), then the adapter gets until
    DRAIN_S to sample every finished rollout, so none of the run's rollouts goes unused. The stopped
    tasks."""
    from fulmen.errors import FulmenError
    from fulmen.settings import load_settings

    events["runner"].set()
    done, _ = await asyncio.wait({tasks["runner"]}, timeout=DRAIN_S)
    try:
        store = await open_store(load_settings(CommonSettings).model_copy(update={"redis_wait_s": 2.0}))
    except FulmenError as e:
        log.warning("the adapter could not be waited for (%s): the last rollouts may go unsampled", e)
        return set(done)
    deadline = time.monotonic() + DRAIN_S
    try:
        while time.monotonic() < deadline and not await _adapter_caught_up(store):
            await asyncio.sleep(0.2)
    finally:
        await store.redis.aclose()
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


async def watchdog(stop: asyncio.Event) -> None:
    """The watchdog's task (it lives in `fulmen`, as its command does), with the same retention
    settings as `fulmen watchdog` (a bad one stops `fulmen dev` with its message)."""
    from fulmen.cli import trim as trim_cli
    from fulmen.settings import WatchdogSettings, load_settings
    from fulmen.telemetry.http import start_ops
    from fulmen.watchdog import INTERVAL_S, run_watchdog

    settings = load_settings(WatchdogSettings)
    retention = trim_cli.retention_schedule(settings)
    store = await open_store(settings)
    try:
        with start_ops(settings, "watchdog"):
            await run_watchdog(store, INTERVAL_S, stop, retention)
    finally:
        await store.redis.aclose()


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
