"""`fulmen eval`: a checkpoint published as a model version, served, and validated like the run's passes."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fulmen import progress
from fulmen.errors import FulmenError
from fulmen.records.status import RolloutStatus
from fulmen.settings import EvalSettings
from fulmen.store import RedisStore
from fulmen.store.finished import SHARD_BLOCK_S, WAIT_READ_COUNT
from fulmen.store.redis.stream import Cursor
from fulmen.versions.model_version import (
    POLICY_RESOURCES_ID,
    SERVE_TIMEOUT_S,
    ModelVersion,
    publish_model_version,
    wait_until_served,
)
from fulmen_algorithm.dataset import Task
from fulmen_algorithm.scheduler import recoverable_rollout_config
from fulmen_algorithm.validation import PassSampling, validate

WEIGHTS_FILE = "model.safetensors"


class NotServed(FulmenError):
    """No live proxy loaded the published version in time."""


def weights_of(checkpoint: Path) -> Path | None:
    """The checkpoint's weights file, or None when the folder is no Hugging Face model."""
    weights = checkpoint / WEIGHTS_FILE
    return weights if weights.exists() else None


async def evaluate_checkpoint(store: RedisStore, checkpoint: Path, tasks: list[Task], settings: EvalSettings) -> dict[str, Any]:
    """Publish the checkpoint's weights as a new model version of the policy, wait until it is served,
    and run a validation pass on it; the pass's result."""
    from safetensors.torch import load_file

    policy = await store.resources.get_resources(POLICY_RESOURCES_ID)
    model = (policy.resources.get("llm") or {}).get("model", checkpoint.name)
    update = await publish_model_version(store, load_file(str(checkpoint / WEIGHTS_FILE)), model=model)
    version = ModelVersion.of(update)
    if not await wait_until_served(store, version):
        raise NotServed(f"no proxy loaded {version.name} within {SERVE_TIMEOUT_S:.0f} s; is `fulmen llm-proxy` running?")
    config = recoverable_rollout_config(settings.rollout_unresponsive_s, settings.rollout_max_attempts)
    label = f"eval-{version.name}"
    with progress.bar("eval", len(tasks) * settings.val_samples) as bar:
        # taken before the pass enqueues anything: no rollout of it finishes unseen
        cursors = [await stream.cursor() for stream in store.finished.streams] if bar.drawn else []
        follower = asyncio.create_task(follow_pass(store, cursors, label, bar)) if cursors else None
        try:
            result = await validate(store, tasks, label=label, timeout_s=settings.val_timeout_s, config=config,
                                    sampling=PassSampling.of(settings))
        finally:
            if follower is not None:
                follower.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await follower
        bar.update(completed=result["finished"], note=f"accuracy {result['accuracy']:.2f}")
    return result


async def follow_pass(store: RedisStore, cursors: Sequence[Cursor[Any]], label: str, bar: progress.Bar) -> None:
    """Move ``bar`` a step per rollout of the pass ``label`` that finishes, its text the accuracy so
    far (a reward of at least 1, as `validate` counts it); until cancelled."""
    prefix = f"val-{label}-"  # `fulmen_algorithm.validation`'s rollout ids
    finished: set[str] = set()
    correct = 0
    block_s = 1.0 if len(cursors) == 1 else SHARD_BLOCK_S
    for turn in itertools.count():
        entries = await cursors[turn % len(cursors)].read(block_s, WAIT_READ_COUNT)
        ids = list(dict.fromkeys(f.rollout_id for _, f in entries
                                 if f.rollout_id.startswith(prefix) and f.rollout_id not in finished))
        if not ids:
            continue
        for rollout_id, rollout in zip(ids, await store.rollouts.get_rollouts(ids), strict=True):
            finished.add(rollout_id)
            if rollout is not None and rollout.status is RolloutStatus.SUCCEEDED and (rollout.reward or 0.0) >= 1.0:
                correct += 1
        bar.update(completed=len(finished), note=f"accuracy {correct / len(finished):.2f}")
