"""A real trainer's v1 and v2, then their chunks lost (what a Redis restart leaves: weights stay out of
the AOF), for the tests of rebuilding lost versions (tests/test_version_rebuild.py,
tests/llm_proxy/test_lost_version.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import redis.asyncio as aioredis
import torch

from fulmen import keys as k
from fulmen.records import Sample
from fulmen.settings import TrainerSettings, load_settings
from fulmen.store import RedisStore
from fulmen.versions.manifest import Manifest, tensor_sha256
from fulmen_trainer.trainer import Trainer

T = TypeVar("T")


async def push_group(store: RedisStore, name: str) -> None:
    """A group of four train samples named ``name`` on the samples stream."""
    for i, reward in enumerate([1.0, 0.0, 1.0, 0.0]):
        sample = Sample(f"{name}{i}.1/t0", "triplet", f"{name}{i}", f"{name}{i}.1", name, 0, [1, 5 + i, 9, 12],
                        [20 + int(reward), 21, 2], [-1.5, -2.0, -0.5], [1, 1, 1], reward, reward, "base",
                        mode="train", group_size=4)
        await store.redis.xadd(store.keys.samples, {"m": sample.to_wire()})


async def train_then_lose(store: RedisStore, tiny: Path, checkpoints: Path, *, lose: bool = True
                          ) -> dict[str, list[Any]]:
    """A trainer publishes v1 and v2 (bf16, full) and stops; Redis then loses both versions' chunks
    (``lose``; else the caller restarts Redis, which loses them). Returns each version's chunk entries
    as they were published."""
    await store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    for name in "ab":
        await push_group(store, name)
    settings = load_settings(TrainerSettings, model_dir=tiny, groups_per_step=1, checkpoint_dir=checkpoints,
                             metrics_file=checkpoints.parent / "m.jsonl", max_steps=2, experiment=store.experiment,
                             learning_rate=1e-3, dtype="bfloat16", device="cpu", checkpoint_every=1)
    trainer = Trainer(store, settings)
    await trainer.setup()
    await asyncio.wait_for(trainer.run(asyncio.Event()), 120)
    assert trainer.version.name == "v2"
    published = {v: await store.weights_redis.xrange(store.keys.weights(v)) for v in ("v1", "v2")}
    if lose:
        await store.weights_redis.delete(store.keys.weights("v1"), store.keys.weights("v2"))
    return published


def serves_manifest(served: dict[str, torch.Tensor], redis_url: str, experiment: str, version: str) -> bool:
    """Whether the tensors a proxy serves are ``version``'s bytes, as its stored manifest names them."""
    manifest = on_store(redis_url, experiment, lambda store: stored_manifest(store, version))
    return {n: tensor_sha256(served[n].to(torch.bfloat16)) for n in manifest.tensors} == {
        n: e.sha256 for n, e in manifest.tensors.items()}


async def stored_manifest(store: RedisStore, version: str) -> Manifest:
    """The manifest the store kept of ``version`` (through the AOF, beside its weights)."""
    return Manifest.from_json((await store.redis.hget(store.keys.version_manifests, version)).decode(), version)


def on_store(redis_url: str, experiment: str, work: Callable[[RedisStore], Awaitable[T]]) -> T:
    """``work`` on a store of its own, from a synchronous test."""
    async def run() -> T:
        client = aioredis.from_url(redis_url)
        try:
            return await work(RedisStore(client, experiment))
        finally:
            await client.aclose()
    return asyncio.run(run())


async def until(check: Callable[[], bool], tries: int = 400) -> None:
    """Wait (a bounded number of short sleeps) until ``check()``; the caller asserts what it needs."""
    for _ in range(tries):
        if check():
            return
        await asyncio.sleep(0.05)
