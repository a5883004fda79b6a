"""Reward per model version: how each version does on the rollouts it served (rollback and A/B).

The adapter counts them with the samples; `rewards_by_version` reads them back as means. The
counters: docs/design/model-versions.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

PREFIX = "version:"
MICRO = 1_000_000


def version_reward_stats(mode: str, version: str, reward: float) -> dict[str, int]:
    """The counter increments for one rollout of ``mode`` served by ``version``."""
    base = f"{PREFIX}{mode}:{version}:"
    return {base + "rollouts": 1, base + "reward_u": round(reward * MICRO)}


def rewards_by_version(stats: Mapping[str, int]) -> dict[str, dict[str, dict[str, Any]]]:
    """{mode: {version: {"rollouts": n, "mean_reward": r}}} from the adapter's counters."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for key, value in stats.items():
        if not key.startswith(PREFIX) or not key.endswith(":rollouts") or value <= 0:
            continue
        mode, _, version = key[len(PREFIX) : -len(":rollouts")].partition(":")
        total = stats.get(f"{PREFIX}{mode}:{version}:reward_u", 0) / MICRO
        out.setdefault(mode, {})[version] = {"rollouts": value, "mean_reward": round(total / value, 4)}
    # modes in name order: a hash's order is the order its fields were first written (train or val
    # first, as rollouts happened to end; sorted in a restored experiment's), and `fulmen status --json`
    # must read the same for the same counters
    return {mode: out[mode] for mode in sorted(out)}


def is_version_counter(key: str) -> bool:
    return key.startswith(PREFIX)


async def version_report(store: Any, last: int = 10) -> dict[str, Any]:
    """What `fulmen status` shows of model versions: the one the policy names (and a rollback), the
    ones whose weights are stored, and the mean reward of the newest ``last`` versions per mode."""
    from fulmen.errors import NotFound
    from fulmen.versions.model_version import POLICY_RESOURCES_ID, ModelVersion, llm_resource
    from fulmen.versions.retention import stored_versions

    try:
        llm = llm_resource(await store.resources.get_resources(POLICY_RESOURCES_ID)) or {}
    except NotFound:
        llm = {}
    rewards = rewards_by_version(await store.samples.adapter_stats())
    newest = {mode: dict(sorted(by.items(), key=lambda kv: ModelVersion.parse(kv[0]).number)[-last:])
              for mode, by in rewards.items()}
    from fulmen.serving.ab import ab_of

    arm = ab_of(llm)
    return {"serving": llm.get("model_version"), "rollback": llm.get("rollback"),
            "ab": {"b": arm[0], "split": arm[2]} if arm else None,
            "stored": await stored_versions(store), "reward_by_version": newest}
