"""Benchmark: what the LLM proxy adds on top of an upstream that answers at once.

Three processes besides this one: the embedded Redis (AOF on, as `fulmen.store.redis.embedded` runs it), a fast
fake upstream (`tests/fakes/fake_openai.py --vllm`: a raw asyncio server returning a canned
vLLM-style body with token ids and logprobs), and the proxy itself (`fulmen llm-proxy --backend
vllm`, a real process started as honcho would), which records every call as a span of a real
attempt in Redis before it answers, as in production. This process is the load generator: raw
keep-alive HTTP/1.1 connections on uvloop with httptools (a few tens of microseconds per request,
so it is not what is measured).

Phases, each after a warm-up: direct and through the proxy at concurrency 1 (sequential calls on one
connection), then at concurrency 64 (64 connections, each attributed to its own rollout attempt).
The same question as an Anthropic Messages call (``/v1/messages``) and as an OpenAI Responses call
(``/v1/responses``) is also sent through the proxy at concurrency 1: the proxy translates each into
the same chat call upstream, so ``added_p50_ms_messages`` and ``added_p50_ms_responses`` are their
p50 less the direct chat call's, as ``added_p50_ms_c1`` is.
The proxy's CPU time per request comes from /proc/<pid>/stat (user + system, every thread) over the
proxied phases; ``other_processes_cores_c64`` says how many cores other processes on the machine kept
busy during the proxied c64 phase (throughput figures are only comparable when it is near 0).

    python bench/proxy_overhead.py [--n-c1 3000] [--seconds-c64 6]

Progress goes to stderr; the figures are ONE JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import httptools
import redis.asyncio as aioredis

from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis, free_port

ROOT = Path(__file__).resolve().parent.parent
EXPERIMENT = "bench-proxy"
SYSTEM = "You are a helpful agent. Answer briefly."
QUESTION = "What is 12 + 7? Think step by step, then answer."
BODY = json.dumps(
    {
        "model": "fake-model",
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        "max_tokens": 32,
        "temperature": 1.0,
    }
).encode()
# the same call in the other APIs the proxy speaks (the upstream gets the chat body above)
MESSAGES_BODY = json.dumps(
    {"model": "fake-model", "system": SYSTEM, "messages": [{"role": "user", "content": QUESTION}],
     "max_tokens": 32, "temperature": 1.0}
).encode()  # fmt: skip
RESPONSES_BODY = json.dumps(
    {"model": "fake-model", "instructions": SYSTEM, "input": QUESTION, "max_output_tokens": 32, "temperature": 1.0}
).encode()
TICKS_S = os.sysconf("SC_CLK_TCK")


def log(message: str, *args: Any) -> None:
    print(f"[proxy_overhead] {message % args}", file=sys.stderr, flush=True)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all threads."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS_S


def machine_busy_s() -> float:
    """CPU seconds all processes spent busy (every core), from /proc/stat."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / TICKS_S


def request_bytes(path: str, body: bytes = BODY) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


class Connection(asyncio.Protocol):
    """One keep-alive client connection; one request at a time."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[int] | None = None
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        assert self.waiter is not None
        self.waiter.set_result(self.parser.get_status_code())

    def connection_lost(self, exc: Exception | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))

    async def request(self, payload: bytes) -> int:
        self.body = []
        self.waiter = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(payload)
        return await self.waiter


async def connect(port: int) -> Connection:
    _, protocol = await asyncio.get_running_loop().create_connection(Connection, "127.0.0.1", port)
    return protocol


async def run_c1(port: int, payload: bytes, n: int) -> list[float]:
    conn = await connect(port)
    latencies = []
    for _ in range(n):
        started = time.perf_counter()
        status = await conn.request(payload)
        latencies.append(time.perf_counter() - started)
        if status != 200:
            raise RuntimeError(f"status {status}: {b''.join(conn.body)[:300]!r}")
    assert conn.transport is not None
    conn.transport.close()
    return latencies


async def run_concurrent(port: int, payloads: list[bytes], seconds: float) -> tuple[list[float], float]:
    conns = [await connect(port) for _ in payloads]
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker(conn: Connection, payload: bytes) -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            status = await conn.request(payload)
            latencies.append(time.perf_counter() - started)
            if status != 200:
                raise RuntimeError(f"status {status}: {b''.join(conn.body)[:300]!r}")

    started = time.perf_counter()
    await asyncio.gather(*(worker(c, p) for c, p in zip(conns, payloads, strict=True)))
    elapsed = time.perf_counter() - started
    for conn in conns:
        assert conn.transport is not None
        conn.transport.close()
    return latencies, elapsed


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def wait_ready(url: str, process: subprocess.Popen[bytes], timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}")
        try:
            if urllib.request.urlopen(url, timeout=1).status == 200:
                return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not ready")


async def make_attempts(redis_url: str, n: int) -> list[tuple[str, str]]:
    client = aioredis.from_url(redis_url)
    store = RedisStore(client, EXPERIMENT)
    attempts = []
    for _ in range(n):
        started = await store.rollouts.start_rollout({"bench": True}, "bench-worker")
        attempts.append((started.rollout.rollout_id, started.attempt.attempt_id))
    await client.aclose()
    return attempts


async def count_spans(redis_url: str, attempts: list[tuple[str, str]]) -> int:
    client = aioredis.from_url(redis_url)
    store = RedisStore(client, EXPERIMENT)
    pipe = client.pipeline(transaction=False)
    for rollout_id, _ in attempts:
        pipe.xlen(store.keys.spans(rollout_id))
    total = sum(await pipe.execute())
    await client.aclose()
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-c1", type=int, default=3000, help="sequential requests per c1 phase")
    parser.add_argument("--seconds-c64", type=float, default=6.0, help="duration of each c64 phase")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument(
        "--profile", help="py-spy the proxy during the proxied c64 phase, collapsed stacks here"
    )
    args = parser.parse_args()

    import uvloop

    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis", port=None) as redis_server:
        upstream = subprocess.Popen(
            [sys.executable, str(ROOT / "tests/fakes/fake_openai.py"), "--vllm", "--port", "0"],
            stdout=subprocess.PIPE,
        )
        assert upstream.stdout is not None
        upstream_url = upstream.stdout.readline().decode().strip()
        upstream_port = int(upstream_url.rsplit(":", 1)[1])
        proxy_port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")}
        env.update(REDIS_URL=redis_server.url, FULMEN_EXPERIMENT=EXPERIMENT)
        proxy = subprocess.Popen(
            [
                sys.executable, "-c", "from fulmen.cli.main import main; main()", "llm-proxy",
                "--backend", "vllm", "--upstream-urls", upstream_url, "--port", str(proxy_port),
                "--log-level", "WARNING",
            ],
            env=env,
        )  # fmt: skip
        try:
            wait_ready(f"http://127.0.0.1:{proxy_port}/readyz", proxy)
            attempts = asyncio.run(make_attempts(redis_server.url, args.concurrency))
            log("upstream %s, proxy :%d, %d attempts", upstream_url, proxy_port, len(attempts))
            direct = request_bytes("/v1/chat/completions")
            proxied = [request_bytes(f"/rollout/{r}/attempt/{a}/v1/chat/completions") for r, a in attempts]
            results: dict[str, Any] = {}

            async def phases() -> None:
                # warm-up: connections, caches, the proxy's first Redis round trips
                await run_c1(upstream_port, direct, 300)
                await run_c1(proxy_port, proxied[0], 300)
                await run_concurrent(proxy_port, proxied, 1.0)

                lat = await run_c1(upstream_port, direct, args.n_c1)
                results["direct_p50_ms_c1"], results["direct_p99_ms_c1"] = pct(lat, 0.5), pct(lat, 0.99)
                results["direct_rps_c1"] = len(lat) / sum(lat)
                cpu0 = cpu_s(proxy.pid)
                lat = await run_c1(proxy_port, proxied[0], args.n_c1)
                results["proxy_cpu_ms_per_req_c1"] = (cpu_s(proxy.pid) - cpu0) / len(lat) * 1000
                results["proxy_p50_ms_c1"], results["proxy_p99_ms_c1"] = pct(lat, 0.5), pct(lat, 0.99)
                results["proxy_rps_c1"] = len(lat) / sum(lat)
                log(
                    "c1: direct p50 %.3f ms, proxy p50 %.3f ms",
                    results["direct_p50_ms_c1"],
                    results["proxy_p50_ms_c1"],
                )
                rollout, attempt = attempts[0]
                for api, body in (("messages", MESSAGES_BODY), ("responses", RESPONSES_BODY)):
                    payload = request_bytes(f"/rollout/{rollout}/attempt/{attempt}/v1/{api}", body)
                    await run_c1(proxy_port, payload, 300)
                    lat = await run_c1(proxy_port, payload, args.n_c1)
                    results[f"proxy_p50_ms_c1_{api}"] = pct(lat, 0.5)
                    log("c1 /v1/%s: proxy p50 %.3f ms", api, results[f"proxy_p50_ms_c1_{api}"])

                lat, elapsed = await run_concurrent(
                    upstream_port, [direct] * args.concurrency, args.seconds_c64
                )
                results["direct_rps_c64"] = len(lat) / elapsed
                results["direct_p50_ms_c64"], results["direct_p99_ms_c64"] = pct(lat, 0.5), pct(lat, 0.99)
                spy = None
                if args.profile:
                    spy = subprocess.Popen(
                        ["py-spy", "record", "-p", str(proxy.pid), "-o", args.profile, "--format", "raw",
                         "-d", str(int(args.seconds_c64)), "-r", "200", "--nonblocking"],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    )  # fmt: skip
                cpu0, up0, redis0 = cpu_s(proxy.pid), cpu_s(upstream.pid), cpu_s(redis_server.process.pid)
                own0, busy0 = time.process_time(), machine_busy_s()
                lat, elapsed = await run_concurrent(proxy_port, proxied, args.seconds_c64)
                ours = (
                    cpu_s(proxy.pid) - cpu0 + cpu_s(upstream.pid) - up0
                    + cpu_s(redis_server.process.pid) - redis0 + time.process_time() - own0
                )  # fmt: skip
                # Cores busy with other processes meanwhile: on a shared machine, throughput is only
                # comparable between runs where this is near 0.
                results["other_processes_cores_c64"] = max(0.0, (machine_busy_s() - busy0 - ours) / elapsed)
                results["proxy_cpu_ms_per_req"] = (cpu_s(proxy.pid) - cpu0) / len(lat) * 1000
                results["upstream_cpu_ms_per_req"] = (cpu_s(upstream.pid) - up0) / len(lat) * 1000
                results["redis_cpu_ms_per_req"] = (cpu_s(redis_server.process.pid) - redis0) / len(lat) * 1000
                results["loadgen_cpu_ms_per_req"] = (time.process_time() - own0) / len(lat) * 1000
                results["proxy_rps_c64"] = len(lat) / elapsed
                results["proxy_p50_ms_c64"], results["proxy_p99_ms_c64"] = pct(lat, 0.5), pct(lat, 0.99)
                results["proxied_requests_c64"] = len(lat)
                if spy is not None:
                    spy.wait(30)
                log(
                    "c64: direct %.0f req/s, proxy %.0f req/s",
                    results["direct_rps_c64"],
                    results["proxy_rps_c64"],
                )

            uvloop.run(phases())
            spans = asyncio.run(count_spans(redis_server.url, attempts))
        finally:
            proxy.terminate()
            proxy.wait(10)
            upstream.terminate()
            upstream.wait(10)

    added = {
        "added_p50_ms_c1": results["proxy_p50_ms_c1"] - results["direct_p50_ms_c1"],
        "added_p99_ms_c1": results["proxy_p99_ms_c1"] - results["direct_p99_ms_c1"],
        "added_p50_ms_messages": results["proxy_p50_ms_c1_messages"] - results["direct_p50_ms_c1"],
        "added_p50_ms_responses": results["proxy_p50_ms_c1_responses"] - results["direct_p50_ms_c1"],
        "added_p50_ms_c64": results["proxy_p50_ms_c64"] - results["direct_p50_ms_c64"],
        "added_p99_ms_c64": results["proxy_p99_ms_c64"] - results["direct_p99_ms_c64"],
    }
    figures = {"bench": "proxy_overhead", **added, **results, "spans_stored": spans}
    figures = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}
    figures.update(cpus=os.cpu_count(), python=platform.python_version())
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
