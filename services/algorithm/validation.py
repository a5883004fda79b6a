"""Validation: a pass over held-out tasks as val-mode rollouts through the normal pipeline.

One greedy sample per task, or k sampled ones scored as pass@k and maj@k (`fulmen_algorithm.pass_at_k`).
Run as an rq job (`validation_job`) or directly (`fulmen eval`); its resources entry names no model
version. Why: docs/design/algorithm.md; the scores: docs/guides/evaluation.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING, Any, NamedTuple

from fulmen.errors import NotFound
from fulmen.records import RolloutConfig
from fulmen.records.status import Priority, RolloutMode, RolloutStatus
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen.versions.model_version import POLICY_RESOURCES_ID
from fulmen_algorithm.dataset import Task, load_tasks, task_id
from fulmen_algorithm.pass_at_k import Sample, pass_scores
from fulmen_algorithm.scheduler import recoverable_rollout_config

if TYPE_CHECKING:
    from rq import Queue

    from fulmen.settings.services import ValidationSettings

RESOURCES_ID = "validation"  # the greedy passes' resources
SAMPLED_RESOURCES_ID = "validation-sampled"  # those of passes of k > 1 samples per task
# A pass of k > 1 samples with no temperature set and none in the policy's sampling parameters.
DEFAULT_SAMPLED_TEMPERATURE = 1.0
log = logging.getLogger(__name__)


class PassSampling(NamedTuple):
    """How a pass samples each task: ``samples`` rollouts (1: one, greedy) and, with more, the
    temperature (None: `sampled_temperature` decides)."""

    samples: int = 1
    temperature: float | None = None

    @classmethod
    def of(cls, settings: ValidationSettings) -> PassSampling:
        """The settings' val_samples and val_temperature."""
        return cls(settings.val_samples, settings.val_temperature)


GREEDY = PassSampling()


async def _pass_resources(store: RedisStore, policy_id: str, sampling: PassSampling) -> tuple[str, float]:
    """Publish the pass's resources (the policy's model; greedy for one sample per task, else sampled at
    `sampled_temperature`); their id and temperature."""
    policy = await store.resources.get_resources(policy_id)
    llm = dict(policy.resources.get("llm") or {})
    parameters = dict(llm.get("sampling_parameters") or {})
    if sampling.samples == 1:
        resources_id, parameters["temperature"] = RESOURCES_ID, 0.0
    else:
        resources_id = SAMPLED_RESOURCES_ID
        parameters.pop("seed", None)  # a fixed seed would give k copies of one sample
        parameters["temperature"] = sampled_temperature(parameters, sampling.temperature)
    entry = {"llm": {"kind": "llm", "model": llm.get("model", ""), "sampling_parameters": parameters}}
    try:
        await store.resources.update_resources(resources_id, entry)
    except NotFound:
        await store.resources.add_resources(entry, resources_id=resources_id)
    return resources_id, parameters["temperature"]


def sampled_temperature(policy_parameters: dict[str, Any], temperature: float | None) -> float:
    """A sampled pass's temperature: ``temperature`` (val_temperature) when set, else the policy's
    sampling temperature when it samples (> 0), else `DEFAULT_SAMPLED_TEMPERATURE`."""
    if temperature is not None:
        return temperature
    policy = policy_parameters.get("temperature")
    if isinstance(policy, int | float) and not isinstance(policy, bool) and policy > 0:
        return float(policy)
    return DEFAULT_SAMPLED_TEMPERATURE


async def _attempt_view(store: RedisStore, rollout_id: str) -> tuple[str | None, str | None]:
    """(model version, answer) of the latest attempt: the version that answered its last LLM call, and
    its answer: the last object it emitted with an "answer" key, else its last LLM response's text."""
    version = response = emitted = None
    for s in await store.spans.query_spans(rollout_id, "latest"):
        kind = s.attributes.get(semconv.SPAN_KIND)
        if kind == semconv.KIND_LLM_CALL:
            version = s.attributes.get(semconv.MODEL_VERSION)
            response = _response_text(s.attributes.get(semconv.RESPONSE_JSON))
        elif kind == semconv.KIND_OBJECT:
            emitted = _emitted_answer(s.attributes.get(semconv.OBJECT_JSON)) or emitted
    return version, emitted if emitted is not None else response


def _response_text(raw: Any) -> str | None:
    try:
        response = json.loads(raw) if isinstance(raw, str | bytes) else None
    except ValueError:
        return None
    if isinstance(response, dict):
        response = response.get("content", response.get("text"))
    return response.strip() if isinstance(response, str) else None


def _emitted_answer(raw: Any) -> str | None:
    try:
        obj = json.loads(raw) if isinstance(raw, str | bytes) else None
    except ValueError:
        return None
    if isinstance(obj, dict) and "answer" in obj and obj["answer"] is not None:
        answer = obj["answer"]
        return answer.strip() if isinstance(answer, str) else json.dumps(answer, sort_keys=True)
    return None


def _rollout_id(label: str, task: Task, sample: int, samples: int) -> str:
    """One sample per task keeps the id it always had; k samples add "-s<i>"."""
    base = f"val-{label}-{task_id(task)}"
    return base if samples == 1 else f"{base}-s{sample}"


async def validate(
    store: RedisStore, tasks: list[Task], *, label: str, step: int | None = None, policy_id: str = POLICY_RESOURCES_ID,
    timeout_s: float = 600.0, config: RolloutConfig | None = None, sampling: PassSampling = GREEDY,
) -> dict[str, Any]:
    """Run every task once greedily, or ``sampling.samples`` times sampled; record and return mean
    reward and accuracy (reward ≥ 1, per sample), and with k > 1 samples pass@j and maj@k
    (`pass_scores`). ``config``: the rollouts' retry policy (default: retried when their runner dies,
    so a pass does not wait out ``timeout_s`` on attempts nobody runs any more)."""
    started = time.monotonic()
    samples = sampling.samples
    of_task, sampled_at = await start_pass(store, tasks, label=label, policy_id=policy_id, config=config,
                                           sampling=sampling)
    finished = await store.finished.wait_for_rollouts(list(of_task), timeout_s=timeout_s)
    rewards = []
    versions: Counter[str] = Counter()
    per_task: list[list[Sample]] = [[] for _ in tasks]
    for r in finished:
        succeeded = r.status is RolloutStatus.SUCCEEDED
        version, answer = await _attempt_view(store, r.rollout_id) if succeeded else (None, None)
        reward = r.reward if succeeded and r.reward is not None else 0.0  # stored by the runner
        rewards.append(reward)
        versions[version or "none"] += 1
        per_task[of_task[r.rollout_id]].append(Sample(answer, reward >= 1.0))
    runs = len(tasks) * samples  # unfinished rollouts count as 0
    result: dict[str, Any] = {
        "label": label,
        "step": step,
        "tasks": len(tasks),
        "finished": len(finished),
        "mean_reward": sum(rewards) / runs if runs else 0.0,
        "accuracy": sum(1 for x in rewards if x >= 1.0) / runs if runs else 0.0,
        "served_by": dict(versions),
        "seconds": round(time.monotonic() - started, 1),
        "time": time.time(),
    }
    if samples > 1:
        result.update({"samples": samples, "temperature": sampled_at, **pass_scores(per_task, samples)})
    await store.validations.append(result)
    return result


async def start_pass(
    store: RedisStore, tasks: list[Task], *, label: str, policy_id: str = POLICY_RESOURCES_ID,
    config: RolloutConfig | None = None, sampling: PassSampling = GREEDY,
) -> tuple[dict[str, int], float]:
    """Publish the pass's resources and queue its rollouts, urgent (idempotent: their ids are fixed, so
    starting a pass again adds nothing); each rollout id mapped to its task's index, and the temperature
    the pass samples at. `validate` starts its pass so; the algorithm starts the baseline pass (v0) so
    before training, for the starting weights to serve it however late the evaluator comes."""
    resources_id, sampled_at = await _pass_resources(store, policy_id, sampling)
    of_task = await _enqueue_pass(store, tasks, label, sampling.samples, resources_id,
                                  config or recoverable_rollout_config())
    return of_task, sampled_at


async def _enqueue_pass(store: RedisStore, tasks: list[Task], label: str, samples: int, resources_id: str,
                        config: RolloutConfig) -> dict[str, int]:
    """Enqueue ``samples`` rollouts per task (idempotent: a retried job does not run a task twice);
    each rollout id mapped to its task's index."""
    of_task: dict[str, int] = {}
    rollouts = []
    for n, t in enumerate(tasks):
        for i in range(samples):
            rollout = store.rollouts.new_rollout(
                t, rollout_id=_rollout_id(label, t, i, samples), mode=RolloutMode.VAL, resources_id=resources_id,
                config=config, priority=Priority.URGENT)  # a training step waits on its result
            of_task[rollout.rollout_id] = n
            rollouts.append(rollout)
    await store.rollouts.enqueue_rollouts(rollouts)
    return of_task


async def recorded(store: RedisStore) -> list[dict[str, Any]]:
    """The validation results in the order they were recorded, one per label: a pass run twice (a
    job requeued by `requeue_abandoned` while its first run was still alive) counts once."""
    return await store.validations.passes()


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
    split: str | None = None, columns: str | None = None, sampling: list[Any] | None = None,
) -> dict[str, Any]:
    """The rq job (JSON in, JSON out): connects from the environment, like every service. ``split`` and
    ``columns``: how to read ``val_data`` when it is a dataset (`fulmen_algorithm.dataset.load_tasks`);
    ``sampling``: [samples, temperature] of a `PassSampling` (unset: one greedy sample per task)."""
    from fulmen.settings import EvaluatorSettings, load_settings
    from fulmen.store.redis.connection import connect

    async def main() -> dict[str, Any]:
        settings = load_settings(EvaluatorSettings, experiment=experiment)
        client = await connect(settings)
        try:
            store = RedisStore(client, experiment, max_record_bytes=settings.max_record_bytes)
            config = recoverable_rollout_config(settings.rollout_unresponsive_s, settings.rollout_max_attempts)
            tasks = load_tasks(val_data, split, columns)
            return await validate(store, tasks, label=label, step=step, timeout_s=timeout_s, config=config,
                                  sampling=PassSampling(*sampling) if sampling else GREEDY)
        finally:
            await client.aclose()

    return asyncio.run(main())
