"""Validation: a greedy pass over held-out tasks as val-mode rollouts through the normal pipeline.

Run as an rq job (`validation_job`) or directly (`fulmen eval`); its resources entry names no model
version. Why: docs/design/algorithm.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from fulmen.errors import NotFound
from fulmen.records import ResourcesUpdate, RolloutConfig
from fulmen.records.status import Priority, RolloutMode, RolloutStatus
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen.versions.model_version import POLICY_RESOURCES_ID
from fulmen_algorithm.dataset import Task, load_tasks, task_id
from fulmen_algorithm.scheduler import recoverable_rollout_config

if TYPE_CHECKING:
    from rq import Queue

RESOURCES_ID = "validation"
log = logging.getLogger(__name__)


async def _greedy_resources(store: RedisStore, policy_id: str) -> ResourcesUpdate:
    policy = await store.resources.get_resources(policy_id)
    llm = dict(policy.resources.get("llm") or {})
    greedy = {
        "llm": {
            "kind": "llm",
            "model": llm.get("model", ""),
            "sampling_parameters": {**(llm.get("sampling_parameters") or {}), "temperature": 0.0},
        }
    }
    try:
        return await store.resources.update_resources(RESOURCES_ID, greedy)
    except NotFound:
        return await store.resources.add_resources(greedy, resources_id=RESOURCES_ID)


async def _served_by(store: RedisStore, rollout_id: str) -> str | None:
    """The model version that answered the latest attempt's last LLM call."""
    version = None
    for s in await store.spans.query_spans(rollout_id, "latest"):
        if s.attributes.get(semconv.SPAN_KIND) == semconv.KIND_LLM_CALL:
            version = s.attributes.get(semconv.MODEL_VERSION)
    return version


async def validate(
    store: RedisStore, tasks: list[Task], *, label: str, step: int | None = None, policy_id: str = POLICY_RESOURCES_ID,
    timeout_s: float = 600.0, config: RolloutConfig | None = None,
) -> dict[str, Any]:
    """Run every task once, greedily; record and return mean reward and accuracy (reward ≥ 1).
    ``config``: the rollouts' retry policy (default: retried when their runner dies, so a pass does
    not wait out ``timeout_s`` on attempts nobody runs any more)."""
    started = time.monotonic()
    await _greedy_resources(store, policy_id)
    config = config or recoverable_rollout_config()
    rollouts = [
        store.rollouts.new_rollout(t, rollout_id=f"val-{label}-{task_id(t)}", mode=RolloutMode.VAL, resources_id=RESOURCES_ID,
                          config=config, priority=Priority.URGENT)  # a training step waits on its result
        for t in tasks
    ]
    await store.rollouts.enqueue_rollouts(rollouts)  # idempotent: a retried job does not run a task twice
    ids = [r.rollout_id for r in rollouts]
    finished = await store.finished.wait_for_rollouts(ids, timeout_s=timeout_s)
    results = []
    versions: Counter[str] = Counter()
    for r in finished:
        succeeded = r.status is RolloutStatus.SUCCEEDED
        version = await _served_by(store, r.rollout_id) if succeeded else None
        results.append(r.reward if succeeded and r.reward is not None else 0.0)  # stored by the runner
        versions[version or "none"] += 1
    result = {
        "label": label,
        "step": step,
        "tasks": len(tasks),
        "finished": len(finished),
        "mean_reward": sum(results) / len(tasks) if tasks else 0.0,  # unfinished tasks count as 0
        "accuracy": sum(1 for x in results if x >= 1.0) / len(tasks) if tasks else 0.0,
        "served_by": dict(versions),
        "seconds": round(time.monotonic() - started, 1),
        "time": time.time(),
    }
    await store.redis.xadd(store.keys.validations, {"m": json.dumps(result)})
    return result


async def recorded(store: RedisStore) -> list[dict[str, Any]]:
    """The validation results in the order they were recorded, one per label: a pass run twice (a
    job requeued by `requeue_abandoned` while its first run was still alive) counts once."""
    results: dict[str, dict[str, Any]] = {}
    for _, f in await store.redis.xrange(store.keys.validations):
        result = json.loads(f[b"m"])
        results.setdefault(result["label"], result)
    return list(results.values())


def requeue_abandoned(queue: Queue) -> list[str]:
    """Put back on the queue the validation jobs an evaluator left started when it died (SIGKILL,
    OOM, a lost node); call it when an evaluator starts. Returns their ids.

    rq itself would find such a job only after the job's timeout plus 60 s and its maintenance
    interval (over 20 minutes with ours), then fail it: that point of the curve would be lost. Running
    a job twice (if the one that started it is in fact alive) is harmless: its rollouts have fixed
    ids, so enqueuing them again adds nothing, and `recorded` keeps one result per label."""
    registry = queue.started_job_registry
    requeued = []
    for entry in queue.connection.zrange(registry.key, 0, -1):  # rq 2+: "<job id>:<execution id>"
        job_id = registry.parse_job_id(entry)
        job = queue.fetch_job(job_id)
        queue.connection.zrem(registry.key, entry)
        if job is not None:
            queue.enqueue_job(job)
            requeued.append(job_id)
    if requeued:
        log.warning("requeued validation jobs an evaluator left unfinished: %s", requeued)
    return requeued


def reached_target(passes: list[dict[str, Any]], target: float, in_a_row: int = 2) -> bool:
    """True when the last ``in_a_row`` periodic passes after the start (labels v1, v2, …) all reach
    ``target``: one pass of a few hundred questions can touch it by luck while the policy still swings."""
    periodic = [p["accuracy"] for p in passes if p["label"].startswith("v") and p["label"] != "v0"]
    return len(periodic) >= in_a_row and min(periodic[-in_a_row:]) >= target


def validation_job(
    experiment: str, val_data: str, label: str, timeout_s: float = 600.0, step: int | None = None,
    split: str | None = None, columns: str | None = None,
) -> dict[str, Any]:
    """The rq job (JSON in, JSON out): connects from the environment, like every service. ``split`` and
    ``columns``: how to read ``val_data`` when it is a dataset (`fulmen_algorithm.dataset.load_tasks`)."""
    from fulmen.settings import EvaluatorSettings, load_settings
    from fulmen.store.redis.connection import connect

    async def main() -> dict[str, Any]:
        settings = load_settings(EvaluatorSettings, experiment=experiment)
        client = await connect(settings)
        try:
            store = RedisStore(client, experiment, max_record_bytes=settings.max_record_bytes)
            config = recoverable_rollout_config(settings.rollout_unresponsive_s, settings.rollout_max_attempts)
            tasks = load_tasks(val_data, split, columns)
            return await validate(store, tasks, label=label, step=step, timeout_s=timeout_s, config=config)
        finally:
            await client.aclose()

    return asyncio.run(main())
