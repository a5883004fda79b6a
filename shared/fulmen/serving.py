"""How far the model servers are behind the trainer: the lag that makes ``--staleness 0`` on-policy.

The trainer's newest version is the one its latest step record names (`fulmen.train_steps`). What
is served is what every live torch-backend proxy reports (it loads versions itself) and what every
ready vLLM replica's vllm-sync reports (`fulmen.records.ReplicaState`); a replica that is loading or
failed takes no calls, so it does not count. The lag is in versions: with ``publish_every`` 1 (the
default) a version per trainer step, so the scheduler can subtract it from the trainer's step.
"""

from __future__ import annotations

from fulmen.model_versions import ModelVersion
from fulmen.store import RedisStore
from fulmen.train_steps import latest_summary

__all__ = ["serving_lag"]

SELF_LOADING_BACKENDS = ("torch",)  # proxies that load versions themselves (the others forward upstream)


async def serving_lag(store: RedisStore) -> int:
    """Versions between the trainer's newest and the oldest one served (0 if nothing reports one)."""
    summary = await latest_summary(store.redis, store.keys)
    if summary is None:
        return 0
    newest = ModelVersion.parse(summary.model_version).number
    served = [ModelVersion.parse(p.model_version).number for p in await store.query_proxies()
              if p.metadata.get("backend") in SELF_LOADING_BACKENDS]
    served += [ModelVersion.parse(r.model_version).number for r in (await store.query_replicas()).values() if r.ready]
    return max(0, newest - min(served)) if served else 0
