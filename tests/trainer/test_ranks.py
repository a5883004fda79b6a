"""Trainer ranks over Redis: framing, two ranks = one rank, a rank that dies and comes back, a leader
that dies and is replaced (every phase of a step: test_leader_failover.py)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from polling import until
from procs import stop
from rank_procs import FULMEN, metrics_lines, push, ready, start_two_ranks, trainer_env
from safetensors.torch import load_file

from fulmen import keys as k
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.errors import RecordError
from fulmen.records import Sample
from fulmen.store import RedisStore
from fulmen_trainer.distributed.gradients import RankCodec


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


def test_rank_plan_is_a_versioned_record() -> None:
    """The leader's share for a rank round-trips; another schema version or a wrong field is refused."""
    import msgpack

    from fulmen import tokens
    from fulmen.records import RankPlan

    plan = RankPlan(step=3, rank=1, step_before=2, model_version="v2", total_tokens=40, epochs=2,
                    samples=[s.to_wire() for s in _samples(1)], advantages=tokens.pack_floats([0.5, -0.5, 1, -1]),
                    rewards=[1.0, 0.0, 1.0, 0.0], group_keys=["g0"] * 4)
    back = RankPlan.from_wire(plan.to_wire())
    assert back == plan and Sample.from_wire(back.samples[0]) == _samples(1)[0]
    raw = msgpack.unpackb(plan.to_wire())
    with pytest.raises(RecordError, match="schema version"):
        RankPlan.from_wire(msgpack.packb({**raw, "v": 99}))
    with pytest.raises(RecordError, match="wrong type"):
        RankPlan.from_wire(msgpack.packb({**raw, "epochs": "2"}))


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


def _ranks_per_step(metrics: Path) -> list[int]:
    return [line["comm/ranks"] for line in metrics_lines(metrics)]


async def _two_steps_then_sigkill(store: RedisStore, rank: subprocess.Popen[bytes], samples: list[Sample],
                                  metrics: Path) -> None:
    """Two steps taken by both ranks on ``samples``, then ``rank`` SIGKILLed."""
    await push(store, samples)
    await until(lambda: asyncio.sleep(0, len(metrics_lines(metrics)) >= 2))
    rank.send_signal(signal.SIGKILL)
    rank.wait(timeout=10)


def _weights(checkpoint_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(checkpoint_dir / f"step-{step}" / "model" / "model.safetensors"))


@pytest.mark.slow
async def test_two_ranks_reach_the_weights_of_one_rank(redis_url: str, tiny: Path, tmp_path: Path) -> None:
    """On the same batches, 2 ranks (fp32) end with the weights 1 rank reaches, within 1e-5."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    samples = _samples(6)
    one, two = RedisStore(client, "ranks-one-" + tmp_path.name[-8:]), RedisStore(client, "ranks-two-" + tmp_path.name[-8:])
    await push(one, samples)
    single = subprocess.run([FULMEN, "trainer", "--max-steps", "3"], timeout=120,
                            env=trainer_env(redis_url, one.experiment, tiny, tmp_path / "one"))
    assert single.returncode == 0

    env2 = trainer_env(redis_url, two.experiment, tiny, tmp_path / "two", FULMEN_WORLD_SIZE="2")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        leader, follower = await start_two_ranks(two, env2, procs, "--max-steps", "3")
        await push(two, samples)
        assert await asyncio.to_thread(leader.wait, 120) == 0
        await until(lambda: asyncio.sleep(0, (tmp_path / "two" / "ck" / "rank-1" / "step-3").exists()))
        follower.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(follower.wait, 30) == 0
    finally:
        stop(procs, kill=procs[:1])  # the leader's clean exit is not under test here
    assert _ranks_per_step(tmp_path / "two" / "metrics.jsonl") == [2, 2, 2]
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
    env = trainer_env(redis_url, store.experiment, tiny, tmp_path, FULMEN_WORLD_SIZE="2", FULMEN_RANK_TIMEOUT_S="2")
    metrics = tmp_path / "metrics.jsonl"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        leader, follower = await start_two_ranks(store, env, procs, "--max-steps", "6")
        samples = _samples(12)
        await _two_steps_then_sigkill(store, follower, samples[:16], metrics)
        await push(store, samples[16:32])  # two steps: the dead rank is left out
        await until(lambda: asyncio.sleep(0, len(_ranks_per_step(metrics)) >= 4))
        procs.append(subprocess.Popen([FULMEN, "trainer"], env=env))  # it comes back
        await until(lambda: ready(store, 1))
        await push(store, samples[32:])
        assert await asyncio.to_thread(leader.wait, 120) == 0
    finally:
        stop(procs, timeout_s=20)
    per_step = _ranks_per_step(metrics)
    assert per_step[:2] == [2, 2]
    assert per_step[2:4] == [1, 1]
    assert per_step[4:] == [2, 2]
    await client.aclose()


@pytest.mark.slow
async def test_with_wait_the_run_pauses_while_a_rank_is_gone_and_resumes_when_back(
    redis_url: str, tiny: Path, tmp_path: Path
) -> None:
    """on_rank_loss=wait: SIGKILL a rank and the leader takes no step without it (and does not hang);
    restarted, the rank rejoins and every step is taken by both ranks."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    store = RedisStore(client, "ranks-wait-" + tmp_path.name[-8:])
    env = trainer_env(redis_url, store.experiment, tiny, tmp_path, FULMEN_WORLD_SIZE="2", FULMEN_RANK_TIMEOUT_S="2",
                      FULMEN_ON_RANK_LOSS="wait")
    metrics = tmp_path / "metrics.jsonl"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        leader, follower = await start_two_ranks(store, env, procs, "--max-steps", "4")
        samples = _samples(8)
        await _two_steps_then_sigkill(store, follower, samples[:16], metrics)
        await until(lambda: _absent(store, 1))  # its slot expired: the leader now sees it gone
        await push(store, samples[16:])  # two more steps' worth: the leader must wait
        await asyncio.sleep(4)  # two rank timeouts; "continue" steps alone within this (the test above)
        assert _ranks_per_step(metrics) == [2, 2] and leader.poll() is None, "paused, not stepped alone or exited"
        procs.append(subprocess.Popen([FULMEN, "trainer"], env=env))  # it comes back
        assert await asyncio.to_thread(leader.wait, 120) == 0
    finally:
        stop(procs, timeout_s=20)
    assert _ranks_per_step(metrics) == [2, 2, 2, 2]
    await client.aclose()


async def _absent(store: RedisStore, rank: int) -> bool:
    return not await store.redis.exists(store.keys.trainer_slot(rank))


async def test_a_leader_waiting_for_a_missing_rank_stops_when_asked(real_store: RedisStore, tiny: Path,
                                                                    tmp_path: Path) -> None:
    """on_rank_loss=wait with a rank missing: no step is taken, and a stop (SIGTERM) ends the wait at
    once, the step's samples left pending for the next start."""
    from fulmen.settings import TrainerSettings, load_settings
    from fulmen_trainer.distributed.exchange import Exchange
    from fulmen_trainer.distributed.membership import Membership
    from fulmen_trainer.distributed.rank_group import RankGroup
    from fulmen_trainer.trainer import Trainer

    settings = load_settings(TrainerSettings, model_dir=tiny, experiment=real_store.experiment, world_size=2, on_rank_loss="wait",
                             groups_per_step=2, checkpoint_dir=tmp_path / "ck", metrics_file=tmp_path / "m.jsonl",
                             rank_timeout_s=5)
    members = Membership(real_store, 2, settings.rank_timeout_s)
    assert await members.claim() == 0
    beating = asyncio.create_task(members.heartbeat())
    exchange = Exchange(real_store, members)
    await exchange.start_reading()
    group = RankGroup(real_store, members, exchange, RankCodec("none"), wait_for_full_world=True)
    trainer = Trainer(real_store, settings, ranks=group)
    try:
        await trainer.setup()
        await members.mark_ready()
        await push(real_store, _samples(2))
        stop = asyncio.Event()
        running = asyncio.create_task(group.serve(trainer, stop))
        await asyncio.sleep(3)
        assert not running.done() and trainer.step == 0  # waiting for rank 1
        stop.set()
        await asyncio.wait_for(running, 5)
        assert trainer.step == 0
        pending = await real_store.redis.xpending(real_store.keys.samples, k.TRAINERS_GROUP)
        assert pending["pending"] == 8  # read, not trained on, not acknowledged: read again after a restart
    finally:
        beating.cancel()
        await members.release()


@pytest.mark.slow
async def test_when_the_leader_dies_rank_1_leads_and_the_restarted_rank_0_follows(
    redis_url: str, tiny: Path, tmp_path: Path
) -> None:
    """SIGKILL rank 0, the leader: once its lease runs out rank 1 takes over from the agreed step 2 and
    trains steps 3 and 4 alone; restarted, the process takes rank 0 as a follower, catches up with the
    leader's weights and trains steps 5 and 6 with it. The steps stream counts each step once."""
    import redis.asyncio as aioredis

    from fulmen.telemetry.steps import decode_steps

    client = aioredis.from_url(redis_url)
    store = RedisStore(client, "ranks-lead-" + tmp_path.name[-8:])
    env = trainer_env(redis_url, store.experiment, tiny, tmp_path, FULMEN_WORLD_SIZE="2", FULMEN_RANK_TIMEOUT_S="2")
    metrics = tmp_path / "metrics.jsonl"
    procs: list[subprocess.Popen[bytes]] = []
    try:
        leader, follower = await start_two_ranks(store, env, procs)
        samples = _samples(12)
        await _two_steps_then_sigkill(store, leader, samples[:16], metrics)
        await push(store, samples[16:32])
        await until(lambda: _steps_logged(store, 4))
        procs.append(subprocess.Popen([FULMEN, "trainer"], env=env))  # the old rank 0 comes back
        await until(lambda: ready(store, 0))
        await push(store, samples[32:])
        await until(lambda: _steps_logged(store, 6))
        assert follower.poll() is None
    finally:
        stop(procs, timeout_s=20)
    logged = decode_steps(await store.redis.xrange(store.keys.trainer_steps))
    assert [s.step for s in logged] == [1, 2, 3, 4, 5, 6]
    assert [s.metrics["comm/ranks"] for s in logged] == [2, 2, 1, 1, 2, 2]
    await client.aclose()


async def _steps_logged(store: RedisStore, step: int) -> bool:
    from fulmen.telemetry.steps import latest_step

    return await latest_step(store.redis, store.keys) >= step


async def test_a_rank_waiting_for_a_sum_that_never_comes_gives_up_on_a_newer_plan(real_store: RedisStore) -> None:
    """A rank waits for step 3's sum; the leader (restarted, or gone on without it) sends a new plan
    instead: the wait ends (None) and the plan is next. A sum sent before the plan is still taken."""
    from fulmen import tokens
    from fulmen.records import RankPlan
    from fulmen_trainer.distributed.exchange import Exchange
    from fulmen_trainer.distributed.membership import Membership

    members = Membership(real_store, 2, 5.0)
    members.rank = 1
    waiting, leading = Exchange(real_store, members), Exchange(real_store, members)
    await waiting.start_reading()
    plan = RankPlan(step=3, rank=1, step_before=2, model_version="v2", total_tokens=12, epochs=1,
                    samples=[s.to_wire() for s in _samples(1)], advantages=tokens.pack_floats([1, -1, 1, -1]),
                    rewards=[1.0, 0.0, 1.0, 0.0], group_keys=["g0"] * 4)
    waiting_task = asyncio.create_task(waiting.next_aggregate(3, 0, rank=1))
    await asyncio.sleep(0.3)
    await leading.send_plan(plan, 1)
    assert await asyncio.wait_for(waiting_task, 10) is None
    assert await waiting.next_plan(1) == (1, plan)
    summed = RankCodec("none").encode(torch.ones(10), 4, 0)
    await leading.send_aggregate(4, summed, 0, 1)  # the sum of step 4, then already the plan of step 5
    await leading.send_plan(RankPlan(**{**{n: getattr(plan, n) for n in plan.__slots__}, "step": 5}), 1)
    assert await asyncio.wait_for(waiting.next_aggregate(4, 0, rank=1, lease=1), 10) == summed
