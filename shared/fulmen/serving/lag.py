"""What the model servers serve (`served_by`, for `fulmen status`) and how far they are behind the
trainer: the lag that makes ``--staleness 0`` on-policy.

Who counts as serving, and the lag's unit: docs/design/model-versions.md.
"""

from __future__ import annotations

from typing import Any

from fulmen.store import RedisStore
from fulmen.telemetry.steps import decode_steps, latest_step
from fulmen.versions.model_version import ModelVersion

__all__ = ["VersionSteps", "served_by", "served_step", "serving_lag"]

SELF_LOADING_BACKENDS = ("torch",)  # proxies that load versions themselves (the others forward upstream)
STEPS_PAGE = 100  # step records per XREVRANGE while looking for the step of a version


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


async def _served_versions(store: RedisStore) -> list[ModelVersion]:
    """The versions that count as served: each live torch proxy's and each ready vLLM replica's."""
    served = [ModelVersion.parse(p.model_version) for p in await store.registry.query_proxies()
              if p.metadata.get("backend") in SELF_LOADING_BACKENDS]
    return served + [ModelVersion.parse(r.model_version) for r in (await store.registry.query_replicas()).values()
                     if r.ready]


class VersionSteps:
    """The trainer step whose weights each model version holds, read from the trainer's steps stream
    (each step's record names the version the trainer holds after it). A version found is kept: a
    name is never given to other weights."""

    def __init__(self) -> None:
        self._known: dict[str, int] = {}

    async def step_of(self, store: RedisStore, version: ModelVersion) -> int:
        """0 for the base weights (and a name that says no number); else the first step whose record
        names this version or a later one; the trainer's latest step while none does (the trainer
        publishes a step's version before it records the step, and a version published between steps
        holds the weights of the step before it)."""
        if version.number == 0:
            return 0
        if version.name in self._known:
            return self._known[version.name]
        first: int | None = None
        newest = "+"
        while entries := await store.redis.xrevrange(store.keys.trainer_steps, max=newest, count=STEPS_PAGE):
            for summary in decode_steps(entries):  # newest first
                if ModelVersion.parse(summary.model_version).number < version.number:
                    if first is None:  # no record names it yet: not kept, its step's record may be on its way
                        return summary.step
                    self._known[version.name] = first  # the record before the version's first
                    return first
                first = summary.step if first is None else min(first, summary.step)
            newest = "(" + entries[-1][0].decode()
        return first if first is not None else 0  # no step yet


async def served_step(store: RedisStore, steps: VersionSteps | None = None) -> int | None:
    """The trainer step whose weights the slowest server serves (the oldest version served), or None
    when no server reports a version (none registered, or only proxies that forward upstream)."""
    served = await _served_versions(store)
    if not served:
        return None
    return await (steps or VersionSteps()).step_of(store, min(served, key=lambda v: v.number))


async def serving_lag(store: RedisStore, steps: VersionSteps | None = None) -> int | None:
    """Trainer steps between the trainer's latest step and the weights the slowest server serves;
    None when no server reports a version (the lag is unknown)."""
    served = await served_step(store, steps)
    return None if served is None else max(0, await latest_step(store.redis, store.keys) - served)
