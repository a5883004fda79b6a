"""Every Redis key, stream and consumer-group name Fulmen uses. Nobody else formats key strings.

Every key of an experiment starts with ``fulmen:{<experiment>}:`` (a Cluster hash tag); `ShardKeys`
gives a lifecycle shard's keys. Hash tags and shards: docs/design/store.md.
"""

from __future__ import annotations

import re
import zlib
from functools import lru_cache

from redis.crc import REDIS_CLUSTER_HASH_SLOTS, key_slot

from fulmen.errors import InvalidInput
from fulmen.settings.base import check_experiment

NAMESPACE = "fulmen"
EXPERIMENTS = f"{NAMESPACE}:experiments"  # set of experiment names (the only key outside an experiment)

# Suffixes after the experiment prefix. Per-entity keys append the entity id.
ROLLOUT = "rollout:"  # hash: one rollout's state
ATTEMPT = "attempt:"  # hash: one attempt's state, id "<rollout_id>.<n>"
SPANS = "spans:"  # stream: one rollout's spans, an entry per call (`fulmen.records.spans.entry_records`)
SPAN_IDS = "spanids:"  # set: dedupe keys of the spans stored for one rollout (`fulmen.store.spans.dedupe_key`)
STATUS = "status:"  # set: rollout ids currently in one status
RESOURCES = "resources:"  # hash: version -> resources record, for one resources id
QUEUE = "queue"  # stream: rollouts waiting for a runner (the normal lane; see LANES)
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
REPLICA_LOADING = "replicas:loading"  # string, with a TTL: the one inference server loading a version now (vllm-sync)
REPLICAS = "replicas"  # hash: inference server URL -> its replica state (served version, ready), from vllm-sync
POLICY_RESOURCES_ID = "policy"  # the resources the trainer publishes model versions to and rollouts run with
STORED_VERSIONS = "weights-stored"  # zset: model version -> resources version, for those whose weights are kept
VERSION_BASES = "weights-bases"  # hash: delta model version -> the version it applies onto
VERSION_MANIFESTS = "weights-manifests"  # hash: stored model version -> its manifest (JSON): what a rebuild must match
VERSION_REBUILDS = "weights-rebuilds"  # stream, capped: asks to rebuild a version whose weights Redis lost, and answers
WEIGHT_GROUP = "weight-group"  # hash: where the trainer's weight-group rendezvous listens (host, port, backend)
WEIGHT_GROUP_ASKS = "weight-group-asks"  # stream, capped: vllm-sync's asks to join a weight group or be sent a version
CONTROL = "control"  # stream: pause / drain / resume for the proxies (synchronous weight updates)
SAMPLES = "samples"  # stream: training samples, from the adapter to the trainer
SAMPLED = "sampled"  # set: rollouts sampled (the once-per-rollout marker when there are several shards)
REPLAYED = "replayed:"  # set: rollouts one named replay has appended samples for (`fulmen replay`)
ADAPTER_STATS = "stats:adapter"  # hash: rollouts adapted, samples written, skips per reason
ALGORITHM_STATE = "algorithm:state"  # hash: the run's position (epoch, cursor, groups and rollouts enqueued)
ALGORITHM_DONE = "algorithm:done"  # set: train rollouts of the run seen terminal (counted once each)
VALIDATIONS = "validations"  # stream: validation results (mean reward, accuracy, per model version)
EVAL_QUEUE = "eval"  # the rq queue of validation jobs: fulmen:{exp}:eval
TRAINER_SLOT = "trainer:slot:"  # string with a TTL: who holds trainer rank <n> (membership heartbeat)
TRAINER_PLANS = "trainer:plans"  # stream: the leader's step plans, one entry per rank's share
TRAINER_GRADS = "trainer:grads"  # stream: each rank's encoded gradient chunks, per step
TRAINER_AGGREGATES = "trainer:aggregates"  # stream: the summed gradient the leader sends back, per step
TRAINER_LEADER = "trainer:leader"  # string with a TTL: the leader's lease, "<epoch>:<rank>:<token>"
TRAINER_LEADER_EPOCH = "trainer:leader:epoch"  # counter: the fencing token of each new lease
TRAINER_AGREED = "trainer:agreed"  # stream, capped: one record per step the ranks agreed on (the commit)
TRAINER_STEPS = "trainer:steps"  # stream, capped: the leader's per-step summary (reward, loss), for `fulmen top`
TRAINER_UNTRAINED = "trainer:untrained"  # set: group keys the trainer took without a step (dropped, skipped)
TRAINER_FILTERED = "trainer:filtered"  # set: group keys dynamic sampling left out (rewards all equal)
SERVICES = "services"  # hash: process id -> service heartbeat record (every long-running service)
ARCHIVED = "archived"  # hash: log stream key -> the last entry id `fulmen archive` wrote ("0-0": none yet)
RUN_CONFIG = "run:config"  # string: the run's effective settings and run file as JSON (written by the algorithm)
TRACKERS = "trackers"  # hash: the experiment trackers' run id and read positions (`fulmen.telemetry.trackers`)

# Priority lanes, highest first: each is a queue stream of its own in every shard (the normal lane
# is QUEUE itself, so an experiment that never uses the others is exactly what it was). The claim
# rule across lanes is `fulmen.store.queue`'s.
LANES = ("urgent", "normal", "low")
DEFAULT_LANE = "normal"
LANE_QUEUES = {"urgent": QUEUE + ":urgent", "normal": QUEUE, "low": QUEUE + ":low"}  # lane -> suffix
QUEUE_TURN = QUEUE + ":turn"  # string: the position of the claim rule's cycle in one shard

RUNNERS_GROUP = "runners"  # consumer group on every lane's queue stream
ADAPTER_GROUP = "adapter"  # consumer group on FINISHED
TRAINERS_GROUP = "trainers"  # consumer group on SAMPLES
ALGORITHM_GROUP = "algorithm"  # consumer group on FINISHED
ARCHIVE_GROUP = "archive"  # consumer group on every FINISHED and on SAMPLES, once `fulmen archive` ran
REBUILDERS_GROUP = "rebuilders"  # consumer group on VERSION_REBUILDS: the trainer answers the asks
WEIGHT_SENDERS_GROUP = "weight-senders"  # consumer group on WEIGHT_GROUP_ASKS: the trainer's rank 0 answers them

# Matched with fullmatch: ``$`` also matches before a trailing newline, which let "r1\n" through
# (and into log lines). The experiment name's rule lives with the setting (`check_experiment`).
_ID = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")


def check_id(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise InvalidInput(f"{kind} {value!r} is invalid: use 1-128 letters, digits, '_', '.', ':' or '-'")
    return value


def attempt_id(rollout_id: str, sequence: int) -> str:
    """The id of a rollout's n-th attempt (1-based); the Lua scripts build the same string."""
    return f"{rollout_id}.{sequence}"


def experiment_prefix(experiment: str) -> str:
    return f"{NAMESPACE}:{{{check_experiment(experiment)}}}:"


SHARDS_ENV = "FULMEN_STORE_SHARDS"
MAX_SHARDS = 64
SHARDS = "shards"  # string in shard 0: the experiment's shard count, written once (a check, see the store)


def shards_from_env() -> int:
    """``store_shards`` from the environment, checked as the settings check it (1 to `MAX_SHARDS`)."""
    from fulmen.settings import env_setting

    shards: int = env_setting("store_shards")
    return shards


@lru_cache(maxsize=256)
def shard_prefixes(experiment: str, shards: int) -> tuple[str, ...]:
    """The key prefix of each shard (see the module's docstring)."""
    base = experiment_prefix(experiment)
    if shards == 1:
        return (base,)
    part = REDIS_CLUSTER_HASH_SLOTS // shards
    taken = {min(key_slot(base.encode()) // part, shards - 1)}
    prefixes = [base]
    for i in range(1, shards):
        n = 0
        while True:
            prefix = f"{NAMESPACE}:{{{experiment}:shard{i}.{n}}}:"
            region = min(key_slot(prefix.encode()) // part, shards - 1)
            if region not in taken:
                taken.add(region)
                prefixes.append(prefix)
                break
            n += 1
    return tuple(prefixes)


def shard_of(rollout_id: str, shards: int) -> int:
    """A rollout's shard: a stable hash of its id (the same in every process and release)."""
    return 0 if shards == 1 else zlib.crc32(rollout_id.encode()) % shards


class ShardKeys:
    """The keys of one shard of an experiment's rollout lifecycle."""

    __slots__ = (
        "finished", "index", "prefix", "queue", "queues", "rollout_index", "watch_deadline", "watch_heartbeat",
    )

    def __init__(self, prefix: str, index: int) -> None:
        self.prefix, self.index = prefix, index
        self.queue = prefix + QUEUE  # the normal lane
        # Every queue stream of the shard, one per lane in LANES order (urgent, normal, low): the one
        # list that claims, counts and retention loop over.
        self.queues = tuple(prefix + LANE_QUEUES[lane] for lane in LANES)
        self.finished = prefix + FINISHED
        self.rollout_index = prefix + ROLLOUT_INDEX
        self.watch_heartbeat = prefix + WATCH_HEARTBEAT
        self.watch_deadline = prefix + WATCH_DEADLINE

    def status(self, status: str) -> str:
        return self.prefix + STATUS + status

    def lane_queue(self, lane: str) -> str:
        """The queue stream of one priority lane in this shard."""
        return self.prefix + LANE_QUEUES[lane]


class Keys:
    """The keys of one experiment."""

    __slots__ = (
        "adapter_stats",
        "algorithm_done",
        "algorithm_state",
        "archived",
        "control",
        "dead_letters",
        "eval_queue",
        "experiment",
        "finished",
        "prefix",
        "proxies",
        "queue",
        "replica_loading",
        "replicas",
        "resources_log",
        "resources_version",
        "rollout_index",
        "run_config",
        "sampled",
        "samples",
        "services",
        "shards",
        "shards_count",
        "stored_versions",
        "trackers",
        "trainer_aggregates",
        "trainer_agreed",
        "trainer_filtered",
        "trainer_grads",
        "trainer_leader",
        "trainer_leader_epoch",
        "trainer_plans",
        "trainer_steps",
        "trainer_untrained",
        "validations",
        "version_bases",
        "version_manifests",
        "version_rebuilds",
        "watch_deadline",
        "watch_heartbeat",
        "weight_group",
        "weight_group_asks",
        "workers",
    )

    def __init__(self, experiment: str, shards: int | None = None) -> None:
        """``shards``: the number of lifecycle shards (None: ``FULMEN_STORE_SHARDS``, default 1)."""
        self.experiment = experiment
        self.prefix = experiment_prefix(experiment)
        n = shards_from_env() if shards is None else shards
        if not 1 <= n <= MAX_SHARDS:
            raise InvalidInput(f"shards={n} is invalid: use 1 to {MAX_SHARDS}")
        self.shards = tuple(ShardKeys(p, i) for i, p in enumerate(shard_prefixes(experiment, n)))
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
        self.sampled = p + SAMPLED
        self.adapter_stats = p + ADAPTER_STATS
        self.algorithm_state = p + ALGORITHM_STATE
        self.algorithm_done = p + ALGORITHM_DONE
        self.validations = p + VALIDATIONS
        self.eval_queue = p + EVAL_QUEUE
        self.trainer_plans = p + TRAINER_PLANS
        self.trainer_grads = p + TRAINER_GRADS
        self.trainer_aggregates = p + TRAINER_AGGREGATES
        self.trainer_leader = p + TRAINER_LEADER
        self.trainer_leader_epoch = p + TRAINER_LEADER_EPOCH
        self.trainer_agreed = p + TRAINER_AGREED
        self.trainer_steps = p + TRAINER_STEPS
        self.trainer_untrained = p + TRAINER_UNTRAINED
        self.trainer_filtered = p + TRAINER_FILTERED
        self.services = p + SERVICES
        self.archived = p + ARCHIVED
        self.trackers = p + TRACKERS
        self.run_config = p + RUN_CONFIG
        self.stored_versions = p + STORED_VERSIONS
        self.version_bases = p + VERSION_BASES
        self.version_manifests = p + VERSION_MANIFESTS
        self.version_rebuilds = p + VERSION_REBUILDS
        self.weight_group = p + WEIGHT_GROUP
        self.weight_group_asks = p + WEIGHT_GROUP_ASKS
        self.replicas = p + REPLICAS
        self.replica_loading = p + REPLICA_LOADING
        self.shards_count = p + SHARDS

    def shard(self, rollout_id: str) -> ShardKeys:
        """The shard that holds a rollout (and its attempts and spans)."""
        shards = self.shards
        return shards[0] if len(shards) == 1 else shards[shard_of(rollout_id, len(shards))]

    def rollout(self, rollout_id: str) -> str:
        return self.shard(rollout_id).prefix + ROLLOUT + rollout_id

    def attempt(self, attempt_id: str) -> str:
        return self.shard(rollout_of_attempt(attempt_id)).prefix + ATTEMPT + attempt_id

    def spans(self, rollout_id: str) -> str:
        return self.shard(rollout_id).prefix + SPANS + rollout_id

    def span_ids(self, rollout_id: str) -> str:
        return self.shard(rollout_id).prefix + SPAN_IDS + rollout_id

    def status(self, status: str) -> str:
        """Shard 0's index of a status (with shards, `ShardKeys.status` of each)."""
        return self.prefix + STATUS + status

    def resources(self, resources_id: str) -> str:
        return self.prefix + RESOURCES + resources_id

    def replayed(self, name: str) -> str:
        return self.prefix + REPLAYED + check_id("replay name", name)

    def trainer_slot(self, rank: int) -> str:
        return self.prefix + TRAINER_SLOT + str(rank)

    def weights(self, model_version: str) -> str:
        return self.prefix + WEIGHTS + model_version

    def pattern(self) -> str:
        """SCAN pattern matching every key of this experiment's shard 0 (braces escaped for glob)."""
        return f"{NAMESPACE}:\\{{{self.experiment}\\}}:*"

    def patterns(self) -> list[str]:
        """SCAN patterns matching every key of this experiment, its other shards' too (whatever
        their number: an experiment deleted with another shard count leaves nothing behind)."""
        return [self.pattern(), f"{NAMESPACE}:\\{{{self.experiment}:shard*\\}}:*"]


def rollout_of_attempt(attempt_id: str) -> str:
    """Inverse of `attempt_id`."""
    return attempt_id.rpartition(".")[0]
