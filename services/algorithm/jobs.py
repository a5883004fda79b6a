"""Validation passes as rq jobs: the algorithm enqueues them, `fulmen evaluator` runs them.

JSON serializer, never pickle; `AllowlistedJob` runs only `FULMEN_JOBS`, before importing anything a
job names. Why: docs/design/algorithm.md.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from fulmen.errors import TerminalError
from fulmen.keys import Keys
from fulmen.settings import AlgorithmSettings, CommonSettings

if TYPE_CHECKING:
    from rq import Queue, SimpleWorker

log = logging.getLogger(__name__)

VALIDATION_JOB = "fulmen_algorithm.validation.validation_job"
# The only functions the evaluator runs: a job naming anything else is refused, never imported.
FULMEN_JOBS = frozenset({VALIDATION_JOB})
# rq kills a job this long after the pass's own timeout: the pass ends on its timeout first and
# records what it has.
JOB_TIMEOUT_MARGIN_S = 60


class JobRefused(TerminalError):
    """An rq job names a function (or callback) that is not one of Fulmen's jobs."""


_job_class: type | None = None


def allowlisted_job_class() -> type:
    """rq's ``Job`` that resolves only `FULMEN_JOBS`: any other function, a method of a stored
    instance, or a callback fails the job with `JobRefused` (rq records it as the job's error).
    Built on first use: rq is imported only by the processes that use the queue."""
    global _job_class
    if _job_class is not None:
        return _job_class
    from rq.job import Job

    class AllowlistedJob(Job):
        @property
        def func(self) -> Any:
            name = self.func_name
            if name not in FULMEN_JOBS or self.instance is not None:
                raise JobRefused(
                    f"job {self.id} names {name!r}, which is not one of Fulmen's jobs "
                    f"({', '.join(sorted(FULMEN_JOBS))}): refused, not run"
                )
            if self._success_callback_name or self._failure_callback_name or self._stopped_callback_name:
                raise JobRefused(f"job {self.id} names callbacks; Fulmen's jobs take none: refused, not run")
            return super().func

        # Callbacks are never imported: rq reads these when it finishes a job, the refused ones too.
        @property
        def success_callback(self) -> None:
            return None

        @property
        def failure_callback(self) -> None:
            return None

        @property
        def stopped_callback(self) -> None:
            return None

    _job_class = AllowlistedJob
    return _job_class


def validation_queue(settings: CommonSettings) -> Queue:
    """The experiment's eval queue, on a connection of its own (rq is synchronous)."""
    import redis
    from rq import Queue
    from rq.serializers import JSONSerializer

    connection = redis.Redis.from_url(settings.redis_url_value())
    return Queue(
        Keys(settings.experiment).eval_queue, connection=connection, serializer=JSONSerializer,
        job_class=allowlisted_job_class(),
    )  # fmt: skip


def validation_job_id(experiment: str, version: int) -> str:
    """One job per experiment and version: enqueuing a version's pass twice (a restarted run) runs it
    once, and two experiments validating the same version on one Redis each run theirs (rq's job ids
    are one namespace per server)."""
    return f"val-{_rq_safe(experiment)}-v{version}"


def _rq_safe(name: str) -> str:
    """``name`` in the characters rq allows in a job id (letters, digits, '_', '-'), one to one: any other
    character, and '_' itself, becomes '_' and its code in two hex digits ('.' → '_2e')."""
    kept = {c for c in name if c.isascii() and (c.isalnum() or c == "-")}
    return "".join(c if c in kept else "".join(f"_{b:02x}" for b in c.encode()) for c in name)


def enqueue_validation(settings: AlgorithmSettings, version: int) -> None:
    """A validation pass of ``version`` for the `fulmen evaluator` worker."""
    # How the evaluator reads val_data when it is a dataset: passed only when set.
    reading: dict[str, Any] = {k: v for k, v in (("split", settings.val_split), ("columns", settings.task_columns)) if v}
    if settings.val_samples > 1:  # one greedy sample (the default) keeps the job's arguments as they were
        reading["sampling"] = [settings.val_samples, settings.val_temperature]
    validation_queue(settings).enqueue(
        VALIDATION_JOB,
        args=(settings.experiment, str(settings.val_data), f"v{version}", settings.val_timeout_s, version),
        kwargs=reading,
        job_id=validation_job_id(settings.experiment, version),
        job_timeout=int(settings.val_timeout_s) + JOB_TIMEOUT_MARGIN_S,
    )
    log.info("validation of version %d queued", version)


# rq's statuses of a job that has not ended yet
PENDING = frozenset({"queued", "started", "deferred", "scheduled"})


def pending_validations(settings: AlgorithmSettings, versions: list[int]) -> tuple[list[int], bool]:
    """Which of ``versions``' passes have not ended on the evaluator, and whether any evaluator is
    listening on the queue (with none, a queued pass would wait for nobody)."""
    from rq import Worker

    queue = validation_queue(settings)
    try:
        pending = []
        for version in versions:
            job = queue.fetch_job(validation_job_id(settings.experiment, version))
            if job is not None and getattr(job.get_status(refresh=False), "value", None) in PENDING:
                pending.append(version)
        return pending, Worker.count(queue=queue) > 0
    finally:
        queue.connection.close()


def evaluator_worker(queue: Queue) -> SimpleWorker:
    """The rq worker of the eval queue: in this process (the jobs are asyncio passes), JSON only,
    and running Fulmen's jobs only; ``running`` names the job under way. It works in a thread
    (`fulmen_algorithm.main.run_evaluator`): rq's thread-safe job timeout (its default, SIGALRM,
    needs the main thread), and no signal handlers of its own (the evaluator's ``stop`` answers them)."""
    from rq import SimpleWorker
    from rq.serializers import JSONSerializer
    from rq.timeouts import TimerDeathPenalty

    class EvaluatorWorker(SimpleWorker):
        running: str | None = None  # the job under way (kept here: asking Redis would race the job)
        death_penalty_class = TimerDeathPenalty

        def _install_signal_handlers(self) -> None:
            pass

        def subscribe(self) -> None:
            """No command channel (rq's pubsub thread, made and joined on every one-second burst): its
            join can hang a burst's end for the thread's 60 s read, and the evaluator takes no rq commands;
            its own signal stops it. Why: docs/design/algorithm.md."""

        def execute_job(self, job: Any, queue: Queue) -> None:
            self.running = job.id
            try:
                super().execute_job(job, queue)
            finally:
                self.running = None

    return EvaluatorWorker(
        [queue], connection=queue.connection, serializer=JSONSerializer, job_class=allowlisted_job_class()
    )
