"""Benchmark: rollouts/s through one `fulmen adapter` process (the console script, as honcho runs it).

The store is first filled with ``--n`` succeeded rollouts, each an 8-span trace as the runner and the
proxy write it: the attempt's root span, 2 LLM calls of 512 prompt + 128 response token ids (with
log-probabilities, the request messages and the response as JSON), a tool operation, 3 messages and
the reward. Then one adapter process turns them into samples. Timed from the first sample on the
samples stream until every rollout is adapted; the adapter's CPU time comes from /proc.

Runs against the embedded Redis (AOF on, fsync every second) in a temporary folder.

    python bench/adapter_throughput.py [--n 20000]

Progress goes to stderr; the figures are ONE JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis

from fulmen import tokens
from fulmen.records import Span
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.telemetry import semconv

EXPERIMENT = "bench-adapter"


def log(message: str, *args: Any) -> None:
    print(f"[adapter_throughput] {message % args}", file=sys.stderr, flush=True)


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(stolen, total) CPU ticks of the whole machine since boot, from /proc/stat: "steal" is time the
    hypervisor ran another guest while this VM had work, the noise a shared VM adds to a benchmark."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[7], sum(fields[:8])


def run_delay_s(pid: int) -> float:
    """Time the process was runnable but waiting for a CPU (another process had it), from the scheduler."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9


def trace(rollout_id: str, attempt_id: str, rng: random.Random) -> list[Span]:
    """8 spans: root, 2 LLM calls (512 + 128 token ids each), a tool operation, 3 messages, the reward."""
    t = 1_700_000_000.0
    root = Span(rollout_id, attempt_id, "r000000000000000", semconv.ROLLOUT_SPAN, "a" * 32, None, t, t + 9,
                attributes={semconv.SPAN_KIND: semconv.KIND_ROLLOUT})
    spans = [root]
    for turn in range(2):
        prompt = [rng.randrange(32000) for _ in range(512)]
        response = [rng.randrange(32000) for _ in range(128)]
        messages = [{"role": "system", "content": "You are a careful solver. " * 8},
                    {"role": "user", "content": "Compute the following expression step by step. " * 12}]
        spans.append(Span(rollout_id, attempt_id, f"c{turn:015d}", "chat policy", "a" * 32, root.span_id,
                          t + 1 + 3 * turn, t + 2 + 3 * turn, attributes={
            semconv.SPAN_KIND: semconv.KIND_LLM_CALL,
            semconv.GEN_AI_OPERATION: "chat",
            semconv.GEN_AI_REQUEST_MODEL: "policy",
            semconv.GEN_AI_RESPONSE_ID: f"chatcmpl-{rollout_id}-{turn}",
            semconv.GEN_AI_INPUT_TOKENS: 512,
            semconv.GEN_AI_OUTPUT_TOKENS: 128,
            semconv.PROMPT_TOKEN_IDS: tokens.pack_ids(prompt),  # packed, as the proxy writes them
            semconv.RESPONSE_TOKEN_IDS: tokens.pack_ids(response),
            semconv.RESPONSE_LOGPROBS: tokens.pack_floats([-rng.random() for _ in range(128)]),
            semconv.MODEL_VERSION: "v7",
            semconv.TOKEN_FIDELITY: "exact",
            semconv.REQUEST_JSON: json.dumps({"model": "policy", "messages": messages}),
            semconv.RESPONSE_JSON: json.dumps({"role": "assistant", "content": "The answer is 42. " * 6}),
        }))
    spans.append(Span(rollout_id, attempt_id, "o000000000000000", "calculator", "a" * 32, root.span_id, t + 2.5,
                      t + 2.6, attributes={semconv.SPAN_KIND: semconv.KIND_OPERATION,
                                           semconv.OPERATION_INPUT: '{"args": ["6*7"]}',
                                           semconv.OPERATION_OUTPUT: "42"}))
    for i in range(3):
        spans.append(Span(rollout_id, attempt_id, f"m{i:015d}", semconv.MESSAGE_SPAN, "a" * 32, root.span_id,
                          t + 7 + i * 0.1, t + 7 + i * 0.1,
                          attributes={semconv.SPAN_KIND: semconv.KIND_MESSAGE, semconv.MESSAGE: "checked"}))
    spans.append(Span(rollout_id, attempt_id, "w000000000000000", semconv.REWARD_SPAN, "a" * 32, root.span_id,
                      t + 8, t + 8, attributes={semconv.SPAN_KIND: semconv.KIND_REWARD, semconv.REWARD: 1.0}))
    return spans


async def fill(store: RedisStore, n: int) -> None:
    rng = random.Random(0)
    done = 0

    async def one(i: int) -> None:
        claimed = await store.rollouts.start_rollout({"task": i}, "bench-runner", metadata={"group_key": f"g{i // 8}"})
        rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
        await store.spans.add_spans(trace(rid, aid, rng))
        await store.rollouts.update_attempt(rid, aid, status="succeeded")

    for start in range(0, n, 100):
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + 100))))
        done = min(n, start + 100)
        if done % 5000 == 0:
            log("filled %d/%d rollouts", done, n)


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=20_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis", port=None) as server:
        client = aioredis.from_url(server.url)
        store = RedisStore(client, EXPERIMENT)
        await fill(store, args.n)
        span_bytes = sum(len(v) for _, f in await client.xrange(store.keys.spans((await store.rollouts.query_rollouts(limit=1))[0].rollout_id)) for v in f.values())
        log("store filled: %d rollouts, %d bytes of spans each; starting `fulmen adapter`", args.n, span_bytes)
        env = {**os.environ, "REDIS_URL": server.url, "FULMEN_EXPERIMENT": EXPERIMENT, "FULMEN_LOG_LEVEL": "WARNING"}
        fulmen_bin = shutil.which("fulmen") or str(Path(sys.executable).with_name("fulmen"))
        proc = subprocess.Popen([fulmen_bin, "adapter"], env=env)
        assert server.process is not None
        try:
            first = None
            cpu0 = redis0 = delay0 = 0.0
            while True:
                stats = await store.samples.adapter_stats()
                adapted = stats.get("rollouts", 0)
                if first is None and adapted:
                    first, cpu0, redis0 = time.perf_counter(), cpu_s(proc.pid), cpu_s(server.process.pid)
                    delay0, ticks0 = run_delay_s(proc.pid), machine_ticks()
                    start_count = adapted
                if adapted >= args.n:
                    break
                if proc.poll() is not None:
                    raise SystemExit(f"the adapter exited with {proc.returncode}")
                await asyncio.sleep(0.02)
            elapsed = time.perf_counter() - (first or time.perf_counter())
            adapter_cpu = cpu_s(proc.pid) - cpu0
            redis_cpu = cpu_s(server.process.pid) - redis0
            adapter_delay = run_delay_s(proc.pid) - delay0
            stolen, total = (b - a for a, b in zip(ticks0, machine_ticks(), strict=True))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=15)
        counted = args.n - start_count
        samples = stats.get("samples", 0)
        figures = {
            "rollouts_per_s": round(counted / elapsed, 1),
            "samples_per_s": round(samples * counted / args.n / elapsed, 1),
            "adapter_cpu_us_per_rollout": round(1e6 * adapter_cpu / counted, 1),
            "adapter_cpu_cores": round(adapter_cpu / elapsed, 2),
            "redis_cpu_cores": round(redis_cpu / elapsed, 2),
            "redis_cpu_us_per_rollout": round(1e6 * redis_cpu / counted, 1),
            # the share of the run the adapter was ready to work but another process had the CPU: on a
            # shared machine this, not the adapter, is what rollouts_per_s then measures
            "adapter_waiting_for_cpu": round(adapter_delay / elapsed, 2),
            # the share of the machine's CPU time the hypervisor gave to other guests: runs with a high
            # figure measure the host's neighbours, not the adapter
            "cpu_steal": round(stolen / max(1, total), 3),
            "load_average_1m": round(os.getloadavg()[0], 2),  # other work on the machine
            "rollouts": args.n,
            "samples": samples,
            "skipped": stats.get("skipped", 0),
            "span_bytes_per_rollout": span_bytes,
        }
        await client.aclose()
    log("%s", figures)
    print(json.dumps(figures))


if __name__ == "__main__":
    asyncio.run(main())
