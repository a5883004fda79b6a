"""Benchmark: what the runner itself costs, through the real `fulmen runner` code path.

1. ``rollouts_per_s``: one `fulmen runner` process (the console script, as honcho starts it) at
   ``--concurrency 64`` runs ``--n`` queued rollouts of a no-op agent that emits 8 spans (7 messages
   and its reward; the runner adds the attempt's root span). Timed from the runner's first claim to
   the last completion observed on the completions stream; the runner's CPU time comes from /proc.
2. ``spans_per_s``: a process that only emits spans (`fulmen.emit_message` inside 64 bound attempts,
   through the same TracerProvider, SpanBuffer and SpanWriter the runner uses) until ``--spans`` are
   stored.

Both run against the embedded Redis (AOF on, fsync every second) in a temporary folder.

    python bench/runner_overhead.py [--n 5000] [--spans 100000]

Progress goes to stderr; the figures are ONE JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis

EXPERIMENT = "bench-runner"
AGENT_MODULE = '''
import fulmen

@fulmen.rollout
async def noop8(task):
    for i in range(7):
        fulmen.emit_message("step")
    return 1.0
'''


def log(message: str, *args: Any) -> None:
    print(f"[runner_overhead] {message % args}", file=sys.stderr, flush=True)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def bench_runner(url: str, redis_pid: int, n: int, concurrency: int, workdir: Path) -> dict[str, Any]:
    client = aioredis.from_url(url)
    store = RedisStore(client, EXPERIMENT)
    await store.finished.ensure_finished_group("bench")
    ids = []
    for start in range(0, n, 1000):
        batch = [store.rollouts.new_rollout({"i": i}) for i in range(start, min(n, start + 1000))]
        await store.rollouts.enqueue_rollouts(batch)
        ids += [r.rollout_id for r in batch]
    log("queued %d rollouts; starting `fulmen runner --concurrency %d`", n, concurrency)
    (workdir / "bench_agents.py").write_text(AGENT_MODULE)
    env = {
        **os.environ,
        "REDIS_URL": url,
        "FULMEN_EXPERIMENT": EXPERIMENT,
        "FULMEN_LOG_LEVEL": "WARNING",
        "PYTHONPATH": str(workdir),
    }
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)
    fulmen_bin = shutil.which("fulmen") or str(Path(sys.executable).with_name("fulmen"))
    proc = subprocess.Popen(
        [fulmen_bin, "runner", "--agent", "bench_agents:noop8", "--concurrency", str(concurrency)],
        env=env,
        cwd=workdir,
    )
    try:
        seen = 0
        first = None
        cpu_at_first = redis_at_first = 0.0
        while seen < n:
            batch = await store.finished.read_finished("bench", "bench", count=1000, block_s=30)
            if not batch:
                raise SystemExit(f"no completion for 30 s ({seen}/{n}); is the runner alive? rc={proc.poll()}")
            if first is None:
                first, cpu_at_first, redis_at_first = time.perf_counter(), cpu_s(proc.pid), cpu_s(redis_pid)
            seen += len(batch)
            await store.finished.ack_finished("bench", [c.entry_id for c in batch])
            if seen % 1000 < len(batch):
                log("%d/%d done", seen, n)
        elapsed = time.perf_counter() - (first or time.perf_counter())
        runner_cpu = cpu_s(proc.pid) - cpu_at_first
        redis_cpu = cpu_s(redis_pid) - redis_at_first
        stats = await store.statistics()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        await client.aclose()
    succeeded = stats["rollouts"].get("succeeded", 0) if isinstance(stats.get("rollouts"), dict) else None
    return {
        "rollouts_per_s": round((n - 1) / elapsed, 1),
        "runner_cpu_ms_per_rollout": round(1000 * runner_cpu / n, 3),
        "runner_cpu_cores": round(runner_cpu / elapsed, 2),
        "redis_cpu_ms_per_rollout": round(1000 * redis_cpu / n, 3),
        "redis_cpu_cores": round(redis_cpu / elapsed, 2),
        "rollouts": n,
        "succeeded": succeeded,
        "concurrency": concurrency,
    }


async def bench_spans(url: str, n_spans: int, attempts: int) -> dict[str, Any]:
    """Emit spans inside `attempts` bound attempts until ``n_spans`` are stored."""
    import fulmen
    from fulmen.telemetry.tracing import bind, setup_tracing
    from fulmen_runner.span_writer import SpanWriter

    client = aioredis.from_url(url)
    store = RedisStore(client, EXPERIMENT + "-spans")
    claimed = [await store.rollouts.start_rollout({"i": i}, "bench") for i in range(attempts)]
    _, buffer = setup_tracing("bench-spans")
    writer = SpanWriter(store, buffer)
    flusher = asyncio.create_task(writer.run())
    per_attempt = n_spans // attempts

    async def emit(rollout_id: str, attempt_id: str) -> None:
        with bind(rollout_id, attempt_id):
            for i in range(per_attempt):
                fulmen.emit_message("x")
                if i % 100 == 99:
                    await asyncio.sleep(0)  # let the writer and the other attempts run

    cpu0 = time.process_time()
    t0 = time.perf_counter()
    await asyncio.gather(*(emit(c.rollout.rollout_id, c.attempt.attempt_id) for c in claimed))
    for c in claimed:
        await writer.flush(c.attempt.attempt_id)
    elapsed = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    flusher.cancel()
    stored = sum([len(await store.spans.query_spans(c.rollout.rollout_id)) for c in claimed[:3]])
    await client.aclose()
    total = per_attempt * attempts
    assert writer.written == total, (writer.written, total)
    assert stored == 3 * per_attempt
    return {
        "spans_per_s": round(total / elapsed, 1),
        "span_cpu_us_per_span": round(1e6 * cpu / total, 1),
        "spans": total,
    }


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=5000, help="rollouts through the runner")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--spans", type=int, default=100_000, help="spans emitted by the span-only process")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis", port=None) as server:
        assert server.process is not None
        figures = await bench_runner(server.url, server.process.pid, args.n, args.concurrency, Path(tmp))
        log("runner: %s", figures)
        spans = await bench_spans(server.url, args.spans, 64)
        log("spans: %s", spans)
    print(json.dumps({**figures, **spans, "cpus": os.cpu_count()}))


if __name__ == "__main__":
    asyncio.run(main())
