"""Where a full 0.5B version's publish → serving time goes, stage by stage (issue 16).

One embedded Redis (AOF on, as the demo runs it), a randomly initialised model with Qwen2.5-0.5B's
dimensions in bf16, and for each of ``--repeats`` versions, timed one after the other:

- ``publish``: `publish_model_version` into Redis chunks (trainer side), split into the manifest's
  hashes, the blob's serialisation, its sha256 and the chunk writes;
- ``fetch``: `fetch_version` (a proxy's follower and vllm-sync read it so), split into the chunk
  reads and the checks (`deserialize`);
- ``torch_load``: the torch backend's swap (its checks and ``load_state_dict``);
- ``vllm_folder``: what vllm-sync does before ``reload_weights``: the version as a Hugging Face folder
  under its sync folder, read from Redis (`materialize`, or the streaming writer where it exists).

Stages are timed by wrapping the functions that exist in the code under test (those missing are
left out), so the same script measures an older commit: run it with ``PYTHONPATH`` on that commit's
packages. ``--aof off`` runs the same with the server's AOF switched off. The figures are ONE JSON
line on stdout.

    python bench/weight_sync_stages.py --repeats 2 [--aof off]
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import inspect
import json
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from weight_sync import build_qwen, folder_state, memcpy_s, updated

WRAPPED = [  # (module, function): inner stages, summed per repeat
    ("fulmen.versions.manifest", "describe_all"),
    ("fulmen.versions.blobs", "serialize"),
    ("fulmen.versions.blobs", "blob_sha256"),
    ("fulmen.versions.blobs", "write_stream"),
    ("fulmen.versions.blobs", "read_stream"),
    ("fulmen.versions.blobs", "deserialize"),
    ("fulmen.versions.transport.stream", "read_stream"),
]
TIMES: dict[str, float] = defaultdict(float)


def wrap(module_name: str, name: str) -> None:
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        return
    fn = getattr(module, name, None)
    if fn is None:
        return
    if inspect.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                TIMES[name] += time.perf_counter() - started
        replacement: Any = timed_async
    else:
        @functools.wraps(fn)
        def timed_sync(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                TIMES[name] += time.perf_counter() - started
        replacement = timed_sync
    # every module that imported the function by name calls it through its own reference
    for other in list(sys.modules.values()):
        if (getattr(other, "__name__", "") or "").startswith("fulmen") and getattr(other, name, None) is fn:
            setattr(other, name, replacement)


async def vllm_folder(store: Any, version: str, llm: dict[str, Any], model_dir: Path, sync_dir: Path) -> Path:
    """The folder vllm-sync hands to reload_weights, the way the code under test builds it."""
    from fulmen_vllm_sync import materialize as mat

    if hasattr(mat, "materialize_full"):  # the published file as it is, checked while it arrives
        folder = await mat.materialize_full(store, version, llm["weights"], model_dir, sync_dir)
        assert folder is not None
        return folder
    from fulmen.versions.model_version import fetch_version

    found = await fetch_version(store, version, resource=llm)
    return await asyncio.to_thread(mat.materialize, version, found.state, llm["weights"], model_dir, sync_dir)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    from fulmen.settings import CommonSettings
    from fulmen.store import RedisStore
    from fulmen.store.redis.connection import connect
    from fulmen.store.redis.embedded import EmbeddedRedis
    from fulmen.versions.model_version import fetch_version, publish_model_version
    from fulmen.versions.retention import retain_versions
    from fulmen_llm_proxy.backends.torch.backend import TorchBackend

    for module_name, name in WRAPPED:
        wrap(module_name, name)
    rows: list[dict[str, float]] = []
    with tempfile.TemporaryDirectory(prefix="fulmen-stages-") as tmp_name:
        tmp = Path(tmp_name)
        qwen = args.model_dir or build_qwen(tmp / "qwen")
        state = folder_state(qwen)
        backend = TorchBackend(qwen)
        await backend.start()
        with EmbeddedRedis(tmp / "redis", port=None) as server:
            client = await connect(CommonSettings(redis_url=server.url), wait_s=30)
            store = RedisStore(client, "stages")
            await store.queue.ensure()
            if args.aof == "off":
                await client.config_set("appendonly", "no")
            try:
                for repeat in range(args.repeats):
                    current = updated(state, 1e-3, seed=100 + repeat)
                    version = f"v{repeat + 1}"
                    TIMES.clear()
                    row: dict[str, float] = {}
                    started = time.perf_counter()
                    update = await publish_model_version(store, current, model="m", model_version=version)
                    row["publish"] = time.perf_counter() - started
                    llm = update.resources["llm"]
                    del current
                    started = time.perf_counter()
                    found = await fetch_version(store, version, resource=llm)
                    row["fetch"] = time.perf_counter() - started
                    started = time.perf_counter()
                    await backend.load_weights(found.state, version, llm["weights"])
                    row["torch_load"] = time.perf_counter() - started
                    del found
                    started = time.perf_counter()
                    await vllm_folder(store, version, llm, qwen, tmp / "sync")
                    row["vllm_folder"] = time.perf_counter() - started
                    row.update({f"in_{k}": v for k, v in TIMES.items()})
                    rows.append(row)
                    print(f"[stages] {version}: " + ", ".join(f"{k} {v:.2f}" for k, v in row.items()),
                          file=sys.stderr, flush=True)
                    await retain_versions(store, 1)
            finally:
                await client.aclose()
        await backend.close()
    keys = sorted({k for row in rows for k in row})
    out: dict[str, Any] = {"bench": "weight_sync_stages", "aof": args.aof, "repeats": args.repeats}
    out.update({k: round(statistics.median(row.get(k, 0.0) for row in rows), 3) for k in keys})
    out["memcpy_s"] = round(memcpy_s(988 << 20), 3)
    out["code"] = str(Path(importlib.import_module("fulmen").__file__ or "").parent)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--aof", choices=("on", "off"), default="on")
    parser.add_argument("--model-dir", type=Path, help="a Qwen2.5-0.5B-shaped folder built before (bench.weight_sync.build_qwen)")
    print(json.dumps(asyncio.run(main(parser.parse_args()))))
