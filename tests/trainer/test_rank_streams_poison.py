"""Garbage on the trainer ranks' streams (plans, gradients, sums) is skipped with a log line; each reader
goes on to the next valid entry instead of crashing (issue 20, item 7)."""

from __future__ import annotations

import msgpack
import torch

from fulmen import codec, tokens
from fulmen.records import RankPlan, Sample
from fulmen.store import RedisStore
from fulmen_trainer.distributed.exchange import Exchange
from fulmen_trainer.distributed.gradients import RankCodec


class _AllLive:
    async def live(self) -> list[int]:
        return [0, 1]


def _plan(rank: int = 1, **changes: object) -> RankPlan:
    sample = Sample("r.1/t0", "triplet", "r", "r.1", "g", 0, [1, 2], [3], [-1.0], [1], 1.0, 1.0, "base")
    fields = dict(step=2, rank=rank, step_before=1, model_version="v1", total_tokens=1, epochs=1,
                  samples=[sample.to_wire()], advantages=tokens.pack_floats([0.5]), rewards=[1.0], group_keys=["g"])
    return RankPlan(**{**fields, **changes})  # type: ignore[arg-type]


GARBAGE = [
    {b"x": b"1"},
    {b"rank": b"one", b"m": b"\xc1"},
    {b"step": b"2", b"rank": b"1", b"epoch": b"zero", b"m": b"\xc1"},
    {b"step": b"2", b"rank": b"1", b"m": b"\xc1garbage"},
    {b"step": b"2", b"rank": b"1", b"m": codec.pack_record("grad_chunk", {"step": "2"})},
    {b"step": b"2", b"rank": b"1", b"report": b"\xc1", b"m": b"\xc1"},
]


async def _exchange(store: RedisStore) -> Exchange:
    exchange = Exchange(store, _AllLive())  # type: ignore[arg-type]
    await exchange.start_reading()
    return exchange


async def test_garbage_plans_are_skipped(real_store: RedisStore) -> None:
    """Unreadable plans, and plans that decode with unusable values, do not stop a rank waiting for its plan."""
    exchange = await _exchange(real_store)
    key = real_store.keys.trainer_plans
    for fields in GARBAGE:
        await real_store.redis.xadd(key, fields)
    raw = msgpack.unpackb(_plan().to_wire())
    await real_store.redis.xadd(key, {"rank": 1, "m": msgpack.packb({**raw, "rewards": [float("nan")]})})
    await real_store.redis.xadd(key, {"rank": 1, "m": msgpack.packb({**raw, "group_keys": []})})
    await exchange.send_plan(_plan(), 1)
    assert await exchange.next_plan(1) == (1, _plan())


async def test_garbage_gradients_and_sums_are_skipped(real_store: RedisStore) -> None:
    """The leader gathers the valid chunks after garbage; a rank takes the valid sum after garbage."""
    exchange = await _exchange(real_store)
    for key in (real_store.keys.trainer_grads, real_store.keys.trainer_aggregates):
        for fields in GARBAGE:
            await real_store.redis.xadd(key, fields)
    rank_codec = RankCodec("none")
    chunks = rank_codec.encode(torch.ones(10), step=2, rank=1)
    wrong_rank = rank_codec.encode(torch.ones(10), step=2, rank=3)
    await real_store.redis.xadd(real_store.keys.trainer_grads, {"step": 2, "epoch": 0, "rank": 1, "m": wrong_rank[0]})
    await exchange.send_gradient(2, 1, chunks, {"cos": 1.0})
    gathered = await exchange.gather(2, [1], deadline_s=5)
    assert gathered == {1: chunks}
    await exchange.send_aggregate(2, chunks)
    assert await exchange.next_aggregate(2) == chunks
