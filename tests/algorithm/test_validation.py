"""Validation passes against a real Redis: a pass survives the death of the runner holding its rollouts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from fulmen.store import RedisStore
from fulmen.watchdog import sweep
from fulmen_algorithm.scheduler import recoverable_rollout_config
from fulmen_algorithm.validation import validate

TASKS = [{"id": f"q{i}", "question": f"{i}+1=", "answer": str(i + 1)} for i in range(2)]


async def test_a_pass_finishes_when_the_runner_holding_its_rollouts_dies(real_store: RedisStore) -> None:
    """Validation rollouts carry a heartbeat deadline: the watchdog requeues a dead runner's attempts."""
    await real_store.resources.add_resources({"llm": {"kind": "llm", "model": "tiny", "model_version": "v1"}},
                                   resources_id="policy")
    config = recoverable_rollout_config(unresponsive_s=0.1)
    running = asyncio.create_task(validate(real_store, TASKS, label="v1", timeout_s=30, config=config))
    claimed: list = []
    while len(claimed) < 2:  # the runner that dies: claims both, then nothing more from it
        claimed += await real_store.queue.dequeue_rollouts("runner-that-dies", 2, block_s=0.5)
    await asyncio.sleep(0.3)
    assert (await sweep(real_store))["requeued"] == 2
    for c in await real_store.queue.dequeue_rollouts("another-runner", 2, block_s=5):
        await real_store.rollouts.update_attempt(c.rollout.rollout_id, c.attempt.attempt_id, status="succeeded")
    result = await asyncio.wait_for(running, 30)
    assert result["finished"] == 2


async def test_a_job_an_evaluator_died_in_goes_back_on_the_queue(redis_url: str, experiment: str) -> None:
    """An evaluator SIGKILLed inside a validation job: the next evaluator to start requeues that job."""
    import signal
    import subprocess
    import sys

    import redis
    from rq import Queue
    from rq.job import JobStatus
    from rq.serializers import JSONSerializer

    from fulmen.keys import Keys
    from fulmen_algorithm.validation import requeue_abandoned

    connection = redis.Redis.from_url(redis_url)
    queue = Queue(Keys(experiment).eval_queue, connection=connection, serializer=JSONSerializer)
    queue.enqueue("time.sleep", 60, job_id="val-v2", job_timeout=120)
    worker = subprocess.Popen([sys.executable, "-c", (
        "import redis, sys; from rq import Queue, SimpleWorker; from rq.serializers import JSONSerializer; "
        "c = redis.Redis.from_url(sys.argv[1]); q = Queue(sys.argv[2], connection=c, serializer=JSONSerializer); "
        "SimpleWorker([q], connection=c, serializer=JSONSerializer).work(burst=True)"
    ), redis_url, queue.name])
    try:
        for _ in range(300):
            if queue.started_job_registry.get_job_ids(cleanup=False):
                break
            await asyncio.sleep(0.1)
        worker.send_signal(signal.SIGKILL)
        worker.wait(timeout=10)
    finally:
        worker.kill()
    assert queue.started_job_registry.get_job_ids(cleanup=False) == ["val-v2"]
    assert requeue_abandoned(queue) == ["val-v2"]
    assert queue.job_ids == ["val-v2"] and queue.fetch_job("val-v2").get_status() == JobStatus.QUEUED
    assert queue.started_job_registry.get_job_ids(cleanup=False) == []
    connection.close()


async def test_a_pass_recorded_twice_counts_once(real_store: RedisStore) -> None:
    """A validation job run twice records its label twice; the curve reads one result per label."""
    import json

    from fulmen_algorithm.validation import recorded

    for label, accuracy in (("v0", 0.1), ("v2", 0.2), ("v0", 0.3)):
        await real_store.redis.xadd(real_store.keys.validations, {"m": json.dumps({"label": label, "accuracy": accuracy})})
    assert [(r["label"], r["accuracy"]) for r in await recorded(real_store)] == [("v0", 0.1), ("v2", 0.2)]


def test_the_best_validated_pass_is_the_final_models_choice() -> None:
    """best_pass: highest accuracy, the later pass on a tie, only passes whose serving version is known."""
    from fulmen_algorithm.report import best_pass, served_version

    passes = [
        {"label": "v0", "accuracy": 0.45, "served_by": {"v0": 300}},
        {"label": "v240", "accuracy": 0.93, "served_by": {"v240": 299, "none": 1}},
        {"label": "v260", "accuracy": 0.93, "served_by": {"v259": 2, "v260": 298}},
        {"label": "final", "accuracy": 0.89, "served_by": {"v300": 300}},
        {"label": "broken", "accuracy": 0.99, "served_by": {"none": 300}},
    ]
    best = best_pass(passes)
    assert best is not None and best["label"] == "v260" and served_version(best) == "v260"
    assert best_pass(passes[:2] + passes[3:4])["label"] == "v240"  # an earlier, better pass beats the last
    assert best_pass([]) is None



async def test_an_evaluator_rides_out_redis_going_away(redis_url: str, experiment: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A ConnectionError out of the rq worker's loop (Redis restarting while the worker registers, as
    a random-fault run found) does not end `fulmen evaluator`: it waits for Redis and works on with a
    new worker, until stopped."""
    import time

    from redis.exceptions import ConnectionError as RedisConnectionError

    import fulmen_algorithm.main as evaluator
    from fulmen.settings import EvaluatorSettings, load_settings

    made: list[Any] = []

    class Worker:
        running = None

        def __init__(self) -> None:
            self.calls = 0

        def work(self, **_: Any) -> bool:
            self.calls += 1
            if len(made) == 1:  # the first worker meets Redis going away
                raise RedisConnectionError("Error 111 connecting to 127.0.0.1. Connection refused.")
            time.sleep(0.05)  # rq's idle return
            return False

    def new_worker(queue: Any) -> Worker:
        made.append(Worker())
        return made[-1]

    monkeypatch.setattr(evaluator, "_evaluator_worker", new_worker)
    stop = asyncio.Event()
    settings = load_settings(EvaluatorSettings, redis_url=redis_url, experiment=experiment)
    running = asyncio.create_task(evaluator.run_evaluator(settings, stop))
    for _ in range(400):
        if len(made) == 2 and made[1].calls >= 2:
            break
        assert not running.done(), running.exception()
        await asyncio.sleep(0.05)
    assert len(made) == 2 and made[1].calls >= 2  # a second worker, working the queue
    stop.set()
    await asyncio.wait_for(running, 10)
