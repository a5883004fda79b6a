"""`fulmen trainer`. Kept light at import: `fulmen --help` loads this module (torch is imported later)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import Coroutine
from typing import Any

import typer

from fulmen import keys as k
from fulmen.cli.service import leave, run_on_store, settings_command
from fulmen.settings import TrainerSettings
from fulmen.store import RedisStore

log = logging.getLogger("fulmen.trainer")


@settings_command(TrainerSettings)
def command(settings: TrainerSettings) -> None:
    """Train the policy on the samples stream and publish each new model version to the proxies.

    Steps whenever it holds enough complete task groups (all n rollouts of a task terminal). Every
    option is also an environment variable (FULMEN_<NAME>). Killed at any point, it resumes from its
    last checkpoint without losing or repeating a sample.

    Several ranks: `honcho start -c trainer=R` with --world-size R (ranks over Redis), or
    `torchrun --no-python --nproc-per-node N fulmen trainer --parallel ddp` (DDP on gloo or NCCL),
    or `--parallel fsdp` (the model sharded over the ranks); under torchrun rank r serves its metrics
    on the metrics port + its local rank."""
    if settings.model_dir is not None:
        from fulmen.versions.model_version import wait_for_model_dir

        wait_for_model_dir(settings.model_dir)  # the demo writes its model after the warm start
    from fulmen.telemetry.http import ops_port, start_ops
    from fulmen_trainer.distributed.exchange import Exchange
    from fulmen_trainer.distributed.gradients import RankCodec
    from fulmen_trainer.distributed.membership import Membership
    from fulmen_trainer.distributed.rank_group import RankGroup
    from fulmen_trainer.distributed.sync_policy import SyncPolicy
    from fulmen_trainer.distributed.torch_ranks import TorchRanks, under_torchrun
    from fulmen_trainer.trainer import Trainer

    if settings.parallel == "redis" and under_torchrun() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        typer.echo("error: started by torchrun with several processes but --parallel is redis: "
                   "add --parallel ddp (or start the ranks with honcho -c trainer=R)", err=True)
        raise typer.Exit(2)
    torch_ranks = None
    if settings.parallel in ("ddp", "fsdp"):
        try:
            torch_ranks = TorchRanks(settings)
        except ValueError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        port = settings.metrics_port if settings.metrics_port is not None else ops_port(settings)
        settings = torch_ranks.settings_for_rank(settings).model_copy(
            update={"metrics_port": port + torch_ranks.local_rank if port else port})

    async def work(store: RedisStore) -> None:
        with start_ops(settings, "trainer", groups=[("samples", k.TRAINERS_GROUP)]) as ops:
            started = await train(store, ops)
        if not started:
            # stopped while loading: the import or the load goes on in its thread, which asyncio.run
            # would wait for (seconds, past honcho's 5 s); nothing was trained, nothing is lost
            leave(0)

    async def train(store: RedisStore, ops: Any) -> bool:
        """Set up and train until SIGTERM; False if stopped before the setup was done."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        rank, ranks, membership, beating = 0, None, None, None
        if torch_ranks is not None:
            rank, ranks = torch_ranks.rank, torch_ranks
        elif settings.world_size > 1:
            membership = Membership(store, settings.world_size, settings.rank_timeout_s)
            rank = await membership.claim()
            beating = asyncio.create_task(membership.heartbeat())
            exchange = Exchange(store, membership)
            await exchange.start_reading()
            try:
                codec = RankCodec(settings.codec, SyncPolicy.from_settings(settings), density=settings.codec_density)
            except ValueError as e:
                typer.echo(f"error: {e}", err=True)
                raise typer.Exit(2) from None
            ranks = RankGroup(store, membership, exchange, codec,
                              wait_for_full_world=settings.on_rank_loss == "wait")
        try:
            # the ops server owns the metrics port and serves the trainer's registry: give it none
            trainer = Trainer(store, settings.model_copy(update={"metrics_port": None}), rank=rank, ranks=ranks)
        except ValueError as e:
            typer.echo(f"error: {e}", err=True)
            raise typer.Exit(2) from None
        try:
            if not await _unless_stopped(trainer.setup(), stop):
                log.info("trainer rank %d stopped while starting", rank)
                return False
            if trainer.metrics is not None:
                ops.add(trainer.metrics.registry)
            if membership is not None:
                await membership.mark_ready()
            if torch_ranks is not None:
                await torch_ranks.hello(trainer)
            if rank == 0:
                await trainer.run(stop)
            else:
                assert ranks is not None
                await ranks.follow(trainer, stop)
            if trainer.unlogged and (rank == 0 or torch_ranks is None):  # steps since the last checkpoint
                await trainer.checkpoint()
            if rank == 0 and torch_ranks is not None:
                await torch_ranks.finish()  # after that checkpoint: FSDP ranks write their shards of it
        finally:
            if torch_ranks is not None:
                torch_ranks.close()
            if beating is not None:
                beating.cancel()
            if membership is not None:
                await membership.release()
        log.info("trainer rank %d stopped at step %d (model version %s)", rank, trainer.step, trainer.version)
        return True

    run_on_store(settings, work)


async def _unless_stopped(setup: Coroutine[Any, Any, None], stop: asyncio.Event) -> bool:
    """Run ``setup`` (imports and the model's load: seconds) unless ``stop`` is set first, which
    cancels it; whether it finished."""
    task = asyncio.ensure_future(setup)
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if task.done():
        task.result()  # its error, if it failed
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return False
