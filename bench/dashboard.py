"""Benchmark: the dashboard's server time on an experiment with 100,000 rollouts.

Seeds the embedded Redis (in a temporary folder) with ``--n`` rollouts written as the store writes
them (the rollout hash from `Rollout.to_hash`, the index, the status sets; 99% succeeded with a
reward, 1% failed, a model version on each, as the adapter leaves them), one of them with a span
tree of 8 spans (2 LLM calls), 10,000 trainer steps (the stream's cap) and 30 validation passes;
then requests every page ``--repeat`` times through the app in this process (httpx's ASGI
transport: no network, the server's own time) and reports the median and the worst per page.

Pages: the run, the rollout list (newest 50; filtered on a rare status, which walks its whole scan
budget; a reward range; a model version; a later page from a cursor), one rollout with its span
tree, the live pipeline, the curves' JSON (every step in the stream), the dead letters.

    python bench/dashboard.py [--n 100000] [--repeat 20]

Progress goes to stderr; the figures are ONE JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import httpx
import redis.asyncio as aioredis

from fulmen import keys as k
from fulmen.records import Rollout, RolloutConfig, RolloutMode, RolloutStatus
from fulmen.settings import DashboardSettings
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.telemetry.steps import MAX_STEPS, append_step, summarize
from fulmen_dashboard.app import DashboardApp

EXPERIMENT = "bench"
BATCH = 2000
TARGET_MS = 300.0


async def seed(client: aioredis.Redis, n: int) -> str:
    keys = k.Keys(EXPERIMENT)
    await client.sadd(k.EXPERIMENTS, EXPERIMENT)
    start = time.time() - n * 0.01
    for first in range(0, n, BATCH):
        pipe = client.pipeline(transaction=False)
        for i in range(first, min(n, first + BATCH)):
            failed = i % 100 == 7
            status = RolloutStatus.FAILED if failed else RolloutStatus.SUCCEEDED
            rid = f"ro-{i:07d}"
            enqueued = start + i * 0.01
            rollout = Rollout(
                rid, {"question": f"{i % 90 + 10} + {i % 37 + 10} = ?", "answer": str(i % 90 + i % 37 + 20)},
                status=status, mode=RolloutMode.TRAIN, config=RolloutConfig(max_attempts=3),
                metadata={"group_key": f"run-{i // 4}", "group_size": 4}, enqueue_time=enqueued,
                start_time=enqueued + 0.1, end_time=enqueued + 0.5, attempt_count=1, attempt_id=f"{rid}.1",
                reward=None if failed else float(i % 2),
            )
            fields = rollout.to_hash()
            fields["model_version"] = f"v{i // 1000}"
            pipe.hset(keys.rollout(rid), mapping=fields)
            pipe.zadd(keys.rollout_index, {rid: enqueued})
            pipe.sadd(keys.status(status.value), rid)
        await pipe.execute()
        print(f"seeded {min(n, first + BATCH)}/{n}", file=sys.stderr, end="\r")
    print(file=sys.stderr)
    # one rollout as a runner and a proxy leave it: an attempt and a span tree with two LLM calls
    store = RedisStore(client, EXPERIMENT)
    await store.rollouts.enqueue_rollout({"question": "2 + 2 = ?"}, rollout_id="traced", mode="train")
    [claimed] = await store.queue.dequeue_rollouts("bench-worker", count=1, block_s=1)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "dashboard"))
    from seed import llm_span

    from fulmen.records import Span
    from fulmen.telemetry import semconv

    aid = claimed.attempt.attempt_id
    root = Span("traced", aid, "root", semconv.ROLLOUT_SPAN, start_time=time.time(), end_time=time.time(),
                attributes={semconv.SPAN_KIND: semconv.KIND_ROLLOUT})
    spans = [root]
    for j in range(6):
        spans.append(Span("traced", aid, f"op-{j}", "fulmen.operation", parent_id="root", start_time=time.time(),
                          end_time=time.time(), attributes={semconv.SPAN_KIND: semconv.KIND_OPERATION}))
    spans += [replace(llm_span("traced", aid, f"op-{j}"), span_id=f"llm-{j}") for j in range(2)]
    await store.spans.add_spans(spans)
    await store.rollouts.update_attempt("traced", aid, status="succeeded", reward=1.0)
    for step in range(1, MAX_STEPS + 1):
        if step % 1000 == 1:
            print(f"steps {step}/{MAX_STEPS}", file=sys.stderr, end="\r")
        metrics = {"model_version": f"v{step}", "rollout/reward_mean": step / MAX_STEPS, "loss/total": 1 / step,
                   "loss/kl": 0.01, "loss/entropy": 1.5, "perf/tokens_per_s": 900.0, "comm/ratio": 99.0}
        await append_step(client, keys, summarize(step, metrics, time.time()))
    print(file=sys.stderr)
    for v in range(30):
        await client.xadd(keys.validations, {"m": json.dumps({"label": f"v{v * 20}", "step": v * 20,
                                                             "accuracy": v / 30, "mean_reward": v / 30})})
    return "traced"


async def measure(client: aioredis.Redis, repeat: int, traced: str) -> dict[str, dict[str, float]]:
    app = DashboardApp(DashboardSettings(experiment=EXPERIMENT), client=client)
    e = EXPERIMENT
    pages = {
        "run": f"/e/{e}",
        "rollouts": f"/e/{e}/rollouts",
        "rollouts_status_failed": f"/e/{e}/rollouts?status=failed&limit=50",
        "rollouts_reward_range": f"/e/{e}/rollouts?min_reward=0.5&max_reward=1",
        "rollouts_version": f"/e/{e}/rollouts?version=v42",
        "rollouts_cursor": f"/e/{e}/rollouts?cursor={time.time() - 500:.3f}:0",
        "rollout": f"/e/{e}/rollouts/{traced}",
        "live": f"/e/{e}/live",
        "curves_json": f"/e/{e}/curves.json",
        "dead_letters": f"/e/{e}/dead-letters",
        "experiments": "/",
    }
    out = {}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://bench") as http:
        for name, path in pages.items():
            times = []
            for _ in range(repeat):
                started = time.perf_counter()
                response = await http.get(path)
                times.append((time.perf_counter() - started) * 1000)
                if response.status_code != 200:
                    raise SystemExit(f"{path}: HTTP {response.status_code}: {response.text[:300]}")
            out[name] = {"p50_ms": round(statistics.median(times), 1), "max_ms": round(max(times), 1),
                         "bytes": len(response.content)}
            print(f"{name:24} p50 {out[name]['p50_ms']:7.1f} ms  max {out[name]['max_ms']:7.1f} ms", file=sys.stderr)
    return out


async def main(n: int, repeat: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as folder, EmbeddedRedis(Path(folder), port=None) as server:
        client = aioredis.from_url(server.url)
        try:
            traced = await seed(client, n)
            pages = await measure(client, repeat, traced)
            used = (await client.info("memory"))["used_memory_human"]
        finally:
            await client.aclose()
    worst = max(p["max_ms"] for p in pages.values())
    slowest_p50 = max(p["p50_ms"] for p in pages.values())
    return {"bench": "dashboard", "rollouts": n, "steps": MAX_STEPS, "repeat": repeat, "pages": pages,
            "slowest_p50_ms": slowest_p50, "worst_ms": worst, "target_ms": TARGET_MS,
            "under_target": worst < TARGET_MS, "redis_memory": used, "python": platform.python_version()}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=20)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.n, args.repeat))))
