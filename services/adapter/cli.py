"""`fulmen adapter`. Kept light at import: `fulmen --help` loads this module."""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Annotated, Any

import typer

from fulmen import keys as k
from fulmen.service_cli import run_on_store, settings_command
from fulmen.settings import AdapterSettings
from fulmen.store import RedisStore

log = logging.getLogger("fulmen.adapter")


# Completions one adapter handles per round trip (8 batches in flight): large batches amortise the
# round trips, and the cap keeps one batch's spans well inside memory.
DEFAULT_BATCH = 128
MAX_BATCH = 10_000


@settings_command(AdapterSettings)
def command(
    settings: AdapterSettings,
    batch: Annotated[
        int, typer.Option(min=1, max=MAX_BATCH, help="Completions handled per round trip (8 batches in flight).")
    ] = DEFAULT_BATCH,
) -> None:
    """Turn every finished rollout's spans into training samples on the samples stream.

    Each succeeded rollout yields one (prompt, response, reward) triplet per LLM call, with the token
    ids and log-probabilities the proxy recorded, plus one trajectory sample per multi-turn
    conversation; any other rollout yields a skip record with the reason. Once per rollout, however
    often a completion is delivered. Several adapters may run (one consumer group)."""
    from fulmen.ops_http import start_ops
    from fulmen.ops_metrics import CountersCollector
    from fulmen_adapter.adapter import Adapter, tune_gc_for_batches
    from fulmen_adapter.config import adapter_config

    try:
        config = adapter_config(settings)
    except ValueError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None

    async def work(store: RedisStore) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        adapter = Adapter(store, config, batch=batch)
        tune_gc_for_batches()
        with start_ops(settings, "adapter", groups=[("finished", k.ADAPTER_GROUP)]) as ops:
            ops.add(CountersCollector(lambda: _adapter_counters(adapter.counters)))
            await adapter.run(stop)
        log.info(
            "adapter stopped: %d rollouts, %d samples, skipped %s",
            adapter.counters.rollouts, adapter.counters.samples, adapter.counters.skipped or "none",
        )

    run_on_store(settings, work)


def _adapter_counters(counters: Any) -> list[Any]:
    """The adapter's own counters for /metrics (rollouts adapted, samples emitted, skips per reason)."""
    from fulmen.ops_metrics import CounterValue

    values = [
        CounterValue("fulmen_adapter_rollouts", "Rollouts adapted (once each).", counters.rollouts),
        CounterValue("fulmen_adapter_samples", "Samples emitted on the samples stream.", counters.samples),
    ]
    for reason, n in sorted(counters.skipped.items()):
        values.append(CounterValue("fulmen_adapter_skips", "Rollouts that yielded no sample.", n, {"reason": reason}))
    return values
