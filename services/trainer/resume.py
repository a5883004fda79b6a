"""A trainer coming back: its newest checkpoint's weights, optimizer, step and version, the version it
took but had not published yet, the metrics it had not logged, and the sample entries it had read.
Called by `Trainer.setup` with the trainer itself (`fulmen_trainer.trainer`, whose module docstring
says why each matters)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from fulmen import keys as k
from fulmen.telemetry.steps import latest_step
from fulmen.versions.model_version import ModelVersion, is_published
from fulmen_trainer import checkpoint as ckpt
from fulmen_trainer.distributed.torch_ranks import TorchRanks
from fulmen_trainer.lost_weights import republish_if_lost

log = logging.getLogger(__name__)

RECOVER_READ_COUNT = 1000  # pending entries per read when recovering after a restart


async def resume_from(trainer: Any, path: Path, sharded: bool) -> set[str]:
    """Take up the checkpoint at ``path`` (model weights are loaded already); the sample entries it
    consumed, which `recover_pending` acknowledges."""
    if sharded:
        assert isinstance(trainer.ranks, TorchRanks)  # `Trainer.setup` checked: sharded ranks
        checkpoint, codec_state = await asyncio.to_thread(trainer.ranks.load_checkpoint, path, trainer), {}
    else:
        checkpoint, codec_state = ckpt.load(path, trainer.optimizer)
    if trainer.ranks is not None and codec_state:
        trainer.ranks.codec.load_state_dict(codec_state)  # error feedback carries over the restart
    trainer.step, trainer.version = checkpoint.step, ModelVersion.parse(checkpoint.model_version)
    trainer.checkpointed_step = trainer.step
    already_done = set(checkpoint.consumed_entry_ids)
    log.info("resumed from %s: step %d, model version %s", path, trainer.step, trainer.version)
    if trainer.rank == 0 and trainer.version.number > 0 and not await is_published(trainer.store, trainer.version.name):
        # killed between the checkpoint and the publish: these weights are that version
        log.info("model version %s was checkpointed but not published: publishing it now", trainer.version)
        await trainer.publish(resumed=True)
    else:
        await republish_if_lost(trainer, now=True)  # Redis restarted since it was written
    if trainer.rank == 0:
        # a trainer that died after its checkpoint but before the metrics write (SIGKILL, or
        # Redis gone at the acknowledgement) logs those steps now, or the file misses them
        trainer.mirror.append(checkpoint.extra.get("metrics", []))
        # likewise the steps stream, which the algorithm paces on: a step it never sees would
        # leave it waiting for the trainer, and the trainer for its rollouts
        logged = await latest_step(trainer.store.redis, trainer.store.keys)
        for line in checkpoint.extra.get("metrics", []):
            if line["step"] > logged:
                trainer.metrics.record(line["step"], line)
    return already_done


async def recover_pending(trainer: Any, already_done: set[str]) -> None:
    """Entries read before a restart: those the last checkpoint consumed are acknowledged now; the
    rest go back into the groups."""
    acked = requeued = 0
    after = "0"
    while True:
        entries = await trainer.store.samples.read_samples(k.TRAINERS_GROUP, trainer.consumer, count=RECOVER_READ_COUNT,
                                                   pending=True, after=after)
        if not entries:
            break
        after = entries[-1][0]
        done = [e for e, _ in entries if e in already_done]
        await trainer.store.samples.ack_samples(k.TRAINERS_GROUP, done)
        acked += len(done)
        rest = [(entry_id, item) for entry_id, item in entries if entry_id not in already_done]
        await trainer.take(rest)
        requeued += len(rest)
    if acked or requeued:
        log.info("after restart: %d entries were already trained on, %d back in their groups", acked, requeued)
