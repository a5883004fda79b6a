"""gpu_check step d: the proxy's torch backend (`TorchEngine`, in process) on the device with the
Qwen2.5-0.5B-shaped model: generated tokens/s at 1 and 32 concurrent requests, beside Hugging Face
``generate`` on the same model with the same prompts as one batch (the ratio engine / generate).

Greedy, the same number of new tokens for every request; random prompt ids of one length (no
padding for ``generate``); each side warmed up once before it is timed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import torch
from common import QWEN25_05B, TINY, chip, emit, log, parse, save_model_dir

from fulmen_llm_proxy.backends.torch.engine import SamplingParams, TorchEngine

CONCURRENCY = (1, 32)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


async def engine_tokens_per_s(engine: TorchEngine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    params = SamplingParams(max_tokens=new_tokens, temperature=0)
    started = time.perf_counter()
    done = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    seconds = time.perf_counter() - started
    tokens = sum(len(g.token_ids) for g in done)
    return tokens / seconds, tokens


def generate_tokens_per_s(model: Any, prompts: list[list[int]], new_tokens: int, device: str) -> float:
    ids = torch.tensor(prompts, device=device)
    knobs = {"max_new_tokens": new_tokens, "min_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}
    with torch.inference_mode():
        sync(device)
        started = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **knobs)
        sync(device)
    return (out.shape[1] - ids.shape[1]) * ids.shape[0] / (time.perf_counter() - started)


async def run(args: Any) -> dict[str, Any]:
    shape = TINY if args.dry_run else QWEN25_05B
    prompt_len, new_tokens = (16, 8) if args.dry_run else (128, 128)
    folder = save_model_dir(args.work / "d", shape, args.device)
    engine = TorchEngine(folder, max_batch=max(CONCURRENCY), device=args.device,
                         dtype="bfloat16" if args.device == "cuda" else None)
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, shape["vocab_size"], (max(CONCURRENCY), prompt_len), generator=generator).tolist()
    result: dict[str, Any] = {"chip": chip()[0], "prompt_tokens": prompt_len, "new_tokens": new_tokens}
    try:
        await engine_tokens_per_s(engine, prompts[:2], 4)  # warm-up
        for n in CONCURRENCY:
            rate, tokens = await engine_tokens_per_s(engine, prompts[:n], new_tokens)
            result[f"engine_tokens_per_s_c{n}"] = round(rate, 1)
            log("engine, %d concurrent: %.1f tokens/s (%d tokens)", n, rate, tokens)
    finally:
        await engine.close()
    model = engine.model
    generate_tokens_per_s(model, prompts[:2], 4, args.device)  # warm-up
    for n in CONCURRENCY:
        rate = generate_tokens_per_s(model, prompts[:n], new_tokens, args.device)
        result[f"generate_tokens_per_s_b{n}"] = round(rate, 1)
        result[f"engine_vs_generate_{n}"] = round(result[f"engine_tokens_per_s_c{n}"] / rate, 3)
        log("generate, batch %d: %.1f tokens/s", n, rate)
    if args.device == "cuda":
        result["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / (1 << 30), 2)
    return result


def main() -> None:
    args = parse(__doc__ or "")
    emit(asyncio.run(run(args)))


if __name__ == "__main__":
    main()
