"""The trainer as a `Service`: `run(settings, stop)`, which `fulmen trainer` and `fulmen dev` both call:
one rank, alone or with the others over Redis (`RankGroup`) or torch.distributed (`TorchRanks`).
Kept light at import (`fulmen --help` loads it; torch comes later); the loop: `fulmen_trainer.trainer`."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
from collections.abc import AsyncIterator
from typing import Any

from fulmen import keys as k
from fulmen.cli.service import Service, before_stop, opened_store, unless_stopped, wait_for_model
from fulmen.errors import InvalidInput
from fulmen.settings import TrainerSettings
from fulmen.store import RedisStore

log = logging.getLogger("fulmen.trainer")


async def run(settings: TrainerSettings, stop: asyncio.Event, *, rank_processes: bool = False) -> None:
    """Set up and train until ``stop`` is set. ``rank_processes``: other processes may be this run's
    other ranks (`fulmen trainer`); without it (`fulmen dev`) this is the only rank. Settings that
    cannot run raise InvalidInput."""
    from fulmen.telemetry.http import start_ops

    if not rank_processes and (settings.world_size != 1 or settings.parallel != "redis"):
        raise InvalidInput("fulmen dev runs one trainer rank: unset FULMEN_WORLD_SIZE and FULMEN_PARALLEL")
    if not await wait_for_model(settings.model_dir, stop):
        return
    # torch: seconds (tens on a busy machine), before the ops server says the trainer is up; in a
    # thread, so that SIGTERM meanwhile still stops the trainer, which holds nothing yet
    await before_stop(asyncio.to_thread(importlib.import_module, "fulmen_trainer.trainer"), stop, "importing torch")
    torch_ranks = _torch_ranks(settings)
    if torch_ranks is not None:
        settings = _rank_settings(settings, torch_ranks)
    async with opened_store(settings, stop) as store:
        with start_ops(settings, "trainer", groups=[("samples", k.TRAINERS_GROUP)]) as ops:
            await _train(store, settings, torch_ranks, ops, stop)


def _torch_ranks(settings: TrainerSettings) -> Any:
    """This process's place among torchrun's (--parallel ddp or fsdp), or None (--parallel redis)."""
    from fulmen_trainer.distributed.torch_ranks import TorchRanks, under_torchrun

    if settings.parallel == "redis":
        if under_torchrun() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise InvalidInput("started by torchrun with several processes but --parallel is redis: "
                               "add --parallel ddp (or start the ranks with honcho -c trainer=R)")
        return None
    try:
        return TorchRanks(settings)
    except ValueError as e:
        raise InvalidInput(str(e)) from None


def _rank_settings(settings: TrainerSettings, torch_ranks: Any) -> TrainerSettings:
    """The settings of this torchrun rank: under torchrun rank r serves its metrics on the metrics
    port + its local rank."""
    from fulmen.telemetry.http import ops_port

    port = settings.metrics_port if settings.metrics_port is not None else ops_port(settings)
    return torch_ranks.settings_for_rank(settings).model_copy(
        update={"metrics_port": port + torch_ranks.local_rank if port else port})


async def _train(store: RedisStore, settings: TrainerSettings, torch_ranks: Any, ops: Any,
                 stop: asyncio.Event) -> None:
    """Set up this rank and train until ``stop`` is set; stopped while loading, it leaves at once."""
    from fulmen_trainer.trainer import Trainer

    async with _ranks(store, settings, torch_ranks) as (rank, ranks, membership):
        try:
            # the ops server owns the metrics port and serves the trainer's registry: give it none
            trainer = Trainer(store, settings.model_copy(update={"metrics_port": None}), rank=rank, ranks=ranks)
        except ValueError as e:
            raise InvalidInput(str(e)) from None
        if await unless_stopped(trainer.setup(), stop) is None:
            log.info("trainer rank %d stopped while starting", rank)
            return
        if trainer.metrics is not None:
            ops.add(trainer.metrics.registry)
        if membership is not None:
            await membership.mark_ready()
        if torch_ranks is not None:
            await torch_ranks.hello(trainer)
        async with _weight_sender(store, settings, trainer, rank, membership, stop):
            if membership is not None:  # over Redis: whoever holds the lease leads, the others follow
                await ranks.serve(trainer, stop)
            elif rank == 0:
                await trainer.run(stop)
            else:
                await ranks.follow(trainer, stop)
        if trainer.unlogged and (rank == 0 or torch_ranks is None):  # steps since the last checkpoint
            await trainer.checkpoint()
        if rank == 0 and torch_ranks is not None:
            await torch_ranks.finish()  # after that checkpoint: FSDP ranks write their shards of it
    log.info("trainer rank %d stopped at step %d (model version %s)", rank, trainer.step, trainer.version)


@contextlib.asynccontextmanager
async def _weight_sender(store: RedisStore, settings: TrainerSettings, trainer: Any, rank: int, membership: Any,
                         stop: asyncio.Event) -> AsyncIterator[None]:
    """With ``weight_group``, rank 0 sends vLLM servers the full versions they ask for while it trains."""
    if not settings.weight_group or rank != 0:
        yield
        return
    if membership is not None:
        raise InvalidInput("weight_group needs one trainer rank or torchrun's ranks (--parallel ddp or fsdp): with "
                           "ranks over Redis the leader changes; unset FULMEN_WEIGHT_GROUP to load from folders")
    from fulmen_trainer.weight_sender import WeightSender

    sender = WeightSender(store, settings)
    await sender.start()
    trainer.sender = sender
    answering = asyncio.create_task(sender.run(stop))
    answering.add_done_callback(_said_if_failed)
    try:
        yield
    finally:
        answering.cancel()
        await asyncio.gather(answering, return_exceptions=True)
        await sender.close()


def _said_if_failed(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the weight sender stopped (%s: %s): vLLM servers load versions from folders until the trainer "
                  "restarts", type(task.exception()).__name__, task.exception())


@contextlib.asynccontextmanager
async def _ranks(store: RedisStore, settings: TrainerSettings, torch_ranks: Any) -> AsyncIterator[tuple[int, Any, Any]]:
    """This process's rank, its group of ranks (None alone) and its Redis membership (None unless the
    ranks meet over Redis), all released on the way out."""
    if torch_ranks is not None:
        try:
            yield torch_ranks.rank, torch_ranks, None
        finally:
            torch_ranks.close()
        return
    if settings.world_size == 1:
        yield 0, None, None
        return
    from fulmen_trainer.distributed.exchange import Exchange
    from fulmen_trainer.distributed.gradients import RankCodec
    from fulmen_trainer.distributed.membership import Membership
    from fulmen_trainer.distributed.rank_group import RankGroup
    from fulmen_trainer.distributed.sync_policy import SyncPolicy

    try:
        codec = RankCodec(settings.codec, SyncPolicy.from_settings(settings), density=settings.codec_density)
    except ValueError as e:
        raise InvalidInput(str(e)) from None
    membership = Membership(store, settings.world_size, settings.rank_timeout_s)
    rank = await membership.claim()
    beating = asyncio.create_task(membership.heartbeat())
    try:
        exchange = Exchange(store, membership)
        await exchange.start_reading()
        yield rank, RankGroup(store, membership, exchange, codec, wait_for_full_world=settings.on_rank_loss == "wait"), membership
    finally:
        beating.cancel()
        await membership.release()


SERVICE = Service("trainer", TrainerSettings, run)
