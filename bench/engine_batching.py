"""Benchmark: what batching buys the torch engine, and how early a stream's first token arrives.

On a tiny model (`fulmen.demo.tiny_model`, defaults, seed 0) in a temporary folder, closed-loop clients
(each sends its next request when the previous one returns) call `TorchEngine.generate` for
``--seconds`` each at concurrency 1 and 16. Every request is greedy, 32 tokens long (the prompts
are ones the seed-0 model continues past 32 tokens without eos), so both runs do the same work per
request. ``first_token_fraction``: one streamed 64-token request alone, time to its first token
divided by time to its last.

    python bench/engine_batching.py [--seconds 6] [--num-threads N]

The figures are ONE JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time

from fulmen.demo.tiny_model import build_tiny_model
from fulmen_llm_proxy.backends.torch.engine import SamplingParams, TorchEngine

PROMPTS = ["12+7=", "ab", "hello", "0123456789", "zz top", "Q: 3*4="]
PARAMS = SamplingParams(max_tokens=32, temperature=0)


async def closed_loop(
    engine: TorchEngine, prompts: list[list[int]], concurrency: int, seconds: float
) -> float:
    """Requests per second completed by ``concurrency`` clients in ``seconds``."""
    done = 0
    started = time.perf_counter()

    async def client(offset: int) -> None:
        nonlocal done
        i = offset
        while time.perf_counter() - started < seconds:
            g = await engine.generate(prompts[i % len(prompts)], PARAMS)
            assert len(g.token_ids) == PARAMS.max_tokens
            done += 1
            i += 1

    await asyncio.gather(*(client(c) for c in range(concurrency)))
    return done / (time.perf_counter() - started)


async def first_token_fraction(engine: TorchEngine, prompt: list[int]) -> float:
    started = time.perf_counter()
    arrivals = []
    params = SamplingParams(max_tokens=64, temperature=0)
    async with engine.stream(prompt, params) as s:
        async for _ in s:
            arrivals.append(time.perf_counter() - started)
    return arrivals[0] / arrivals[-1]


async def main(seconds: float, num_threads: int | None) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as folder:
        engine = TorchEngine(build_tiny_model(folder, seed=0), max_batch=16, num_threads=num_threads)
        await engine.start()
        prompts = [engine.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
        await closed_loop(engine, prompts, 4, 0.5)  # warm-up: allocator, kernels
        rps_c1 = await closed_loop(engine, prompts, 1, seconds)
        rps_c16 = await closed_loop(engine, prompts, 16, seconds)
        fraction = await first_token_fraction(engine, prompts[0])
        await engine.close()
    return {
        "engine_rps_c1": round(rps_c1, 2),
        "engine_rps_c16": round(rps_c16, 2),
        "engine_batch_speedup": round(rps_c16 / rps_c1, 2),
        "first_token_fraction": round(fraction, 4),
        "tokens_per_request": PARAMS.max_tokens,
        "num_threads": engine.num_threads,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=6.0, help="duration of each closed-loop run")
    parser.add_argument(
        "--num-threads", type=int, default=None, help="the engine thread's torch threads (default: cores - 1)"
    )
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.seconds, args.num_threads))))
