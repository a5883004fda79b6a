"""The algorithm (or the demo's driver) and the evaluator as tasks of `fulmen dev` (see `fulmen.cli.dev`).

The evaluator's rq worker is synchronous: it works the eval queue in a thread, in bursts, with rq's
thread-safe job timeout (its default is SIGALRM, which only the main thread may use)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fulmen import keys as k
from fulmen.cli.dev import open_store, when_stopped
from fulmen.settings import AlgorithmSettings, DemoSettings, EvaluatorSettings, load_settings
from fulmen.store import RedisStore
from fulmen.telemetry.http import start_ops

log = logging.getLogger("fulmen.algorithm")
EVAL_POLL_S = 1.0  # between two bursts of the evaluator when the queue was empty


async def _drive(settings: AlgorithmSettings, tasks: list[Any], val_tasks: list[Any], stop: asyncio.Event,
                 setup: Callable[[RedisStore], Awaitable[None]] | None = None) -> dict[str, Any]:
    from fulmen_algorithm.run import Run

    run = Run(settings, tasks, val_tasks, setup=setup)
    stopping = when_stopped(stop, run.stop)
    store = await open_store(settings)
    try:
        with start_ops(settings, "algorithm", groups=[("finished", k.ALGORITHM_GROUP)]):
            summary = await run.run(store)
    finally:
        stopping.cancel()
        await store.redis.aclose()
    print(json.dumps(summary), flush=True)
    if not summary.get("stopped"):
        log.info("run finished: curve %s, metrics %s, final model %s (version %s)", summary.get("curve"),
                 summary.get("metrics"), summary.get("final_model"), summary.get("final_model_version"))
    return summary


async def algorithm(stop: asyncio.Event) -> dict[str, Any]:
    from fulmen_algorithm.start import algorithm_inputs

    inputs = algorithm_inputs(load_settings(AlgorithmSettings))
    return await _drive(inputs.settings, inputs.tasks, inputs.val_tasks, stop, inputs.setup)


async def demo(stop: asyncio.Event) -> dict[str, Any]:
    from fulmen_algorithm.start import demo_inputs

    inputs = await asyncio.to_thread(demo_inputs, load_settings(DemoSettings))  # the SFT warm start: minutes
    return await _drive(inputs.settings, inputs.tasks, inputs.val_tasks, stop, inputs.setup)


async def evaluator(stop: asyncio.Event) -> None:
    from rq.timeouts import TimerDeathPenalty

    from fulmen_algorithm.jobs import evaluator_worker, validation_queue
    from fulmen_algorithm.validation import requeue_abandoned

    settings = load_settings(EvaluatorSettings)
    store = await open_store(settings)  # waits for Redis, as the command does
    await store.redis.aclose()
    queue = validation_queue(settings)
    requeue_abandoned(queue)
    worker = evaluator_worker(queue)
    worker.death_penalty_class = TimerDeathPenalty
    worker._install_signal_handlers = lambda: None  # type: ignore[method-assign]  # `fulmen dev` owns the signals
    logging.getLogger("rq.worker").setLevel(logging.WARNING)  # a burst a second: its lines would flood the log
    with start_ops(settings, "evaluator"):
        while not stop.is_set():
            await asyncio.to_thread(worker.work, burst=True, with_scheduler=False)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), EVAL_POLL_S)
