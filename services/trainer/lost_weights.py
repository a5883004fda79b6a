"""Weights that Redis lost: the newest version announced, its chunks gone.

A version's chunks on a Redis stream are not kept in Redis's append-only file (`fulmen.version_blobs`),
nor by a weights-only Redis without one (FULMEN_WEIGHTS_REDIS_URL): after that server restarts, the
versions written since its last rewrite are still named in the resources log but have no weights. The
proxies that loaded the newest one keep serving it; one that starts then cannot, serves its base weights,
and with ``--staleness 0`` no rollout would start until it serves the newest version — while the trainer
waits for rollouts to train the next one. So the trainer looks for its newest version's stream when it
starts and now and then while it waits for samples, and if it is gone publishes the same weights again
under the same name (whole: a delta's base is gone with it); the proxies load a version named again as
any new one. Called by `Trainer.run` and `resume_from` with the trainer itself.

Ranks that shard the model (FSDP) publish together, inside a step: they log what they found instead.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger(__name__)

CHECK_EVERY_S = 10.0  # one EXISTS per check, only while the trainer waits for samples


async def weights_lost(trainer: Any) -> bool:
    """Whether the trainer's newest published version has no weights left in Redis (the shared folder,
    ``weights_dir``, is not Redis's to lose; version 0 is the base model, never published)."""
    if trainer.version.number == 0 or trainer.s.weights_dir is not None:
        return False
    store = trainer.store
    return not await store.weights_redis.exists(store.keys.weights(trainer.version.name))


async def republish_if_lost(trainer: Any, *, now: bool = False) -> bool:
    """On rank 0, at most every CHECK_EVERY_S (``now``: this time whatever the last check): publish the
    weights again if Redis lost the newest version's (see the module docstring). True if it did."""
    clock = time.monotonic()
    if trainer.rank != 0 or (not now and clock < getattr(trainer, "_next_weights_check", 0.0)):
        return False
    trainer._next_weights_check = clock + CHECK_EVERY_S
    if not await weights_lost(trainer):
        return False
    version = trainer.version.name
    if getattr(trainer.ranks, "sharded", False):
        log.error("the weights of model version %s are gone from Redis (it restarted since they were written): "
                  "proxies that start now serve their base weights until the next step's version", version)
        return False
    log.warning("the weights of model version %s are gone from Redis (it restarted since they were written): "
                "publishing them again", version)
    trainer.publisher.previous = None  # whole: the version a delta would build on is gone too
    await trainer.publish(resumed=True)
    return True
