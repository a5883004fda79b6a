"""The adapter as a `Service`: `run(settings, stop)`, which `fulmen adapter` and `fulmen dev` both call.
Kept light at import (`fulmen --help` loads it); the adapter itself: `fulmen_adapter.adapter`."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fulmen import keys as k
from fulmen.cli.service import Service, opened_store
from fulmen.errors import InvalidInput
from fulmen.settings import AdapterSettings

log = logging.getLogger("fulmen.adapter")

# Completions one adapter handles per round trip (8 batches in flight): large batches amortise the
# round trips, and the cap keeps one batch's spans well inside memory.
DEFAULT_BATCH = 128
MAX_BATCH = 10_000


async def run(settings: AdapterSettings, stop: asyncio.Event, *, batch: int = DEFAULT_BATCH,
              tune_process: bool = False) -> None:
    """Adapt every finished rollout until ``stop`` is set (bad settings raise InvalidInput before
    anything connects). ``tune_process``: the process is the adapter's alone (its command, not `fulmen dev`)."""
    from fulmen.telemetry.http import start_ops
    from fulmen.telemetry.metrics import CountersCollector
    from fulmen_adapter.adapter import Adapter, held_reclaim_idle_s, tune_for_batches
    from fulmen_adapter.config import adapter_config, judge_config

    try:
        config, judge = adapter_config(settings), judge_config(settings)
    except ValueError as e:
        raise InvalidInput(str(e)) from None
    if judge is not None:
        log.info("judging each train group with %s at %s (mix %g, wait %g s, timeout %g s)", judge.model, judge.url,
                 judge.mix, judge.wait_s, judge.timeout_s)
    async with opened_store(settings, stop) as store:
        adapter = Adapter(store, config, batch=batch, reclaim_idle_s=held_reclaim_idle_s(judge), judge=judge)
        with start_ops(settings, "adapter", groups=[("finished", k.ADAPTER_GROUP)]) as ops:
            ops.add(CountersCollector(lambda: adapter_counters(adapter.counters)))
            if tune_process:  # last, so that everything start-up made is frozen out of the collector's way
                tune_for_batches()
            await adapter.run(stop)
    log.info(
        "adapter stopped: %d rollouts, %d samples, skipped %s",
        adapter.counters.rollouts, adapter.counters.samples, adapter.counters.skipped or "none",
    )


def adapter_counters(counters: Any) -> list[Any]:
    """The adapter's own counters for /metrics (rollouts adapted, samples emitted, skips per reason)."""
    from fulmen.telemetry.metrics import CounterValue

    values = [
        CounterValue("fulmen_adapter_rollouts", "Rollouts adapted (once each).", counters.rollouts),
        CounterValue("fulmen_adapter_samples", "Samples emitted on the samples stream.", counters.samples),
    ]
    for reason, n in sorted(counters.skipped.items()):
        values.append(CounterValue("fulmen_adapter_skips", "Rollouts that yielded no sample.", n, {"reason": reason}))
    for name, n in sorted(counters.more.items()):
        kind, _, what = name.partition("/")
        if kind == "judge":
            values.append(CounterValue("fulmen_adapter_judge", "The group judge: groups by outcome, rollouts rescored.",
                                       n, {"what": what}))
        elif kind == "calls":
            values.append(CounterValue("fulmen_adapter_calls_not_sampled",
                                       "LLM calls made for another purpose than the policy (a judge's).", n,
                                       {"reason": what}))
    return values


SERVICE = Service("adapter", AdapterSettings, run)
