"""Benchmark: the Redis CPU of a rollout through the store against the least any design could cost.

The store's lifecycle (issue 18's ``redis_cpu_us_per_rollout``) next to a floor: the same rollouts
(the same input, 8 spans of ~1 KB as one compressed value per call) through bare Lua scripts that
keep only what any store must write — the rollout's hash and its queue entry at enqueue; its status
and worker at claim (XREADGROUP inside the script, 8 at a time); its spans on a stream of its own, its
end and a completions entry at finish (8 finishes per script call) — and nothing else: no status
index, no rollout index, no attempt record, no dedupe keys, no priority lanes, no watch lists, no
retry policy. Both run against one embedded Redis (AOF on, fsynced every second), in alternating
blocks, in one process: what the machine's speed does to one it does to the other, so the ratio holds
on a loaded machine where the absolute figures do not.

    python bench/store_floor.py [--n 4000] [--rounds 3]

Server CPU comes from ``INFO cpu`` per phase. Progress goes to stderr; the figures are ONE JSON
object on the last line of stdout: ``store_us_per_rollout``, ``floor_us_per_rollout``,
``store_vs_floor`` and both per phase.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
from collections.abc import Awaitable, Callable
from typing import Any

import msgpack
import redis.asyncio as aioredis
from store_lifecycle import make_spans

from fulmen.records.spans import pack_span_batch
from fulmen.settings import CommonSettings
from fulmen.store import RedisStore
from fulmen.store.redis.connection import connect
from fulmen.store.redis.embedded import EmbeddedRedis

PHASES = ("enqueue", "claim", "finish", "read")
BATCH = 8  # rollouts per claim and per finish round trip, as the runners of bench/store_cluster.py

ENQUEUE = """
local t = redis.call('TIME')[1]
for i = 1, #ARGV, 2 do
  local qid = redis.call('XADD', KEYS[1] .. 'queue', '*', 'm', ARGV[i + 1])
  redis.call('HSET', KEYS[1] .. 'rollout:' .. ARGV[i], 'input', ARGV[i + 1], 'status', 'queuing', 'qid', qid,
             'enqueue_time', t)
end
"""
CLAIM = """
local read = redis.call('XREADGROUP', 'GROUP', 'runners', ARGV[1], 'COUNT', ARGV[2], 'NOACK', 'STREAMS',
                        KEYS[1] .. 'queue', '>')
local out = {}
if not read then return out end
local t = redis.call('TIME')[1]
for _, entry in ipairs(read[1][2]) do
  local rk = KEYS[1] .. 'rollout:' .. cmsgpack.unpack(entry[2][2]).id
  out[#out + 1] = redis.call('HGETALL', rk)
  redis.call('HSET', rk, 'status', 'preparing', 'worker', ARGV[1], 'start_time', t)
end
return out
"""
FINISH = """
local t = redis.call('TIME')[1]
for i = 1, #ARGV, 2 do
  local rk = KEYS[1] .. 'rollout:' .. ARGV[i]
  if redis.call('HGET', rk, 'status') == 'preparing' then
    redis.call('XADD', KEYS[1] .. 'spans:' .. ARGV[i], '*', 'z', ARGV[i + 1])
    redis.call('HSET', rk, 'status', 'succeeded', 'end_time', t)
    redis.call('XADD', KEYS[1] .. 'finished', '*', 'm', ARGV[i])
  end
end
"""


def log(message: str, *args: Any) -> None:
    print(f"[store_floor] {message % args}", file=sys.stderr, flush=True)


async def server_cpu_s(redis: aioredis.Redis) -> float:
    info = await redis.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


async def timed_phases(redis: aioredis.Redis, phases: list[Callable[[], Awaitable[None]]]) -> list[float]:
    """Server CPU-seconds spent in each phase, run one after the other."""
    spent = []
    for phase in phases:
        before = await server_cpu_s(redis)
        await phase()
        spent.append(await server_cpu_s(redis) - before)
    return spent


def store_phases(redis: aioredis.Redis, experiment: str, n: int) -> list[Callable[[], Awaitable[None]]]:
    store = RedisStore(redis, experiment)
    claimed: list[Any] = []

    async def enqueue() -> None:
        await store.queue.ensure()
        await store.finished.ensure_finished_group("bench", start="$")
        rollouts = [store.rollouts.new_rollout({"task": i, "question": f"what is {i} + {i}?"}) for i in range(n)]
        for i in range(0, n, 500):
            await store.rollouts.enqueue_rollouts(rollouts[i:i + 500])

    async def claim() -> None:
        while len(claimed) < n:
            claimed.extend(await store.queue.dequeue_rollouts("w", BATCH))

    async def finish() -> None:
        for i in range(0, n, BATCH):
            await asyncio.gather(*(
                store.rollouts.update_attempt(a.rollout.rollout_id, a.attempt.attempt_id, status="succeeded",
                                     spans=make_spans(a.rollout.rollout_id, a.attempt.attempt_id))
                for a in claimed[i:i + BATCH]))

    async def read() -> None:
        got = 0
        while got < n:
            finished = await store.finished.read_finished("bench", "reader", count=1000, block_s=1.0)
            await store.finished.ack_finished("bench", [f.entry_id for f in finished])
            got += len(finished)

    return [enqueue, claim, finish, read]


def floor_phases(redis: aioredis.Redis, experiment: str, n: int) -> list[Callable[[], Awaitable[None]]]:
    prefix = f"floor:{{{experiment}}}:"
    enqueue_script, claim_script, finish_script = (redis.register_script(s) for s in (ENQUEUE, CLAIM, FINISH))
    ids = [f"ro-{experiment}-{i:08d}" for i in range(n)]

    async def enqueue() -> None:
        await redis.xgroup_create(prefix + "queue", "runners", id="$", mkstream=True)
        await redis.xgroup_create(prefix + "finished", "bench", id="$", mkstream=True)
        for first in range(0, n, 500):
            args: list[Any] = []
            for i in range(first, min(first + 500, n)):
                args += [ids[i], msgpack.packb({"id": ids[i], "task": i, "question": f"what is {i} + {i}?"})]
            await enqueue_script(keys=[prefix], args=args)

    async def claim() -> None:
        got = 0
        while got < n:
            got += len(await claim_script(keys=[prefix], args=["w", BATCH]))

    async def finish() -> None:
        for first in range(0, n, BATCH):
            args: list[Any] = []
            for rid in ids[first:first + BATCH]:
                args += [rid, pack_span_batch([s.to_wire() for s in make_spans(rid, rid + ".1")])]
            await finish_script(keys=[prefix], args=args)

    async def read() -> None:
        got = 0
        while got < n:
            reply = await redis.xreadgroup("bench", "reader", {prefix + "finished": ">"}, count=1000, block=1000)
            entries = reply[0][1] if reply else []
            if entries:
                await redis.xack(prefix + "finished", "bench", *[e[0] for e in entries])
            got += len(entries)

    return [enqueue, claim, finish, read]


async def run(url: str, n: int, rounds: int) -> dict[str, Any]:
    redis = await connect(CommonSettings(redis_url=url), wait_s=10)
    totals = {"store": [0.0] * len(PHASES), "floor": [0.0] * len(PHASES)}
    try:
        for r in range(rounds):
            for name, phases in (("store", store_phases), ("floor", floor_phases)):
                spent = await timed_phases(redis, phases(redis, f"{name}-{r}", n))
                totals[name] = [a + b for a, b in zip(totals[name], spent, strict=True)]
                log("round %d %s: %.1f us per rollout", r + 1, name, sum(spent) / n * 1e6)
    finally:
        await redis.aclose()
    per = {name: [s / (n * rounds) * 1e6 for s in spent] for name, spent in totals.items()}
    out: dict[str, Any] = {"bench": "store_floor", "n": n, "rounds": rounds}
    for name in ("store", "floor"):
        out[f"{name}_us_per_rollout"] = round(sum(per[name]), 1)
        out[f"{name}_us_by_phase"] = {phase: round(v, 1) for phase, v in zip(PHASES, per[name], strict=True)}
    out["store_vs_floor"] = round(sum(per["store"]) / sum(per["floor"]), 2)
    out["python"] = platform.python_version()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=4000, help="rollouts per round and design")
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of each design")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(tmp, port=None) as server:
        print(json.dumps(asyncio.run(run(server.url, args.n, args.rounds))))


if __name__ == "__main__":
    main()
