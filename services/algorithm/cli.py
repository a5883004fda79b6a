"""`fulmen algorithm`. Kept light at import: `fulmen --help` loads this module."""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from pathlib import Path
from typing import Annotated

import typer

from fulmen.cli import run_on_store, settings_from_flags
from fulmen.store import RedisStore

log = logging.getLogger("fulmen.algorithm")


def command(
    train_data: Annotated[Path | None, typer.Option(help="Training tasks (.jsonl or a datasets folder).")] = None,
    n_samples: Annotated[int | None, typer.Option(help="Rollouts per task, the GRPO group [default 8].")] = None,
    max_inflight: Annotated[int | None, typer.Option(help="Most train rollouts unfinished [default 256].")] = None,
    staleness: Annotated[int | None, typer.Option(help="Versions a rollout may lag; 0 = synchronous.")] = None,
    epochs: Annotated[int | None, typer.Option(help="Passes over the tasks.")] = None,
    total_steps: Annotated[int | None, typer.Option(help="End when the trainer reaches this version.")] = None,
    experiment: Annotated[str | None, typer.Option("--experiment", "-e", help="Experiment (FULMEN_EXPERIMENT).")] = None,
) -> None:
    """Drive a training run: enqueue GRPO groups of train rollouts, paced by the trainer, until done.

    The run's position lives in the store: killed and started again, it continues where it was and
    never enqueues a task twice. Ends (and, under honcho, ends the run) after --total-steps trainer
    versions or --epochs passes, printing a summary."""
    settings = settings_from_flags(
        train_data=train_data, n_samples=n_samples, max_inflight=max_inflight, staleness=staleness,
        epochs=epochs, total_steps=total_steps, experiment=experiment,
    )
    from fulmen.errors import FulmenError
    from fulmen_algorithm.dataset import load_tasks
    from fulmen_algorithm.scheduler import Scheduler

    if settings.train_data is None:
        typer.echo("error: no training data: pass --train-data tasks.jsonl (or FULMEN_TRAIN_DATA)", err=True)
        raise typer.Exit(2)
    if settings.total_steps is None and settings.epochs is None:
        typer.echo("error: the run needs an end: --total-steps or --epochs", err=True)
        raise typer.Exit(2)
    try:
        tasks = load_tasks(settings.train_data)
    except FulmenError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None

    async def work(store: RedisStore) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        scheduler = Scheduler(
            store, tasks, n_samples=settings.n_samples, groups_per_step=settings.groups_per_step,
            max_inflight=settings.max_inflight, staleness=settings.staleness, epochs=settings.epochs,
            seed=settings.seed,
        )
        await scheduler.load()
        started, last_line = time.monotonic(), 0.0
        done_at_start = await store.redis.scard(store.keys.algorithm_done)
        while not stop.is_set():
            await scheduler.fill()
            version = await scheduler.version()
            inflight = await scheduler.inflight()
            if settings.total_steps is not None and version >= settings.total_steps:
                break
            if scheduler.exhausted and inflight == 0:
                break
            if time.monotonic() - last_line > 2.0:
                done = await store.redis.scard(store.keys.algorithm_done) - done_at_start
                rate = done / max(time.monotonic() - started, 1e-9)
                stats = await store.statistics()
                log.info("step %d | epoch %d | %d in flight | queue %d | %.1f rollouts/s",
                         version, scheduler.state.epoch, inflight, stats["queue_depth"], rate)
                last_line = time.monotonic()
            await scheduler.count_completions(block_s=0.5)
        summary = {"steps": await scheduler.version(), **scheduler.snapshot(),
                   "wall_s": round(time.monotonic() - started, 1)}
        print(json.dumps(summary), flush=True)

    run_on_store(settings, work)
