"""Benchmark: the torch backend batches concurrent calls, and streaming answers early.

Builds the tiny model (`fulmen.demo.tiny_model`) in a temporary folder, starts the embedded Redis and
`fulmen llm-proxy --backend torch` as a real process, then measures through the proxy's HTTP API:

- throughput (completion tokens/s and requests/s) at concurrency 1 and 16, non-streaming chat calls
  with the same length (``max_tokens``, and a seeded sampler so no call stops early by chance
  more than another);
- for streaming calls at concurrency 1: the time to the first chunk against the time to the last.

    python bench/proxy_batching.py [--max-tokens 64] [--seconds 8]

Progress goes to stderr; the figures are ONE JSON object on the last line of stdout, with
``speedup_c16`` (tokens/s at 16 over tokens/s at 1; the issue asks >= 4) and
``first_chunk_fraction`` (first chunk time over full time; the issue asks < 0.5).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.store.redis.embedded import EmbeddedRedis, free_port


def log(message: str, *args: Any) -> None:
    print(f"[proxy_batching] {message % args}", file=sys.stderr, flush=True)


def body(i: int, max_tokens: int, stream: bool = False) -> dict[str, Any]:
    return {
        "model": "tiny",
        "messages": [{"role": "user", "content": f"Task {i}: add 12 and 7, then explain."}],
        "max_tokens": max_tokens,
        "temperature": 1.0,
        "seed": i,
        "stream": stream,
        "stop_token_ids": [],
    }


async def throughput(
    client: httpx.AsyncClient, concurrency: int, seconds: float, max_tokens: int
) -> dict[str, float]:
    deadline = time.perf_counter() + seconds
    tokens = requests = 0

    async def worker(w: int) -> None:
        nonlocal tokens, requests
        i = w
        while time.perf_counter() < deadline:
            response = await client.post("/v1/chat/completions", json=body(i, max_tokens))
            response.raise_for_status()
            tokens += response.json()["usage"]["completion_tokens"]
            requests += 1
            i += concurrency

    started = time.perf_counter()
    await asyncio.gather(*(worker(w) for w in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {"tokens_per_s": tokens / elapsed, "requests_per_s": requests / elapsed, "requests": requests}


async def streaming(client: httpx.AsyncClient, n: int, max_tokens: int) -> dict[str, float]:
    fractions, firsts, totals = [], [], []
    for i in range(n):
        started = time.perf_counter()
        first = None
        async with client.stream("POST", "/v1/chat/completions", json=body(i, max_tokens, stream=True)) as r:
            async for line in r.aiter_lines():
                if line.startswith("data:") and first is None:
                    first = time.perf_counter() - started
        total = time.perf_counter() - started
        assert first is not None
        firsts.append(first)
        totals.append(total)
        fractions.append(first / total)
    return {
        "first_chunk_ms": statistics.median(firsts) * 1000,
        "full_stream_ms": statistics.median(totals) * 1000,
        "first_chunk_fraction": statistics.median(fractions),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0, help="duration of each throughput phase")
    parser.add_argument("--concurrency", type=int, default=16)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis", port=None) as redis_server:
        model_dir = build_tiny_model(Path(tmp) / "tiny")
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("FULMEN_")}
        env.update(REDIS_URL=redis_server.url, FULMEN_EXPERIMENT="bench-batching")
        proxy = subprocess.Popen(
            [
                sys.executable, "-c", "from fulmen.cli.main import main; main()", "llm-proxy", "--backend", "torch",
                "--model-dir", str(model_dir), "--port", str(port), "--max-batch", str(args.concurrency),
                "--log-level", "WARNING",
            ],
            env=env,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1).status == 200:
                        break
                except OSError:
                    pass
                if proxy.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the proxy did not start")
                time.sleep(0.2)

            async def run() -> dict[str, Any]:
                limits = httpx.Limits(max_connections=args.concurrency + 4)
                async with httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{port}", timeout=120, limits=limits
                ) as client:
                    await throughput(client, 2, 1.0, args.max_tokens)  # warm-up
                    c1 = await throughput(client, 1, args.seconds, args.max_tokens)
                    log("c1: %.1f tokens/s", c1["tokens_per_s"])
                    cn = await throughput(client, args.concurrency, args.seconds, args.max_tokens)
                    log("c%d: %.1f tokens/s", args.concurrency, cn["tokens_per_s"])
                    stream = await streaming(client, 10, args.max_tokens)
                return {
                    "tokens_per_s_c1": c1["tokens_per_s"],
                    "requests_per_s_c1": c1["requests_per_s"],
                    f"tokens_per_s_c{args.concurrency}": cn["tokens_per_s"],
                    f"requests_per_s_c{args.concurrency}": cn["requests_per_s"],
                    f"speedup_c{args.concurrency}": cn["tokens_per_s"] / c1["tokens_per_s"],
                    **stream,
                }

            figures = asyncio.run(run())
        finally:
            proxy.terminate()
            proxy.wait(10)
    figures = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures.items()}
    print(json.dumps({"bench": "proxy_batching", "max_tokens": args.max_tokens, **figures,
                      "cpus": os.cpu_count(), "python": platform.python_version()}))  # fmt: skip


if __name__ == "__main__":
    main()
