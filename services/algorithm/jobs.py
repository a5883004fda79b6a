"""Validation passes as rq jobs: the algorithm enqueues them, `fulmen evaluator` runs them.

rq with its JSON serializer (never pickle): a job is a function name and JSON arguments.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from fulmen.keys import Keys
from fulmen.settings import AlgorithmSettings, CommonSettings, EvaluatorSettings

if TYPE_CHECKING:
    from rq import Queue

log = logging.getLogger(__name__)

VALIDATION_JOB = "fulmen_algorithm.validation.validation_job"
# rq kills a job this long after the pass's own timeout: the pass ends on its timeout first and
# records what it has.
JOB_TIMEOUT_MARGIN_S = 60


def validation_queue(settings: CommonSettings) -> Queue:
    """The experiment's eval queue, on a connection of its own (rq is synchronous)."""
    import redis
    from rq import Queue
    from rq.serializers import JSONSerializer

    connection = redis.Redis.from_url(settings.redis_url_value())
    return Queue(Keys(settings.experiment).eval_queue, connection=connection, serializer=JSONSerializer)


def validation_job_id(version: int) -> str:
    """One job per version: enqueuing a version's pass twice (a restarted run) runs it once."""
    return f"val-v{version}"


def enqueue_validation(settings: AlgorithmSettings, version: int) -> None:
    """A validation pass of ``version`` for the `fulmen evaluator` worker."""
    validation_queue(settings).enqueue(
        VALIDATION_JOB, settings.experiment, str(settings.val_data), f"v{version}", settings.val_timeout_s, version,
        job_id=validation_job_id(version), job_timeout=int(settings.val_timeout_s) + JOB_TIMEOUT_MARGIN_S,
    )
    log.info("validation of version %d queued", version)


def run_evaluator(settings: EvaluatorSettings) -> None:
    """Work the eval queue until stopped, after putting back the passes a killed evaluator left."""
    from rq import SimpleWorker
    from rq.serializers import JSONSerializer

    from fulmen_algorithm.validation import requeue_abandoned

    queue = validation_queue(settings)
    log.info("evaluator on queue %s", queue.name)
    requeue_abandoned(queue)  # a pass an evaluator was killed in is run again, not lost
    SimpleWorker([queue], connection=queue.connection, serializer=JSONSerializer).work(with_scheduler=False)
