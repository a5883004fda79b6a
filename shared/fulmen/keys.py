"""Every Redis key, stream and consumer-group name Fulmen uses. Nobody else formats key strings.

Every key of an experiment starts with ``fulmen:{<experiment>}:``. The braces are a Redis Cluster hash
tag: all keys of one experiment live in one slot, so the Lua scripts that move a rollout, its attempt,
the queue and the finished stream in one atomic step are legal on a cluster too.

Lua scripts receive the experiment prefix and append the suffixes below (as BullMQ's scripts do):
the suffix constants are interpolated into the Lua source by ``fulmen.store.scripts``, so this module
stays the only place where a key's shape is written.
"""

from __future__ import annotations

import re

from fulmen.errors import InvalidInput

NAMESPACE = "fulmen"
EXPERIMENTS = f"{NAMESPACE}:experiments"  # set of experiment names (the only key outside an experiment)

# Suffixes after the experiment prefix. Per-entity keys append the entity id.
ROLLOUT = "rollout:"  # hash: one rollout's state
ATTEMPT = "attempt:"  # hash: one attempt's state, id "<rollout_id>.<n>"
SPANS = "spans:"  # stream: one rollout's spans, entry id "<sequence_id>-0"
SPAN_IDS = "spanids:"  # set: "<attempt_id>/<span_id>" already stored for one rollout (dedupe)
STATUS = "status:"  # set: rollout ids currently in one status
RESOURCES = "resources:"  # hash: version -> resources record, for one resources id
QUEUE = "queue"  # stream: rollouts waiting for a runner
FINISHED = "finished"  # stream: rollouts that reached a terminal status, once each
DEAD_LETTERS = "dead"  # stream: poison messages, with the reason
ROLLOUT_INDEX = "rollouts"  # zset: rollout id -> enqueue time
RESOURCES_LOG = "resources-log"  # stream: every resources version, in publication order
RESOURCES_VERSION = "resources-version"  # counter: the last resources version number
WATCH_HEARTBEAT = "watch:heartbeat"  # zset: active attempt id -> time it becomes unresponsive
WATCH_DEADLINE = "watch:deadline"  # zset: active attempt id -> time it times out
WORKERS = "workers"  # hash: worker id -> worker record
PROXIES = "proxies"  # hash: proxy id -> proxy endpoint record (its heartbeat)
WEIGHTS = "weights:"  # stream: one model version's weights, msgpack-framed safetensors chunks
REPLICAS = "replicas"  # hash: inference server URL -> its replica state (served version, ready), from vllm-sync
POLICY_RESOURCES_ID = "policy"  # the resources the trainer publishes model versions to and rollouts run with
STORED_VERSIONS = "weights-stored"  # zset: model version -> resources version, for those whose weights are kept
VERSION_BASES = "weights-bases"  # hash: delta model version -> the version it applies onto
CONTROL = "control"  # stream: pause / drain / resume for the proxies (synchronous weight updates)
SAMPLES = "samples"  # stream: training samples, from the adapter to the trainer
ADAPTER_STATS = "stats:adapter"  # hash: rollouts adapted, samples written, skips per reason
ALGORITHM_STATE = "algorithm:state"  # hash: the run's position (epoch, cursor, groups and rollouts enqueued)
ALGORITHM_DONE = "algorithm:done"  # set: train rollouts of the run seen terminal (counted once each)
VALIDATIONS = "validations"  # stream: validation results (mean reward, accuracy, per model version)
EVAL_QUEUE = "eval"  # the rq queue of validation jobs: fulmen:{exp}:eval
TRAINER_SLOT = "trainer:slot:"  # string with a TTL: who holds trainer rank <n> (membership heartbeat)
TRAINER_PLANS = "trainer:plans"  # stream: the leader's step plans, one entry per rank's share
TRAINER_GRADS = "trainer:grads"  # stream: each rank's encoded gradient chunks, per step
TRAINER_AGGREGATES = "trainer:aggregates"  # stream: the summed gradient the leader sends back, per step
TRAINER_STEPS = "trainer:steps"  # stream, capped: the leader's per-step summary (reward, loss), for `fulmen top`
TRAINER_UNTRAINED = "trainer:untrained"  # set: group keys the trainer took without a step (dropped, skipped)
SERVICES = "services"  # hash: process id -> service heartbeat record (every long-running service)

RUNNERS_GROUP = "runners"  # consumer group on QUEUE
ADAPTER_GROUP = "adapter"  # consumer group on FINISHED
TRAINERS_GROUP = "trainers"  # consumer group on SAMPLES
ALGORITHM_GROUP = "algorithm"  # consumer group on FINISHED

# Matched with fullmatch: ``$`` also matches before a trailing newline, which let "r1\n" through
# (and into log lines).
_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_ID = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")


def check_experiment(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidInput(f"experiment name {name!r} is invalid: use 1-64 letters, digits, '_', '.' or '-'")
    return name


def check_id(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise InvalidInput(f"{kind} {value!r} is invalid: use 1-128 letters, digits, '_', '.', ':' or '-'")
    return value


def attempt_id(rollout_id: str, sequence: int) -> str:
    """The id of a rollout's n-th attempt (1-based); the Lua scripts build the same string."""
    return f"{rollout_id}.{sequence}"


def experiment_prefix(experiment: str) -> str:
    return f"{NAMESPACE}:{{{check_experiment(experiment)}}}:"


class Keys:
    """The keys of one experiment."""

    __slots__ = (
        "adapter_stats",
        "algorithm_done",
        "algorithm_state",
        "control",
        "dead_letters",
        "eval_queue",
        "experiment",
        "finished",
        "prefix",
        "proxies",
        "queue",
        "replicas",
        "resources_log",
        "resources_version",
        "rollout_index",
        "samples",
        "services",
        "stored_versions",
        "trainer_aggregates",
        "trainer_grads",
        "trainer_plans",
        "trainer_steps",
        "trainer_untrained",
        "validations",
        "version_bases",
        "watch_deadline",
        "watch_heartbeat",
        "workers",
    )

    def __init__(self, experiment: str) -> None:
        self.experiment = experiment
        self.prefix = experiment_prefix(experiment)
        p = self.prefix
        self.queue = p + QUEUE
        self.finished = p + FINISHED
        self.dead_letters = p + DEAD_LETTERS
        self.rollout_index = p + ROLLOUT_INDEX
        self.resources_log = p + RESOURCES_LOG
        self.resources_version = p + RESOURCES_VERSION
        self.watch_heartbeat = p + WATCH_HEARTBEAT
        self.watch_deadline = p + WATCH_DEADLINE
        self.workers = p + WORKERS
        self.proxies = p + PROXIES
        self.control = p + CONTROL
        self.samples = p + SAMPLES
        self.adapter_stats = p + ADAPTER_STATS
        self.algorithm_state = p + ALGORITHM_STATE
        self.algorithm_done = p + ALGORITHM_DONE
        self.validations = p + VALIDATIONS
        self.eval_queue = p + EVAL_QUEUE
        self.trainer_plans = p + TRAINER_PLANS
        self.trainer_grads = p + TRAINER_GRADS
        self.trainer_aggregates = p + TRAINER_AGGREGATES
        self.trainer_steps = p + TRAINER_STEPS
        self.trainer_untrained = p + TRAINER_UNTRAINED
        self.services = p + SERVICES
        self.stored_versions = p + STORED_VERSIONS
        self.version_bases = p + VERSION_BASES
        self.replicas = p + REPLICAS

    def rollout(self, rollout_id: str) -> str:
        return self.prefix + ROLLOUT + rollout_id

    def attempt(self, attempt_id: str) -> str:
        return self.prefix + ATTEMPT + attempt_id

    def spans(self, rollout_id: str) -> str:
        return self.prefix + SPANS + rollout_id

    def span_ids(self, rollout_id: str) -> str:
        return self.prefix + SPAN_IDS + rollout_id

    def status(self, status: str) -> str:
        return self.prefix + STATUS + status

    def resources(self, resources_id: str) -> str:
        return self.prefix + RESOURCES + resources_id

    def trainer_slot(self, rank: int) -> str:
        return self.prefix + TRAINER_SLOT + str(rank)

    def weights(self, model_version: str) -> str:
        return self.prefix + WEIGHTS + model_version

    def pattern(self) -> str:
        """SCAN pattern matching every key of this experiment (braces escaped for glob)."""
        return f"{NAMESPACE}:\\{{{self.experiment}\\}}:*"


def rollout_of_attempt(attempt_id: str) -> str:
    """Inverse of `attempt_id`."""
    return attempt_id.rpartition(".")[0]
