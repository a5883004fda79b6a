"""The algorithm, the demo's driver and the evaluator as `Service`s: each ``run(settings, stop)``, which
its command (`fulmen algorithm`, `demo`, `evaluator`) and `fulmen dev` both call. Kept light at import
(`fulmen --help` loads it); a run's inputs: `start`, its loop: `run`, the eval queue: `jobs`."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import TYPE_CHECKING, Any

from fulmen import keys as k
from fulmen.cli.service import Service, opened_store, unless_stopped, when_stopped
from fulmen.settings import AlgorithmSettings, DemoSettings, EvaluatorSettings

if TYPE_CHECKING:
    from fulmen.telemetry.trackers import Tracker
    from fulmen_algorithm.start import RunInputs

log = logging.getLogger("fulmen.algorithm")
EVAL_IDLE_S = 1  # the rq worker returns after this long without a job (it blocks on the queue till then)


async def run_algorithm(settings: AlgorithmSettings, stop: asyncio.Event) -> dict[str, Any]:
    """Drive the run on the user's tasks until it ends or ``stop`` is set; its summary."""
    from fulmen_algorithm.start import algorithm_inputs

    trackers = _trackers(settings)
    return await _drive(algorithm_inputs(settings), stop, trackers)


async def run_demo(settings: DemoSettings, stop: asyncio.Event) -> dict[str, Any] | None:
    """Prepare the demo (the SFT warm start, on the first start: minutes, in a thread), then drive
    its run; its summary, or None if stopped while preparing."""
    from fulmen_algorithm.start import demo_inputs

    trackers = _trackers(settings)  # before the warm start: a tracker's missing package fails now, not minutes on
    prepared = await unless_stopped(asyncio.to_thread(demo_inputs, settings), stop)
    return None if prepared is None else await _drive(prepared.result(), stop, trackers)


def _trackers(settings: AlgorithmSettings) -> list[Tracker]:
    """The --report-to trackers, writing their local files in the run's folder; their packages checked."""
    from fulmen.telemetry.trackers import trackers_for
    from fulmen_algorithm.run import run_dir

    return trackers_for(settings.report_to, run_dir(settings))


async def _drive(inputs: RunInputs, stop: asyncio.Event, trackers: list[Tracker]) -> dict[str, Any]:
    from fulmen.telemetry.http import start_ops
    from fulmen.telemetry.trackers import record_run_config, reporting
    from fulmen_algorithm.run import Run

    run = Run(inputs.settings, inputs.tasks, inputs.val_tasks, setup=inputs.setup)
    stopping = when_stopped(stop, run.stop)
    try:
        with start_ops(inputs.settings, "algorithm", groups=[("finished", k.ALGORITHM_GROUP)]):
            async with opened_store(inputs.settings) as store:
                # the trackers follow the run from the store, in this process: never on the trainer's step
                # the effective settings beside the run (the dashboard's run page, the trackers' config)
                config = (await record_run_config(store, inputs.settings))["settings"]
                tracked = reporting(store, trackers, name=inputs.settings.experiment, config=config)
                async with tracked:
                    summary = await run.run(store)
    finally:
        stopping.cancel()
    print(json.dumps(summary), flush=True)
    if summary.get("stopped"):
        log.info("run stopped at step %s: started again it goes on from the store; no report written",
                 summary.get("steps"))
    else:
        log.info("run finished: curve %s, metrics %s, final model %s (version %s)", summary.get("curve"),
                 summary.get("metrics"), summary.get("final_model"), summary.get("final_model_version"))
    return summary


async def run_evaluator(settings: EvaluatorSettings, stop: asyncio.Event) -> None:
    """Run validation passes from the eval queue until ``stop`` is set, after putting back the passes a
    killed evaluator left. The rq worker works the queue a second at a time, in a thread. Stopped during
    a pass, it leaves at once (rq would wait for the pass, minutes, and honcho SIGKILLs after 5 s): the
    job stays started, and the next evaluator runs it again (`requeue_abandoned`), as after a kill. Redis
    going away is ridden out: it waits for Redis, puts back what the outage left started, and works on
    with a new worker."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from fulmen.store.redis.connection import connect
    from fulmen.telemetry.http import start_ops
    from fulmen_algorithm.jobs import validation_queue

    await (await connect(settings)).aclose()  # services start in any order: wait for Redis, or rq exits at once
    queue = validation_queue(settings)
    log.info("evaluator on queue %s", queue.name)
    worker = _evaluator_worker(queue)
    logging.getLogger("rq.worker").setLevel(logging.WARNING)  # a burst a second: its lines would flood the log
    with start_ops(settings, "evaluator"):
        while not stop.is_set():  # a job is taken the moment it is queued; the loop looks at ``stop`` each second
            work = asyncio.to_thread(worker.work, max_idle_time=EVAL_IDLE_S, with_scheduler=False)
            try:
                done = await unless_stopped(work, stop)
            except (RedisConnectionError, RedisTimeoutError) as e:  # BusyLoadingError too (a restart's load)
                log.warning("evaluator: Redis went away (%s: %s); waiting for it", type(e).__name__, e)
                await (await connect(settings)).aclose()
                worker = _evaluator_worker(queue)  # rq keeps a worker's name registered: a new one starts clean
                continue
            if done is None:
                if worker.running is not None:
                    log.info("stopping during validation job %s: the next evaluator runs it again", worker.running)
                return


def _evaluator_worker(queue: Any) -> Any:
    """The eval queue's rq worker, after putting back the passes a dead evaluator (or a Redis outage)
    left started."""
    from fulmen_algorithm.jobs import evaluator_worker
    from fulmen_algorithm.validation import requeue_abandoned

    requeue_abandoned(queue)
    return evaluator_worker(queue)


ALGORITHM = Service("algorithm", AlgorithmSettings, run_algorithm)
DEMO = Service("demo", DemoSettings, run_demo)
EVALUATOR = Service("evaluator", EvaluatorSettings, run_evaluator)
