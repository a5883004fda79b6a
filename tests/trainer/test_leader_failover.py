"""Leader failover of the Redis trainer ranks: the lease, its fencing, and a leader frozen at each phase
of a step while the lowest live rank takes over (three ranks as asyncio tasks, a tiny model)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from polling import until
from rank_procs import push, ready

from fulmen import keys as k
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import Sample, TrainStep
from fulmen.records.ranks import AgreedStep
from fulmen.settings import TrainerSettings, load_settings
from fulmen.store import RedisStore
from fulmen_trainer.distributed.exchange import Exchange
from fulmen_trainer.distributed.gradients import RankCodec
from fulmen_trainer.distributed.leadership import Leadership, claim_pending
from fulmen_trainer.distributed.membership import Membership
from fulmen_trainer.distributed.rank_group import RankGroup
from fulmen_trainer.trainer import Trainer

TIMEOUT_S = 2.0  # each rank's slot and the leader's lease
WORLD = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _samples(first_group: int, groups: int) -> list[Sample]:
    out = []
    for g in range(first_group, first_group + groups):
        for i in range(4):
            reward = float((i + g) % 2)
            out.append(Sample(f"g{g}-r{i}.1/t0", "triplet", f"g{g}-r{i}", f"g{g}-r{i}.1", f"g{g}", 0,
                              [1, 5 + g % 9, 9 + i, 12], [20 + (i + g) % 5, 21 + i, 2], [-1.0, -2.0, -0.5],
                              [1, 1, 1], reward, reward, "base", group_size=4))
    return out


def _steps(n: int, start: int = 0) -> list[Sample]:
    """Samples for ``n`` steps (two groups of four a step), from step ``start``."""
    return _samples(2 * start, 2 * n)


class Rank:
    """One trainer rank as `fulmen trainer` runs it (claim, heartbeat, setup, ready, serve), in-process;
    `freeze` pauses it the way a stopped process is paused: no heartbeat, no lease renewal."""

    def __init__(self, store: RedisStore, settings: TrainerSettings) -> None:
        self.store, self.settings = store, settings
        self.members = Membership(store, WORLD, TIMEOUT_S)
        self.stop = asyncio.Event()
        self.thaw = asyncio.Event()
        self.frozen = asyncio.Event()
        self.following = asyncio.Event()
        self.tasks: list[asyncio.Task[Any]] = []

    async def start(self) -> None:
        rank = await self.members.claim()
        self.beating = asyncio.create_task(self.members.heartbeat())
        exchange = Exchange(self.store, self.members)
        await exchange.start_reading()
        self.group = RankGroup(self.store, self.members, exchange, RankCodec("none"))
        self.trainer = Trainer(self.store, self.settings, rank=rank, ranks=self.group)
        await self.trainer.setup()
        await self.members.mark_ready()
        follow = self.group.follow

        async def following(trainer: Any, stop: asyncio.Event) -> bool:
            self.following.set()
            return await follow(trainer, stop)

        self.group.follow = following  # type: ignore[method-assign]
        self.tasks.append(asyncio.create_task(self.group.serve(self.trainer, self.stop)))

    async def freeze(self) -> None:
        """Pause here until `thaw` is set: the heartbeat and the lease's renewal stop meanwhile."""
        self.frozen.set()
        self.beating.cancel()
        renew = self.group.leadership.renew

        async def renew_after_thaw() -> bool:
            await self.thaw.wait()
            return await renew()

        self.group.leadership.renew = renew_after_thaw  # type: ignore[method-assign]
        await self.thaw.wait()
        self.beating = asyncio.create_task(self.members.heartbeat())

    def weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.trainer.model.named_parameters()}

    async def close(self) -> None:
        self.thaw.set()
        self.stop.set()
        for task in self.tasks:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 20)
        self.beating.cancel()
        await self.members.release()


@contextlib.asynccontextmanager
async def _three_ranks(store: RedisStore, tiny: Path, tmp_path: Path) -> AsyncIterator[list[Rank]]:
    settings = load_settings(TrainerSettings, model_dir=tiny, experiment=store.experiment, world_size=WORLD,
                             groups_per_step=2, checkpoint_dir=tmp_path / "ck", metrics_file=tmp_path / "m.jsonl",
                             rank_timeout_s=TIMEOUT_S, learning_rate=0.001, torch_threads=1)
    ranks: list[Rank] = []
    try:
        for _ in range(WORLD):
            ranks.append(rank := Rank(store, settings))
            await rank.start()
            await until(lambda: ready(store, ranks[-1].trainer.rank))
        yield ranks
    finally:
        for rank in ranks:
            await rank.close()


async def _agreed(store: RedisStore) -> list[AgreedStep]:
    return [AgreedStep.from_wire(f[b"m"]) for _, f in await store.redis.xrange(store.keys.trainer_agreed)]


async def _until_agreed(store: RedisStore, step: int) -> list[AgreedStep]:
    async def there() -> bool:
        return any(r.step == step for r in await _agreed(store))

    await until(there)
    return await _agreed(store)


def _lineage(records: list[AgreedStep]) -> list[AgreedStep]:
    """The agreed steps whose weights the group holds at the end: the newest record of each step."""
    return list({r.step: r for r in records}.values())


def _freezing(rank: Rank, phase: str, step: int) -> None:
    """Make ``rank`` (the leader) freeze at ``phase`` of ``step``."""
    exchange, leadership = rank.group.exchange, rank.group.leadership

    def wrap(owner: Any, name: str, step_of: Callable[..., int], after: bool = False) -> None:
        real: Callable[..., Awaitable[Any]] = getattr(owner, name)

        async def hooked(*args: Any, **kwargs: Any) -> Any:
            here = step_of(*args) == step and not rank.frozen.is_set()
            if here and not after:
                await rank.freeze()
            result = await real(*args, **kwargs)
            if here and after:
                await rank.freeze()
            return result

        setattr(owner, name, hooked)

    if phase == "before_plans":
        wrap(exchange, "send_plan", lambda plan, lease: plan.step)
    elif phase == "before_sum":
        wrap(exchange, "gather", lambda s, *a: s)
    elif phase == "before_record":
        wrap(leadership, "agree", lambda record: record.step)
    else:
        wrap(leadership, "agree", lambda record: record.step, after=True)


@pytest.mark.parametrize("phase", ["before_plans", "before_sum", "before_record", "after_record"])
async def test_a_leader_frozen_mid_step_is_replaced_and_nothing_is_trained_twice_or_lost(
    real_store: RedisStore, tiny: Path, tmp_path: Path, phase: str
) -> None:
    """Freeze the leader at ``phase`` of step 3: rank 1 takes over and agrees the steps the old one did
    not; thawed, the old leader's writes are refused, it follows and trains step 5 with the others;
    every sample is trained exactly once over the agreed steps, all are acknowledged in the end, and
    the follower that stayed holds the new leader's weights bit for bit."""
    store = real_store
    async with _three_ranks(store, tiny, tmp_path) as (old, new, other):
        assert old.group.leading and not new.group.leading
        await push(store, _steps(2))
        await _until_agreed(store, 2)
        _freezing(old, phase, 3)
        await push(store, _steps(2, start=2))
        await until(lambda: asyncio.sleep(0, old.frozen.is_set()))
        records = await _until_agreed(store, 4)
        by_old = 3 if phase == "after_record" else 2  # the steps the old leader agreed
        assert new.group.leading and {r.rank for r in records if r.step > by_old} == {new.trainer.rank}
        old.thaw.set()  # the old leader comes back: it must step down and follow
        await until(lambda: asyncio.sleep(0, old.following.is_set()))
        await until(lambda: ready(store, old.trainer.rank))
        await push(store, _steps(1, start=4))
        records = await _until_agreed(store, 5)
        await until(lambda: asyncio.sleep(0, all(r.trainer.step == 5 for r in (old, new, other))))
        await until(lambda: _none_pending(store))  # the leader acknowledges after its checkpoint
        weights = [r.weights() for r in (new, other)]
    assert not old.group.leading
    lineage = _lineage(records)
    assert [r.step for r in lineage] == [1, 2, 3, 4, 5]
    assert [r.epoch for r in lineage] == [1] * by_old + [2] * (5 - by_old)
    assert TrainStep.from_wire(lineage[-1].summary).metrics["comm/ranks"] == 3  # the old leader trains again
    trained = Counter(e for r in lineage for e in r.entry_ids)
    pushed = [eid.decode() for eid, _ in await store.redis.xrange(store.keys.samples)]
    print(f"{phase}: agreed steps {[(r.step, r.epoch) for r in records]}, {len(trained)} entries trained once")
    assert sorted(trained) == sorted(pushed) and set(trained.values()) == {1}  # none twice, none lost
    assert all(torch.equal(weights[1][n], weights[0][n]) for n in weights[0])  # the follower's are the leader's


async def _none_pending(store: RedisStore) -> bool:
    return (await store.redis.xpending(store.keys.samples, k.TRAINERS_GROUP))["pending"] == 0


async def test_the_lease_fences_a_deposed_leader(real_store: RedisStore) -> None:
    """The lease goes to one process at a time, each with a higher epoch; once it has run out, its old
    holder can neither renew it nor agree a step, and the new holder can."""
    first, second = Leadership(real_store, "a", 0.2), Leadership(real_store, "b", 0.2)
    assert await first.acquire(0) == 1 and await second.acquire(1) is None
    record = AgreedStep(1, 1, 0, "v1", True, ["1-0"], b"")
    assert await first.agree(record)
    await until(lambda: _lease_gone(real_store))
    assert await second.acquire(1) == 2
    assert not await first.renew() and not await first.agree(AgreedStep(2, 1, 0, "v2", True, ["2-0"], b""))
    assert await second.agree(AgreedStep(2, 2, 1, "v2", True, ["2-0"], b""))
    assert [(r.step, r.epoch) for r in await second.agreed_back_to(0)] == [(2, 2), (1, 1)]


async def _lease_gone(store: RedisStore) -> bool:
    return not await store.redis.exists(store.keys.trainer_leader)


async def test_a_new_leader_claims_every_pending_entry(real_store: RedisStore) -> None:
    """Entries read by a consumer and never acknowledged all move to the new leader's consumer, oldest
    first; with others_only and an idle bound, only another consumer's idle ones do."""
    await push(real_store, _steps(1))
    read = await real_store.samples.read_samples(k.TRAINERS_GROUP, "trainer-0", count=5)
    claimed = await claim_pending(real_store, "trainer-1")
    assert [e for e, _ in claimed] == [e for e, _ in read]
    info = await real_store.redis.xpending_range(real_store.keys.samples, k.TRAINERS_GROUP, "-", "+", 10)
    assert {row["consumer"] for row in info} == {b"trainer-1"}
    assert await claim_pending(real_store, "trainer-1", min_idle_ms=60_000, others_only=True) == []


async def test_a_rank_behind_the_agreed_steps_catches_up_before_it_leads(real_store: RedisStore) -> None:
    """A rank that takes the lead behind the newest agreed step (left out of it: step -1) loads the newest
    agreed version that is published, at its step; one level with the agreed steps loads nothing."""
    from types import SimpleNamespace

    from fulmen.versions.model_version import publish_model_version
    from fulmen_trainer.checkpoints import catch_up

    for seed in (1, 2):  # v1 and v2 published; v3 agreed, its leader died before publishing it
        await publish_model_version(real_store, {"w": torch.full((2,), float(seed))}, model="tiny")
    records = [AgreedStep(step, 1, 0, f"v{step}", True, [], b"") for step in (3, 2, 1)]  # newest first
    loaded: list[tuple[str, int]] = []

    async def load_version(version: Any, step: int) -> None:
        loaded.append((version.name, step))
        behind.step = step

    behind = SimpleNamespace(step=-1, rank=1, store=real_store, load_version=load_version)
    assert (await catch_up(behind, records)).step == 2
    assert loaded == [("v2", 2)]
    level = SimpleNamespace(step=3, rank=1, store=real_store, load_version=load_version)
    assert await catch_up(level, records) is None and loaded == [("v2", 2)]
