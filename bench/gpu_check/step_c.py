"""gpu_check step c: `fulmen trainer` under torchrun (one rank) with ``--parallel ddp`` and each gradient
codec, and with ``--parallel fsdp``, for three steps each on NCCL (a dry run: gloo on the CPU).

The real command on a redis-server of its own (the embedded one) fed with samples as the tests feed
it (tests/trainer/test_torchrun.py), on the tiny model: what is checked is that every codec's DDP
hook and FSDP run on the device's process group, not speed. The runs go side by side.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import emit, log, parse, step_env

from fulmen import keys as k
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import Sample
from fulmen.store import RedisStore
from fulmen.store.redis.connection import async_client
from fulmen.store.redis.embedded import EmbeddedRedis, free_port

STEPS = 3
RUNS = [("ddp", "none"), ("ddp", "bf16"), ("ddp", "topk"), ("ddp", "dgc"), ("ddp", "qsgd8"), ("fsdp", "none")]
RUN_TIMEOUT_S = 150


def samples(groups: int) -> list[Sample]:
    """Groups of 4 of different lengths (as tests/trainer/test_torchrun.py makes them)."""
    out = []
    for g in range(groups):
        for i in range(4):
            prompt = [1, 5 + g % 9, 9 + i, 12][: 2 + (i + g) % 3]
            response = [20 + (i + g) % 5, 21 + i, 22, 2][: 2 + i % 3]
            reward = float((i + g) % 2)
            out.append(Sample(f"g{g}-r{i}.1/t0", "triplet", f"g{g}-r{i}", f"g{g}-r{i}.1", f"g{g}", 0, prompt,
                              response, [-1.0] * len(response), [1] * len(response), reward, reward, "base",
                              group_size=4))
    return out


async def push_all(url: str, experiments: list[str]) -> None:
    client = async_client(url)
    try:
        for experiment in experiments:
            store = RedisStore(client, experiment)
            await store.samples.ensure_samples_group(k.TRAINERS_GROUP)
            for s in samples(2 * STEPS):
                await store.redis.xadd(store.keys.samples, {"m": s.to_wire()})
    finally:
        await client.aclose()


def one_run(parallel: str, codec: str, url: str, tiny: Path, work: Path, device: str) -> dict[str, Any]:
    name = f"{parallel}-{codec}"
    out = work / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = {**step_env(), "REDIS_URL": url, "FULMEN_EXPERIMENT": f"gc-{name}", "FULMEN_MODEL_DIR": str(tiny),
           "FULMEN_GROUPS_PER_STEP": "2", "FULMEN_CHECKPOINT_DIR": str(out / "ck"),
           "FULMEN_METRICS_FILE": str(out / "metrics.jsonl"), "FULMEN_TORCH_THREADS": "1",
           "FULMEN_LEARNING_RATE": "0.001", "FULMEN_DEVICE": device, "OMP_NUM_THREADS": "1",
           "FULMEN_DTYPE": "bfloat16" if device == "cuda" else "float32", "FULMEN_METRICS_PORT": "0"}
    fulmen = shutil.which("fulmen") or str(Path(sys.executable).with_name("fulmen"))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "1", "--master-port",
               str(free_port()), "--no-python", fulmen, "trainer", "--parallel", parallel, "--codec", codec,
               "--max-steps", str(STEPS)]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
        rc, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as e:
        rc, output = -9, f"timed out after {RUN_TIMEOUT_S} s\n{e.stdout or ''}{e.stderr or ''}"
    seconds = round(time.perf_counter() - started, 1)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()] \
        if (out / "metrics.jsonl").exists() else []
    steps = sum(1 for m in metrics if "loss/total" in m)
    ok = rc == 0 and steps >= STEPS
    result: dict[str, Any] = {"status": "ok" if ok else "failed", "s": seconds, "steps": steps}
    if metrics:
        last = metrics[-1]
        result.update({key: last[key] for key in ("comm/ratio", "comm/bytes", "loss/total") if key in last})
    if not ok:
        result["rc"] = rc
        result["error"] = "\n".join(line for line in output.splitlines() if line.strip())[-1500:]
    log("%s: %s in %.1f s (%d steps)", name, result["status"], seconds, steps)
    return result


def main() -> None:
    args = parse(__doc__ or "")
    tiny = build_tiny_model(args.work / "tiny")
    with EmbeddedRedis(args.work / "redis", port=free_port()) as redis:
        asyncio.run(push_all(redis.url, [f"gc-{p}-{c}" for p, c in RUNS]))
        with ThreadPoolExecutor(max_workers=3 if args.dry_run else len(RUNS)) as pool:
            futures = {f"{p}-{c}": pool.submit(one_run, p, c, redis.url, tiny, args.work, args.device)
                       for p, c in RUNS}
            runs = {name: f.result() for name, f in futures.items()}
    failed = [name for name, r in runs.items() if r["status"] != "ok"]
    emit({"backend": "gloo" if args.dry_run else "nccl", "runs": runs, "failed": failed,
          **({"error": f"failed: {', '.join(failed)}"} if failed else {})})


if __name__ == "__main__":
    main()
