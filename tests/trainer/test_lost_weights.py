"""Weights that Redis lost (they are not in its append-only file): the newest version is still named in
the resources log, its stream is gone. The trainer writes it again under its own name from its
checkpoint (a delta with its base), while it runs and when it starts; when no checkpoint holds its
bytes, it publishes its weights again as the next version, whole. A proxy that could not load the
lost version then loads it, bit for bit."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch
from rebuild_helpers import push_group

from fulmen import keys as k
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.settings import TrainerSettings, load_settings
from fulmen.store import RedisStore
from fulmen.versions.manifest import FULL, tensor_sha256
from fulmen_llm_proxy.backends.torch.backend import TorchBackend
from fulmen_llm_proxy.following import ModelFollower
from fulmen_trainer.publishing import republish_if_lost
from fulmen_trainer.trainer import Trainer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _trainer(store: RedisStore, tiny: Path, tmp_path: Path, max_steps: int) -> Trainer:
    settings = load_settings(TrainerSettings, model_dir=tiny, groups_per_step=1, checkpoint_dir=tmp_path / "ck",
                             metrics_file=tmp_path / "m.jsonl", max_steps=max_steps, experiment=store.experiment,
                             learning_rate=1e-5, dtype="bfloat16", device="cpu", publish_format="delta",
                             keyframe_every=5, checkpoint_every=1)
    return Trainer(store, settings)


async def _served_after_catch_up(store: RedisStore, tiny: Path) -> tuple[str, dict[str, str]]:
    """What a proxy that starts now serves: its version and each tensor's sha256 in the trained dtype."""
    backend = TorchBackend(tiny)
    await backend.start()
    try:
        follower = ModelFollower(store, backend, lambda v, outcome: None)
        await follower.catch_up()
        follower._drop_prefetch()  # its read-ahead of the next name must not outlive this check
        return backend.model_version, {n: tensor_sha256(t.to(torch.bfloat16)) for n, t in backend.current_weights().items()}
    finally:
        await backend.close()


async def _run_until(trainer: Trainer, store: RedisStore, version: str) -> None:
    """Run the trainer (waiting for samples) until ``version``'s chunks are stored."""
    trainer.s = trainer.s.model_copy(update={"max_steps": trainer.step + 1})
    trainer.lost_weights.next_check = 0.0
    stop = asyncio.Event()
    running = asyncio.create_task(trainer.run(stop))
    try:
        for _ in range(300):
            if await store.weights_redis.exists(store.keys.weights(version)):
                break
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.wait_for(running, 30)


async def test_lost_weights_are_rebuilt_under_their_own_name_while_waiting_and_at_start(
        real_store: RedisStore, tiny: Path, tmp_path: Path) -> None:
    """The lost newest version (a delta on v1) comes back as itself, the same bytes, and a proxy serves it."""
    store = real_store
    await store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    for name in "ab":
        await push_group(store, name)
    trainer = _trainer(store, tiny, tmp_path, max_steps=2)
    await trainer.setup()
    await asyncio.wait_for(trainer.run(asyncio.Event()), 120)
    assert trainer.version.name == "v2"  # v2 is a delta on v1
    published = {n: tensor_sha256(t) for n, t in trainer.policy.published_state().items()}
    blob_sha = {v: await store.weights_redis.xrange(store.keys.weights(v), count=1) for v in ("v1", "v2")}
    assert not await republish_if_lost(trainer, now=True)  # stored: nothing to do

    # Redis restarted and lost the weights written since its last rewrite: v1 and v2
    await store.weights_redis.delete(store.keys.weights("v1"), store.keys.weights("v2"))

    # the trainer, waiting for samples, finds the stream gone and writes v1 and v2 again from its checkpoints
    await _run_until(trainer, store, "v2")
    assert trainer.version.name == "v2"
    for version, first_chunk in blob_sha.items():  # the same chunks, byte for byte
        assert await store.weights_redis.xrange(store.keys.weights(version), count=1) == first_chunk
    assert (await store.resources.get_latest_resources()).resources["llm"]["model_version"] == "v2"
    assert await _served_after_catch_up(store, tiny) == ("v2", published)

    # lost again, and the trainer restarts from its checkpoint: it rebuilds v2 as it starts
    await store.weights_redis.delete(store.keys.weights("v1"), store.keys.weights("v2"))
    restarted = _trainer(store, tiny, tmp_path, max_steps=3)
    await restarted.setup()
    assert restarted.version.name == "v2"
    assert await _served_after_catch_up(store, tiny) == ("v2", published)


async def test_a_lost_version_no_checkpoint_holds_is_published_again_as_the_next(
        real_store: RedisStore, tiny: Path, tmp_path: Path) -> None:
    """Without the checkpoint of a delta's base, the trainer publishes its weights as v3, whole."""
    store = real_store
    await store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    for name in "ab":
        await push_group(store, name)
    trainer = _trainer(store, tiny, tmp_path, max_steps=2)
    await trainer.setup()
    await asyncio.wait_for(trainer.run(asyncio.Event()), 120)
    published = {n: tensor_sha256(t) for n, t in trainer.policy.published_state().items()}
    await store.weights_redis.delete(store.keys.weights("v1"), store.keys.weights("v2"))
    shutil.rmtree(trainer.checkpoint_folder / "step-1")  # v1, the base of the delta v2

    await _run_until(trainer, store, "v3")
    assert trainer.version.name == "v3"
    newest = (await store.resources.get_latest_resources()).resources["llm"]
    assert newest["model_version"] == "v3" and newest["weights"].get("format", FULL) == FULL
    assert await _served_after_catch_up(store, tiny) == ("v3", published)
    assert not await republish_if_lost(trainer, now=True)  # stored again: nothing to do
