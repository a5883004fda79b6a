"""A short run as the trackers see it: step records written by the trainer's own `StepMetrics`,
validation passes appended as `validate` appends them, and a reporter that reads them; then a
restart of both (new objects on the same Redis), the trainer recording its last step again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fulmen.store import RedisStore
from fulmen.telemetry.trackers import Reporter, Tracker
from fulmen_trainer.metrics import StepMetrics

CONFIG = {"objective": {"kl_coef": 0.1, "algorithm": "grpo"}, "run": {"seed": 3}}
FIRST, SECOND = (1, 2, 3), (3, 4, 5, 6)  # the restarted trainer records step 3 again


def step_metrics(step: int) -> dict[str, Any]:
    """What the trainer's step reports, by the names it uses."""
    return {
        "step": step, "model_version": f"v{step}", "loss/total": 1.0 / step, "loss/kl": 0.01 * step,
        "loss/entropy": 2.0 - 0.1 * step, "loss/clip_frac": 0.05, "rollout/reward_mean": step / 10,
        "rollout/staleness_mean": 0.5, "perf/tokens_per_s": 1000.0 + step, "perf/samples": 8,
        "comm/bytes": 4096.0, "comm/cosine": 0.99,
    }


async def trainer_steps(store: RedisStore, steps: tuple[int, ...]) -> None:
    """One trainer process's steps, through the leader's step log."""
    metrics = StepMetrics(0)
    metrics.log_steps_to(store)
    for step in steps:
        metrics.record(step, step_metrics(step))
    await metrics.flush()


async def validation(store: RedisStore, label: str, step: int, accuracy: float, **scores: float) -> None:
    await store.validations.append({"label": label, "step": step, "tasks": 4, "finished": 4, "accuracy": accuracy,
                                    "mean_reward": accuracy, "served_by": {f"v{step}": 4}, "seconds": 1.5,
                                    "time": 1.7e9 + step, **scores})


async def report(store: RedisStore, tracker: Tracker, **options: Any) -> Reporter:
    """One reporter process: start, read everything there is, close."""
    reporter = Reporter(store, [tracker], name=store.experiment, config=CONFIG, **options)
    await reporter.start()
    while await reporter.poll():
        pass
    await reporter.close(drain_s=30)
    return reporter


async def two_runs(store: RedisStore, tracker: Callable[[], Tracker]) -> str:
    """The run, then its restart, each with a new tracker object; the tracker run's id."""
    await validation(store, "v0", 0, 0.25)
    await trainer_steps(store, FIRST)
    first = await report(store, tracker())
    await trainer_steps(store, SECOND)
    await validation(store, "v0", 0, 0.25)  # the pass recorded twice (a requeued job): reported once
    await validation(store, "v5", 5, 0.75, samples=4, **{"pass@1": 0.75, "pass@4": 1.0, "maj@4": 0.75})
    second = await report(store, tracker())
    assert first.run is not None and second.run is not None
    assert second.run.run_id == first.run.run_id
    assert all(w.dropped == 0 for w in (*first.workers, *second.workers))
    return first.run.run_id
