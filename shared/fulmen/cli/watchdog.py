"""`fulmen watchdog` and the watchdog as a `Service` (`fulmen dev` runs it as a task). The sweep and
the retention passes themselves: `fulmen.watchdog`."""

from __future__ import annotations

import asyncio
import logging
from typing import Annotated

import typer

from fulmen.cli.service import Service, opened_store, run_service, service_command
from fulmen.cli.trim import retention_schedule
from fulmen.settings import WatchdogSettings
from fulmen.watchdog import INTERVAL_S, run_watchdog

log = logging.getLogger("fulmen")


async def run(settings: WatchdogSettings, stop: asyncio.Event, *, interval_s: float = INTERVAL_S) -> None:
    """Sweep every ``interval_s`` and trim by the retention settings until ``stop`` is set (a bad
    retention setting raises InvalidInput before anything connects)."""
    from fulmen.telemetry.http import start_ops

    retention = retention_schedule(settings)
    async with opened_store(settings, stop) as store:
        log.info("watchdog on experiment %s, every %.2fs", store.experiment, interval_s)
        if retention is not None:
            log.info("retention every %.0fs: %s", retention.interval_s, retention.policy)
        with start_ops(settings, "watchdog"):
            await run_watchdog(store, interval_s, stop, retention)
    log.info("watchdog stopped")


SERVICE = Service("watchdog", WatchdogSettings, run)


@service_command(SERVICE)
def command(
    settings: WatchdogSettings,
    interval_s: Annotated[float, typer.Option(min=0.05, help="Seconds between sweeps.")] = INTERVAL_S,
) -> None:
    """End attempts past their timeout or heartbeat, and requeue or fail their rollouts; with a
    retention limit set, trim the store by it every retention interval (off by default).

    Safe to run several at once (each attempt changes status exactly once). Stops on SIGTERM."""
    run_service(SERVICE, settings, interval_s=interval_s)
