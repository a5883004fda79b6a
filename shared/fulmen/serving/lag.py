"""What the model servers serve (`served_by`, for `fulmen status`) and how far they are behind the
trainer: the lag that makes ``--staleness 0`` on-policy.

Who counts as serving, and the lag's unit: docs/design/model-versions.md.
"""

from __future__ import annotations

from typing import Any

from fulmen.store import RedisStore
from fulmen.telemetry.steps import latest_summary
from fulmen.versions.model_version import ModelVersion

__all__ = ["served_by", "serving_lag"]

SELF_LOADING_BACKENDS = ("torch",)  # proxies that load versions themselves (the others forward upstream)


async def served_by(store: RedisStore) -> list[dict[str, Any]]:
    """Each live proxy and each vLLM replica with the model version it serves now: a replica's is
    the version vllm-sync verified, a LoRA adapter's included (``lora_adapter``), with why it is not
    ready when it is not."""
    rows: list[dict[str, Any]] = [
        {"server": p.base_url, "kind": f"llm-proxy ({p.metadata.get('backend', '?')})",
         "model_version": p.model_version or "-", "lora_adapter": False, "ready": True, "reason": ""}
        for p in await store.registry.query_proxies()
    ]  # fmt: skip
    for r in sorted((await store.registry.query_replicas()).values(), key=lambda r: r.url):
        rows.append({"server": r.url, "kind": "vllm", "model_version": r.model_version,
                     "lora_adapter": bool(r.served_model), "ready": r.ready, "reason": r.reason})
    return rows


async def serving_lag(store: RedisStore) -> int:
    """Versions between the trainer's newest and the oldest one served (0 if nothing reports one)."""
    summary = await latest_summary(store.redis, store.keys)
    if summary is None:
        return 0
    newest = ModelVersion.parse(summary.model_version).number
    served = [ModelVersion.parse(p.model_version).number for p in await store.registry.query_proxies()
              if p.metadata.get("backend") in SELF_LOADING_BACKENDS]
    served += [ModelVersion.parse(r.model_version).number for r in (await store.registry.query_replicas()).values() if r.ready]
    return max(0, newest - min(served)) if served else 0
