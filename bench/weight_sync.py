"""Benchmark: from publishing a model version to every replica serving it (issue 16). Into a real vLLM
server (the Redis, folder and weight-group paths): bench/vllm_weight_sync.py.

For the tiny model (two proxies' torch backends) and a randomly initialised model with
Qwen2.5-0.5B's dimensions saved in bf16 (one torch backend: its fp32 copy alone is 2 GB), each
version is published the way the trainer publishes it (`fulmen.versions.model_version.publish_model_version`)
into an embedded Redis (the demo's: append-only file on), while `ModelFollower`s — the proxy's own
follower, subscribed to the resources log — load it into `TorchBackend`s. The clock runs from the
call to publish until every backend reports the version (polled every 2 ms): serialising, hashing,
writing, announcing, fetching, checking the sha256, and the swap between batches.

Formats and transports, each in the trained dtype (bf16):

- ``full_redis``: the whole model as 4 MB chunks on a Redis stream (the default transport);
- ``full_folder``: the whole model as one file in a shared folder (``weights_dir``);
- ``delta_redis``: a delta against the version before (`fulmen.versions.delta`) after an update of
  an RL-sized learning rate (every weight moved by 1e-5 x a standard normal in fp32, then rounded);
- ``full_redis_weights_db``: ``full_redis`` again through the opt-in weights-only Redis
  (FULMEN_WEIGHTS_REDIS_URL: a second embedded server, AOF off). Since session 12 the chunks stay out
  of the main server's AOF too (`fulmen.versions.blobs`; FULMEN_WEIGHTS_IN_AOF=1 puts them back), so
  the two should be alike; before, each 1 GB version was written to the AOF again;
- ``lora``: a LoRA adapter of rank 16 on every linear layer (PEFT layout), on fresh replicas of an
  experiment of its own, as in a LoRA run (only adapters are published: the backend runs each beside
  the base weights; after a full version it would merge it instead).

Each is timed ``--repeats`` times (median; the first LoRA load, which reads the base weights once,
is reported apart). ``memcpy_s`` copies the full version's bytes once in memory on this machine (the
floor any transport pays at least once). Then ``--versions`` tiny-model versions are published with
``keep_versions=3`` (retention as the trainer runs it) while a proxy follows, and Redis's
``used_memory`` is read before and after: ``redis_used_mb_after_300_versions``.

    python bench/weight_sync.py            # tiny + 0.5B, 3 repeats, 300 versions (~6 min)
    python bench/weight_sync.py --quick    # tiny model only, 1 repeat, 50 versions (~1 min)

Progress goes to stderr; the figures are ONE JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from aof_probe import AofProbe

QWEN25_05B = {
    "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
    "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True, "max_position_embeddings": 4096,
}
LORA_RANK, LORA_ALPHA = 16, 32.0
LINEAR = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
          "mlp.up_proj", "mlp.down_proj")
TARGETS = {"lora_publish_to_serving_s": 0.5, "full_folder_publish_to_serving_s": 3.0,
           "full_redis_publish_to_serving_s": 6.0}
POLL_S = 0.002


def log(message: str, *args: Any) -> None:
    print(f"[weight_sync] {message % args}", file=sys.stderr, flush=True)


def build_qwen(folder: Path) -> Path:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**QWEN25_05B)).to(torch.bfloat16).save_pretrained(folder)
    return folder


def folder_state(folder: Path) -> dict[str, Any]:
    import torch

    from fulmen.versions.folder import base_weights

    return {n: t.to(torch.bfloat16) for n, t in base_weights(folder).items()}


def updated(state: dict[str, Any], lr: float, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {n: (t.float() + lr * torch.randn(t.shape, generator=g)).to(t.dtype) for n, t in state.items()}


def lora_adapter(state: dict[str, Any], layers: int, seed: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(seed)
    adapter = {}
    for i in range(layers):
        for module in LINEAR:
            name = f"model.layers.{i}.{module}"
            out_f, in_f = state[name + ".weight"].shape
            adapter[f"base_model.model.{name}.lora_A.weight"] = (0.01 * torch.randn(LORA_RANK, in_f, generator=g)).to(torch.bfloat16)
            adapter[f"base_model.model.{name}.lora_B.weight"] = (0.01 * torch.randn(out_f, LORA_RANK, generator=g)).to(torch.bfloat16)
    return adapter


def memcpy_s(nbytes: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(3):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return best


class Replicas:
    """Torch backends, each with the proxy's own follower running."""

    def __init__(self, store: Any, model_dir: Path, count: int, shared: Path | None = None) -> None:
        self.store, self.model_dir, self.count, self.shared = store, model_dir, count, shared
        self.backends: list[Any] = []
        self.tasks: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> Replicas:
        from fulmen_llm_proxy.backends.torch.backend import TorchBackend
        from fulmen_llm_proxy.following import ModelFollower

        for _ in range(self.count):
            backend = TorchBackend(self.model_dir)
            await backend.start()
            # a proxy with FULMEN_WEIGHTS_DIR set, as honcho's .env gives every process
            follower = ModelFollower(self.store, backend, lambda version, outcome: None, self.shared)
            self.backends.append(backend)
            self.tasks.append(asyncio.create_task(follower.run()))
        await asyncio.sleep(0.2)  # the followers are subscribed
        return self

    async def __aexit__(self, *exc: object) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for backend in self.backends:
            await backend.close()

    async def serving(self, version: str, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while any(b.model_version != version for b in self.backends):
            if time.monotonic() > deadline:
                raise RuntimeError(f"{version} not served after {timeout_s} s: {[b.model_version for b in self.backends]}")
            await asyncio.sleep(POLL_S)


def fsync_mb_per_s(path: Path, megabytes: int = 256) -> float:
    """How fast this disk takes data that must reach it (written and fsynced): what paces Redis's AOF."""
    block = os.urandom(4 << 20)
    started = time.perf_counter()
    with path.open("wb") as f:
        for _ in range(megabytes // 4):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    took = time.perf_counter() - started
    path.unlink()
    return megabytes * 1.048576 / took


async def timed(replicas: Replicas, version: str, publish: Callable[[], Awaitable[Any]],
                probes: list[dict[str, Any]] | None = None, probe_client: Any = None) -> tuple[float, int]:
    """Publish → every replica serving, in seconds, and the version's bytes. With ``probe_client``
    (a connection of its own to the main Redis), what its AOF did meanwhile goes to ``probes``."""
    from fulmen.versions.retention import retain_versions

    probe = AofProbe(probe_client) if probe_client is not None else contextlib.nullcontext()
    async with probe:
        started = time.perf_counter()
        update = await publish()
        await replicas.serving(version)
        took = time.perf_counter() - started
    if isinstance(probe, AofProbe) and probes is not None:
        probes.append(probe.summary())
        log("%s: %.2f s; the main Redis meanwhile: %s", version, took, probes[-1])
    await retain_versions(replicas.store, 2, replicas.shared)  # as the trainer does after each publish (not timed)
    weights = update.resources["llm"]["weights"]
    return took, int(weights["bytes"])


async def formats(store: Any, model_dir: Path, replicas_count: int, repeats: int, shared: Path, tag: str,
                  weights_db: Any = None, probe_client: Any = None) -> dict[str, Any]:
    """Publish → serving for each format on one model; {figure: value}. ``weights_db``: a client of a
    weights-only Redis without AOF, through which the full version goes once more
    (``full_redis_weights_db``). ``probe_client``: a connection of its own to the main Redis, to
    sample its AOF during every timed repeat (``<format>_aof``: one `AofProbe.summary` per repeat)."""
    from fulmen.versions.delta import encode_delta
    from fulmen.versions.lora import lora_description
    from fulmen.versions.manifest import DELTA, Manifest, describe_all
    from fulmen.versions.model_version import publish_model_version
    from fulmen.versions.transport.folder import FolderTransport

    state = folder_state(model_dir)
    layers = 1 + max(int(n.split(".")[2]) for n in state if n.startswith("model.layers."))
    out: dict[str, Any] = {}
    counter = iter(range(1, 10_000))
    probes: dict[str, list[dict[str, Any]]] = {}

    def name() -> str:
        return f"{tag}{next(counter)}"

    async with Replicas(store, model_dir, replicas_count, shared) as replicas:
        runs: dict[str, list[float]] = {"full_redis": [], "full_folder": [], "delta_redis": [], "lora": []}
        sizes: dict[str, int] = {}
        lora_first = None
        for repeat in range(repeats):
            current = updated(state, 1e-3, seed=100 + repeat)
            v = name()
            took, size = await timed(replicas, v, lambda v=v, s=current: publish_model_version(store, s, model="m", model_version=v), probes.setdefault("full_redis", []), probe_client)
            runs["full_redis"].append(took)
            sizes["full_redis"] = size
            log("%s full via Redis: %.2f s for %.1f MB", tag, took, size / 1e6)
            nxt = updated(current, 1e-5, seed=200 + repeat)
            delta = await asyncio.to_thread(encode_delta, current, nxt)
            manifest = Manifest(DELTA, v, await asyncio.to_thread(describe_all, nxt))
            base, v = v, name()
            took, size = await timed(replicas, v, lambda v=v, d=delta, m=manifest, b=base: publish_model_version(
                store, d, model="m", model_version=v, manifest=m, weights_format={"format": DELTA, "base_version": b}), probes.setdefault("delta_redis", []), probe_client)
            runs["delta_redis"].append(took)
            sizes["delta_redis"] = size
            log("%s delta via Redis: %.2f s for %.1f MB", tag, took, size / 1e6)
            v = name()
            took, size = await timed(replicas, v, lambda v=v, s=nxt: publish_model_version(
                store, s, model="m", model_version=v, transport=FolderTransport(shared)), probes.setdefault("full_folder", []), probe_client)
            runs["full_folder"].append(took)
            sizes["full_folder"] = size
            log("%s full via a shared folder: %.2f s for %.1f MB", tag, took, size / 1e6)
        if weights_db is not None:
            # the opt-in weights-only Redis (FULMEN_WEIGHTS_REDIS_URL), AOF off: the transport itself,
            # not paced by the main server's AOF fsync; the followers share this store, so they read there
            main_weights, store.weights_redis = store.weights_redis, weights_db
            runs["full_redis_weights_db"] = []
            try:
                for repeat in range(repeats):
                    v, current = name(), updated(state, 1e-3, seed=400 + repeat)
                    took, size = await timed(replicas, v, lambda v=v, s=current: publish_model_version(
                        store, s, model="m", model_version=v), probes.setdefault("full_redis_weights_db", []), probe_client)
                    runs["full_redis_weights_db"].append(took)
                    sizes["full_redis_weights_db"] = size
                    log("%s full via a weights-only Redis (AOF off): %.2f s for %.1f MB", tag, took, size / 1e6)
            finally:
                store.weights_redis = main_weights
    # A LoRA run publishes only adapters: fresh replicas on an experiment of their own serve the base,
    # then adapters (the torch backend runs an adapter beside the base weights; once a full version
    # replaced them it would merge instead, which following the versions above would have caused)
    from fulmen.store import RedisStore

    lora_store = RedisStore(store.redis, f"{store.experiment}-lora")
    await lora_store.queue.ensure()
    async with Replicas(lora_store, model_dir, replicas_count) as replicas:
        for repeat in range(repeats):
            adapter = lora_adapter(state, layers, seed=300 + repeat)
            fmt = {"format": "lora", "lora": lora_description(LORA_RANK, LORA_ALPHA)}
            for first in ((True, False) if repeat == 0 else (False,)):
                v = name()
                took, size = await timed(replicas, v, lambda v=v, a=adapter, fmt=fmt: publish_model_version(
                    lora_store, a, model="m", model_version=v, weights_format=fmt))
                if first:
                    lora_first = took
                else:
                    runs["lora"].append(took)
                sizes["lora"] = size
                log("%s LoRA r=%d%s: %.2f s for %.1f MB", tag, LORA_RANK, " (first)" if first else "", took, size / 1e6)
    for fmt_name, values in runs.items():
        out[f"{fmt_name}_publish_to_serving_s"] = round(statistics.median(values), 3)
        out[f"{fmt_name}_runs_s"] = [round(x, 3) for x in values]
        out[f"{fmt_name}_mb"] = round(sizes[fmt_name] / 1e6, 2)
        if probes.get(fmt_name):
            out[f"{fmt_name}_aof"] = probes[fmt_name]
    out["lora_first_load_s"] = round(lora_first or 0.0, 3)
    out["replicas"] = replicas_count
    out["memcpy_s"] = round(memcpy_s(sizes["full_redis"]), 3)
    return out


async def retention(store: Any, model_dir: Path, versions: int) -> dict[str, Any]:
    from fulmen.versions.model_version import publish_model_version
    from fulmen.versions.retention import retain_versions, stored_versions

    state = folder_state(model_dir)
    info = await store.redis.info("memory")
    before = info["used_memory"]
    peak = before
    async with Replicas(store, model_dir, 1) as replicas:
        for i in range(versions):
            v = f"r{i + 1}"
            await publish_model_version(store, updated(state, 1e-3, seed=i), model="m", model_version=v)
            await retain_versions(store, 3)
            peak = max(peak, (await store.redis.info("memory"))["used_memory"])
            if (i + 1) % 50 == 0:
                await replicas.serving(v)
                log("retention: %d versions published, Redis used %.1f MB", i + 1, peak / 1e6)
        await replicas.serving(f"r{versions}")
    after = (await store.redis.info("memory"))["used_memory"]
    one = (await store.resources.get_latest_resources()).resources["llm"]["weights"]["bytes"]
    return {"redis_used_mb_before_versions": round(before / 1e6, 2), f"redis_used_mb_after_{versions}_versions": round(after / 1e6, 2),
            "redis_used_mb_peak": round(peak / 1e6, 2), "tiny_version_mb": round(one / 1e6, 3),
            "versions_stored_after": len(await stored_versions(store)), "versions_published": versions}


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from fulmen.demo.tiny_model import build_tiny_model
    from fulmen.settings import CommonSettings
    from fulmen.store import RedisStore
    from fulmen.store.redis.connection import connect
    from fulmen.store.redis.embedded import EmbeddedRedis

    started = time.perf_counter()
    figures: dict[str, Any] = {"bench": "weight_sync"}
    with tempfile.TemporaryDirectory(prefix="fulmen-weight-sync-") as tmp_name:
        tmp = Path(tmp_name)
        tiny = build_tiny_model(tmp / "tiny")
        with EmbeddedRedis(tmp / "redis", port=None) as server:
            client = await connect(CommonSettings(redis_url=server.url), wait_s=30)
            store = RedisStore(client, "bench-sync")
            await store.queue.ensure()
            try:
                for key, value in (await formats(store, tiny, 2, args.repeats, tmp / "shared", "t")).items():
                    figures[f"tiny_{key}"] = value
                if not args.quick:
                    log("building a Qwen2.5-0.5B-shaped model (random weights, bf16)")
                    qwen = build_qwen(tmp / "qwen")
                    with EmbeddedRedis(tmp / "weights-redis", port=None) as weights_server:
                        weights_db = await connect(CommonSettings(redis_url=weights_server.url), wait_s=30)
                        await weights_db.config_set("appendonly", "no")
                        probe = await connect(CommonSettings(redis_url=server.url), wait_s=30)
                        try:
                            figures.update(await formats(store, qwen, 1, args.repeats, tmp / "shared", "q",
                                                         weights_db=weights_db, probe_client=probe))
                        finally:
                            await weights_db.aclose()
                            await probe.aclose()
                    figures["disk_fsync_mb_per_s"] = round(fsync_mb_per_s(tmp / "disk-probe"), 1)
                    figures["model_parameters"] = sum(t.numel() for t in folder_state(qwen).values())
                figures.update(await retention(RedisStore(client, "bench-retention"), tiny, args.versions))
            finally:
                await client.aclose()
    if not args.quick:
        figures["targets"] = {k: f"<= {v}" for k, v in TARGETS.items()}
        figures["met"] = {k: figures[k] <= v for k, v in TARGETS.items()}
    figures.update({"repeats": args.repeats, "quick": args.quick, "cpus": os.cpu_count(),
                    "elapsed_s": round(time.perf_counter() - started, 1), "python": sys.version.split()[0]})
    return figures


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="timed publishes per format (median)")
    parser.add_argument("--versions", type=int, default=300, help="tiny versions published for the retention figure")
    parser.add_argument("--quick", action="store_true", help="tiny model only, 1 repeat, 50 versions")
    ns = parser.parse_args()
    if ns.quick:
        ns.repeats, ns.versions = 1, min(ns.versions, 50)
    print(json.dumps(asyncio.run(main(ns))))
