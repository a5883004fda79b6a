"""`fulmen trainer`. Kept light at import: `fulmen --help` loads this module (torch is imported later)."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import Annotated, Any

import typer

from fulmen import keys as k
from fulmen.cli import run_on_store, settings_from_flags
from fulmen.store import RedisStore

log = logging.getLogger("fulmen.trainer")


def command(
    model_dir: Annotated[Path | None, typer.Option(help="Hugging Face model folder to train (FULMEN_MODEL_DIR).")] = None,
    algorithm: Annotated[str | None, typer.Option(help="grpo, ppo, reinforce or sft [default grpo].")] = None,
    learning_rate: Annotated[float | None, typer.Option(help="AdamW learning rate [default 1e-4].")] = None,
    groups_per_step: Annotated[int | None, typer.Option(help="Complete task groups per step [default 8].")] = None,
    group_size: Annotated[int | None, typer.Option(help="Rollouts per task when samples do not say.")] = None,
    max_staleness: Annotated[int | None, typer.Option(help="Model versions a sample may lag.")] = None,
    kl_coef: Annotated[float | None, typer.Option(help="KL penalty to the initial model [default 0].")] = None,
    publish_every: Annotated[int | None, typer.Option(help="Publish a model version every K steps [default 1].")] = None,
    checkpoint_dir: Annotated[Path | None, typer.Option(help="Checkpoint folder [default .fulmen/checkpoints].")] = None,
    max_steps: Annotated[int | None, typer.Option(help="Stop after this many steps.")] = None,
    experiment: Annotated[str | None, typer.Option("--experiment", "-e", help="Experiment (FULMEN_EXPERIMENT).")] = None,
) -> None:
    """Train the policy on the samples stream and publish each new model version to the proxies.

    Steps whenever it holds enough complete task groups (all n rollouts of a task terminal). Every
    setting has an environment variable (FULMEN_<NAME>): see `fulmen.settings` for the full list
    (sample shape, reward source, clip range, entropy bonus, micro-batch, checkpoint cadence, ...).
    Killed at any point, it resumes from its last checkpoint without losing or repeating a sample."""
    settings = settings_from_flags(
        model_dir=model_dir, algorithm=algorithm, learning_rate=learning_rate, groups_per_step=groups_per_step,
        group_size=group_size, max_staleness=max_staleness, kl_coef=kl_coef, publish_every=publish_every,
        checkpoint_dir=checkpoint_dir, max_steps=max_steps, experiment=experiment,
    )
    if settings.model_dir is not None:
        from fulmen.model_versions import wait_for_model_dir

        wait_for_model_dir(settings.model_dir)  # the demo writes its model after the warm start
    from fulmen.ops_http import start_ops
    from fulmen_trainer.gradients import RankCodec
    from fulmen_trainer.membership import Membership
    from fulmen_trainer.rank_group import RankGroup
    from fulmen_trainer.ranks import Exchange
    from fulmen_trainer.trainer import Trainer

    if settings.on_rank_loss not in ("continue", "wait"):
        typer.echo(f"error: on_rank_loss {settings.on_rank_loss!r} unknown; use continue or wait", err=True)
        raise typer.Exit(2)

    async def work(store: RedisStore) -> None:
        with start_ops(settings, "trainer", groups=[("samples", k.TRAINERS_GROUP)]) as ops:
            await train(store, ops)

    async def train(store: RedisStore, ops: Any) -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        rank, ranks, membership, beating = 0, None, None, None
        if settings.world_size > 1:
            membership = Membership(store, settings.world_size, settings.rank_timeout_s)
            rank = await membership.claim()
            beating = asyncio.create_task(membership.heartbeat())
            exchange = Exchange(store, membership)
            await exchange.start_reading()
            try:
                codec = RankCodec(settings.codec, density=settings.codec_density)
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
            await trainer.setup()
            if trainer.metrics is not None:
                ops.add(trainer.metrics.registry)
            if membership is not None:
                await membership.mark_ready()
            if rank == 0:
                await trainer.run(stop)
            else:
                assert ranks is not None
                await ranks.follow(trainer, stop)
            if trainer.unlogged:  # steps since the last checkpoint: keep them
                await trainer.checkpoint()
        finally:
            if beating is not None:
                beating.cancel()
            if membership is not None:
                await membership.release()
        log.info("trainer rank %d stopped at step %d (model version %s)", rank, trainer.step, trainer.version)

    run_on_store(settings, work)
