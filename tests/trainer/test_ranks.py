"""Trainer ranks over Redis: framing, two ranks = one rank, a rank that dies and comes back."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fulmen import keys as k
from fulmen.errors import RecordError
from fulmen.records import Sample
from fulmen.store import RedisStore
from fulmen.tiny_model import build_tiny_model
from fulmen_trainer.ranks import RankCodec

FULMEN = str(Path(sys.executable).with_name("fulmen"))


def test_rank_chunks_round_trip_and_refuse_damage() -> None:
    """Lossless round trip over several chunks; a flipped byte or a missing chunk is refused."""
    codec = RankCodec("none")
    flat = torch.randn(3_000_000)
    chunks = codec.encode(flat, step=4, rank=1)
    assert len(chunks) >= 2 and torch.equal(codec.decode(chunks), flat)
    damaged = bytearray(chunks[1])
    damaged[-10] ^= 0xFF
    with pytest.raises(RecordError):
        codec.decode([chunks[0], bytes(damaged), *chunks[2:]])
    with pytest.raises(RecordError):
        codec.decode(chunks[:-1])
    with pytest.raises(ValueError, match="dgc"):
        RankCodec("zip")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _samples(groups: int) -> list[Sample]:
    out = []
    for g in range(groups):
        for i in range(4):
            prompt = [1, 5 + g % 9, 9 + i, 12]
            response = [20 + (i + g) % 5, 21 + i, 2]
            reward = float((i + g) % 2)
            out.append(Sample(f"g{g}-r{i}.1/t0", "triplet", f"g{g}-r{i}", f"g{g}-r{i}.1", f"g{g}", 0, prompt,
                              response, [-1.0, -2.0, -0.5], [1, 1, 1], reward, reward, "base", group_size=4))
    return out


async def _push(store: RedisStore, samples: list[Sample]) -> None:
    await store.ensure_samples_group(k.TRAINERS_GROUP)
    for s in samples:
        await store.redis.xadd(store.keys.samples, {"m": s.to_wire()})


def _env(redis_url: str, experiment: str, tiny: Path, out: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "REDIS_URL": redis_url, "FULMEN_EXPERIMENT": experiment, "FULMEN_MODEL_DIR": str(tiny),
            "FULMEN_GROUPS_PER_STEP": "2", "FULMEN_CHECKPOINT_DIR": str(out / "ck"),
            "FULMEN_METRICS_FILE": str(out / "metrics.jsonl"), "FULMEN_TORCH_THREADS": "1",
            "FULMEN_LEARNING_RATE": "0.001", **extra}


async def _ready(store: RedisStore, rank: int) -> bool:
    return (await store.redis.get(store.keys.trainer_slot(rank)) or b"").endswith(b":ready")


async def _wait(predicate, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    for _ in range(int(timeout_s / 0.05)):
        if await predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("timed out")


def _weights(checkpoint_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint_dir / f"step-{step}" / "model" / "model.safetensors"))


@pytest.mark.slow
async def test_two_ranks_reach_the_weights_of_one_rank(redis_url: str, tiny: Path, tmp_path: Path) -> None:
    """On the same batches, 2 ranks (fp32) end with the weights 1 rank reaches, within 1e-5."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    samples = _samples(6)
    one, two = RedisStore(client, "ranks-one-" + tmp_path.name[-8:]), RedisStore(client, "ranks-two-" + tmp_path.name[-8:])
    await _push(one, samples)
    single = subprocess.run([FULMEN, "trainer", "--max-steps", "3"], timeout=120,
                            env=_env(redis_url, one.experiment, tiny, tmp_path / "one"))
    assert single.returncode == 0

    env2 = _env(redis_url, two.experiment, tiny, tmp_path / "two", FULMEN_WORLD_SIZE="2")
    leader = subprocess.Popen([FULMEN, "trainer", "--max-steps", "3"], env=env2)
    try:
        await _wait(lambda: _ready(two, 0))
        follower = subprocess.Popen([FULMEN, "trainer"], env=env2)
        await _wait(lambda: _ready(two, 1))
        await _push(two, samples)
        assert await asyncio.to_thread(leader.wait, 120) == 0
        await _wait(lambda: asyncio.sleep(0, (tmp_path / "two" / "ck" / "rank-1" / "step-3").exists()))
        follower.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(follower.wait, 30) == 0
    finally:
        leader.kill()
    lines = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [line["comm/ranks"] for line in lines] == [2, 2, 2]
    reference = _weights(tmp_path / "one" / "ck" / "rank-0", 3)
    for rank in (0, 1):
        got = _weights(tmp_path / "two" / "ck" / f"rank-{rank}", 3)
        for name, tensor in reference.items():
            assert torch.allclose(got[name], tensor, atol=1e-5), (rank, name)
    moved = _weights(tmp_path / "one" / "ck" / "rank-0", 3)
    initial = load_file(str(tiny / "model.safetensors"))
    assert any(not torch.equal(moved[n], initial[n]) for n in initial if n in moved)
    await client.aclose()


@pytest.mark.slow
async def test_a_rank_that_dies_is_left_out_and_picked_up_when_back(redis_url: str, tiny: Path, tmp_path: Path) -> None:
    """SIGKILL a rank: the leader keeps stepping alone; restarted, the rank rejoins and trains again."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    store = RedisStore(client, "ranks-die-" + tmp_path.name[-8:])
    env = _env(redis_url, store.experiment, tiny, tmp_path, FULMEN_WORLD_SIZE="2", FULMEN_RANK_TIMEOUT_S="2")
    metrics = tmp_path / "metrics.jsonl"

    def ranks_per_step() -> list[int]:
        return [json.loads(x)["comm/ranks"] for x in metrics.read_text().splitlines()] if metrics.exists() else []

    leader = subprocess.Popen([FULMEN, "trainer", "--max-steps", "6"], env=env)
    procs = [leader]
    try:
        await _wait(lambda: _ready(store, 0))
        procs.append(follower := subprocess.Popen([FULMEN, "trainer"], env=env))
        await _wait(lambda: _ready(store, 1))
        samples = _samples(12)
        await _push(store, samples[:16])  # two steps with both ranks
        await _wait(lambda: asyncio.sleep(0, len(ranks_per_step()) >= 2))
        follower.send_signal(signal.SIGKILL)
        follower.wait(timeout=10)
        await _push(store, samples[16:32])  # two steps: the dead rank is left out
        await _wait(lambda: asyncio.sleep(0, len(ranks_per_step()) >= 4))
        procs.append(subprocess.Popen([FULMEN, "trainer"], env=env))  # it comes back
        await _wait(lambda: _ready(store, 1))
        await _push(store, samples[32:])
        assert await asyncio.to_thread(leader.wait, 120) == 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
    per_step = ranks_per_step()
    assert per_step[:2] == [2, 2]
    assert per_step[2:4] == [1, 1]
    assert per_step[4:] == [2, 2]
    await client.aclose()
