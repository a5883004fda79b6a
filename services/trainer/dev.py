"""The trainer as a task of `fulmen dev` (see `fulmen.cli.dev`): one rank, its steps in a thread as always."""

from __future__ import annotations

import asyncio

from fulmen import keys as k
from fulmen.cli.dev import open_store, wait_for_model
from fulmen.settings import TrainerSettings, load_settings
from fulmen.telemetry.http import start_ops


async def main(stop: asyncio.Event) -> None:
    settings = load_settings(TrainerSettings)
    if settings.world_size != 1 or settings.parallel != "redis":
        raise ValueError("fulmen dev runs one trainer rank: unset FULMEN_WORLD_SIZE and FULMEN_PARALLEL")
    if not await wait_for_model(settings.model_dir, stop):
        return
    from fulmen_trainer.trainer import Trainer

    store = await open_store(settings)
    try:
        with start_ops(settings, "trainer", groups=[("samples", k.TRAINERS_GROUP)]) as ops:
            trainer = Trainer(store, settings.model_copy(update={"metrics_port": None}))
            await trainer.setup()
            if trainer.metrics is not None:
                ops.add(trainer.metrics.registry)
            await trainer.run(stop)
            if trainer.unlogged:
                await trainer.checkpoint()
    finally:
        await store.redis.aclose()
