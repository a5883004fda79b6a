"""The evaluator runs Fulmen's own jobs only: a job naming any other function is refused, never run."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rq.job import JobStatus

from fulmen.settings import AlgorithmSettings, EvaluatorSettings, load_settings
from fulmen_algorithm.jobs import (
    VALIDATION_JOB,
    allowlisted_job_class,
    enqueue_validation,
    evaluator_worker,
    pending_validations,
    validation_job_id,
    validation_queue,
)
from fulmen_algorithm.validation import validation_job


@pytest.fixture
def queue(redis_url: str, experiment: str):
    q = validation_queue(EvaluatorSettings(redis_url=redis_url, experiment=experiment))
    yield q
    q.connection.close()


def _plain_enqueue(queue, func: str, *args, **kwargs):
    """Enqueue as an attacker with Redis access would: rq's own Job class, any function name."""
    import rq
    from rq.serializers import JSONSerializer

    plain = rq.Queue(queue.name, connection=queue.connection, serializer=JSONSerializer)
    return plain.enqueue(func, *args, **kwargs)


def test_a_job_naming_another_function_is_refused_and_not_run(queue, tmp_path: Path) -> None:
    """os.makedirs as a job: the evaluator fails it with a clear error and the directory never appears."""
    target = tmp_path / "pwned"
    job = _plain_enqueue(queue, "os.makedirs", str(target))
    evaluator_worker(queue).work(burst=True, with_scheduler=False)
    job = queue.fetch_job(job.id)
    assert job.get_status() == JobStatus.FAILED
    assert "'os.makedirs', which is not one of Fulmen's jobs" in (job.latest_result().exc_string or "")
    assert not target.exists()


def test_a_fulmen_job_with_a_callback_is_refused_and_no_callback_runs(queue, tmp_path: Path) -> None:
    """A callback is code too: a job naming one fails, and neither it nor the job's function runs."""
    from rq import Callback

    target = tmp_path / "pwned-by-callback"
    job = _plain_enqueue(
        queue, VALIDATION_JOB, "x", str(tmp_path / "missing.jsonl"), "v1",
        on_failure=Callback("os.makedirs"), on_success=Callback("os.makedirs"),
    )  # fmt: skip
    evaluator_worker(queue).work(burst=True, with_scheduler=False)
    job = queue.fetch_job(job.id)
    assert job.get_status() == JobStatus.FAILED
    assert "names callbacks" in (job.latest_result().exc_string or "")
    assert not target.exists()


def test_fulmen_jobs_resolve(queue) -> None:
    """The validation job, enqueued as the algorithm does, resolves to Fulmen's function."""
    job = queue.enqueue(VALIDATION_JOB, "x", "data.jsonl", "v1")
    fetched = allowlisted_job_class().fetch(job.id, connection=queue.connection, serializer=queue.serializer)
    assert fetched.func is validation_job


def test_two_experiments_validating_one_version_each_get_their_own_job(
    redis_url: str, experiment: str, tmp_path: Path
) -> None:
    """Version 3 validated by two experiments on one Redis: two jobs (rq's ids are one namespace per
    server), each with its own experiment's payload; names rq refuses in an id ('.') are encoded."""
    experiments = (experiment, f"{experiment}.b")
    for name in experiments:
        enqueue_validation(load_settings(AlgorithmSettings, redis_url=redis_url, experiment=name,
                                         val_data=tmp_path / f"{name}.jsonl", val_timeout_s=30), 3)
    ids = [validation_job_id(name, 3) for name in experiments]
    assert len(set(ids)) == 2
    for name, job_id in zip(experiments, ids, strict=True):
        queue = validation_queue(EvaluatorSettings(redis_url=redis_url, experiment=name))
        try:
            assert queue.job_ids == [job_id]
            assert queue.fetch_job(job_id).args == [name, str(tmp_path / f"{name}.jsonl"), "v3", 30, 3]
        finally:
            queue.connection.close()


def test_validation_job_ids_are_valid_rq_ids_and_one_per_experiment() -> None:
    """Every experiment name gives an id rq accepts, and two names never give one id ('_' is escaped too)."""
    from rq.job import validate_job_id

    names = ["default", "a.b", "a_2eb", "a_b", "a-b", "a-v1"]
    ids = [validation_job_id(name, 1) for name in names]
    for job_id in ids:
        validate_job_id(job_id)
    assert len(set(ids)) == len(names)


def test_a_queued_pass_is_pending_until_it_ends_and_an_evaluator_listening_is_seen(
    redis_url: str, experiment: str, tmp_path: Path
) -> None:
    """Version 2's pass queued: pending (version 4's, never queued, is not), with nobody listening until an
    evaluator's worker registers; ended, it is pending no more."""
    settings = load_settings(AlgorithmSettings, redis_url=redis_url, experiment=experiment,
                             val_data=tmp_path / "val.jsonl", val_timeout_s=30)
    enqueue_validation(settings, 2)
    assert pending_validations(settings, [2, 4]) == ([2], False)
    queue = validation_queue(settings)
    worker = evaluator_worker(queue)
    worker.register_birth()
    try:
        assert pending_validations(settings, [2]) == ([2], True)
        queue.fetch_job(validation_job_id(experiment, 2)).set_status(JobStatus.FINISHED)
        assert pending_validations(settings, [2, 4]) == ([], True)
    finally:
        worker.register_death()
        queue.connection.close()
    assert pending_validations(settings, [2]) == ([], False)


def test_bursts_end_on_time_when_rqs_pubsub_thread_would_win_the_race(queue, monkeypatch) -> None:
    """rq ends each burst by unsubscribing its pubsub thread and joining it; a thread that reads the
    unsubscribe reply before the join is asked for waits out its 60 s read, and the burst with it (seen
    as an evaluator taking no pass for a minute). Made certain here by a pause after the unsubscribe:
    the evaluator's worker runs three one-second bursts, a job queued before each taken, within seconds."""
    import threading

    import redis.client

    unsubscribe = redis.client.PubSub.unsubscribe

    def unsubscribe_then_lose_the_race(self, *args):
        reply = unsubscribe(self, *args)
        time.sleep(0.1)  # the pubsub thread reads the reply and goes back to its read meanwhile
        return reply

    monkeypatch.setattr(redis.client.PubSub, "unsubscribe", unsubscribe_then_lose_the_race)
    worker, jobs = evaluator_worker(queue), []

    def bursts() -> None:
        for _ in range(3):
            jobs.append(_plain_enqueue(queue, "os.getcwd"))
            worker.work(max_idle_time=1, with_scheduler=False)

    thread = threading.Thread(target=bursts, daemon=True)
    thread.start()
    thread.join(timeout=30)  # 3 bursts of about 1 s each; losing the race, the first alone takes 61 s
    assert not thread.is_alive(), f"{len(jobs)} burst(s) started in 30 s"
    assert [job.get_status(refresh=True) for job in jobs] == [JobStatus.FAILED] * 3  # each taken (and refused)
