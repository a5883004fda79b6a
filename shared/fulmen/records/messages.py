"""Stream messages between the services: queue entries, finished rollouts, dead letters, resources,
workers, proxies and weights chunks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from fulmen.records.base import (
    OFF_WIRE,
    Record,
    require,
    require_at_least,
    require_finite,
    require_id,
    require_nonempty,
)
from fulmen.records.status import RolloutStatus


@dataclass(frozen=True, slots=True)
class QueueEntry(Record):
    """One rollout waiting on the queue stream."""

    KIND: ClassVar[str] = "queue"

    rollout_id: str

    def check_wire(self) -> None:
        require_id(self, "rollout_id")


@dataclass(frozen=True, slots=True)
class RolloutFinished(Record):
    """A rollout that reached a terminal status: an entry of the finished stream, appended exactly
    once per rollout."""

    KIND: ClassVar[str] = "rollout_finished"

    rollout_id: str
    status: RolloutStatus
    attempt_id: str | None = None  # None: cancelled before any attempt
    entry_id: str = field(default="", metadata=OFF_WIRE)  # the finished-stream entry id, set when read

    def check_wire(self) -> None:
        require_id(self, "rollout_id")
        if self.attempt_id is not None:
            require_nonempty(self, "attempt_id")


@dataclass(frozen=True, slots=True)
class DeadLetter(Record):
    """A message that could not be processed, kept with the reason for a person to look at."""

    KIND: ClassVar[str] = "dead_letter"

    source: str  # the stream it came from
    entry_id: str  # its entry there
    reason: str
    payload: dict[str, bytes]  # the raw fields of the entry, as they were
    time: float
    dead_letter_id: str = field(default="", metadata=OFF_WIRE)  # its entry on the dead-letter stream, set when read


@dataclass(frozen=True, slots=True)
class ResourcesUpdate(Record):
    """An immutable snapshot of named resources (prompt templates, an LLM endpoint, ...).

    ``version`` is experiment-wide and strictly increasing, so "latest" is always well defined.
    """

    KIND: ClassVar[str] = "resources"

    resources_id: str
    version: int
    resources: dict[str, Any]
    create_time: float
    metadata: dict[str, Any] = field(default_factory=dict)

    def check_wire(self) -> None:
        require_id(self, "resources_id")
        require_at_least(self, 1, "version")
        require_finite(self, "create_time")
        # The one entry every reader interprets (model followers, runners): its version is a name.
        llm = self.resources.get("llm")
        if isinstance(llm, dict):
            version = llm.get("model_version")
            require(self, version is None or (isinstance(version, str) and bool(version)),
                    f"llm model_version {version!r} is not a name (a non-empty string such as 'v5')")


@dataclass(frozen=True, slots=True)
class Worker(Record):
    """A process that claims work (a runner), as it last reported itself."""

    KIND: ClassVar[str] = "worker"

    worker_id: str
    status: str = "idle"  # idle | busy | stopping | stopped
    last_heartbeat_time: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ProxyEndpoint(Record):
    """An LLM proxy as it last registered itself; runners hand its ``base_url`` to agents."""

    KIND: ClassVar[str] = "proxy"

    proxy_id: str
    base_url: str  # ends before /v1, e.g. http://10.0.0.5:8000
    model: str = ""
    model_version: str | None = None
    last_heartbeat_time: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


# A vllm-sync changes no weights of a replica in the first TRACKING_GRACE_S after it recorded it: a
# proxy whose view of the replicas was read less than that long ago knows, without asking Redis,
# that a call it sent to a replica nobody recorded yet did not straddle a load. (The proxy reads its
# view every 0.5 s.)
TRACKING_GRACE_S = 1.5


@dataclass(frozen=True, slots=True)
class ReplicaState(Record):
    """An inference server (a vLLM replica) as its `fulmen vllm-sync` last left it: the model version
    it serves, and whether requests may go to it (not while a new version is being loaded, nor after
    a load that failed). ``generation`` grows with every load, so a reader can tell that the weights
    changed while it was looking."""

    KIND: ClassVar[str] = "replica"

    url: str  # the server's base URL, as the proxies' upstream_urls name it
    model_version: str
    ready: bool
    generation: int = 0
    updated_time: float | None = None
    reason: str = ""  # why not ready, for a person (and `fulmen status`)
    # the model name a request must carry to be served model_version: a LoRA adapter's name when the
    # version was loaded as one, empty for the server's own model
    served_model: str = ""
    # an A/B test's B version (`fulmen.serving.ab`) this replica serves beside it, as a LoRA adapter of
    # that name, to the ``b_split`` fraction of rollouts `fulmen.serving.ab.arm_of` gives B; "" when none
    b_version: str = ""
    b_split: float = 0.0

    def check_wire(self) -> None:
        require_nonempty(self, "url")
        require_nonempty(self, "model_version")
        require_at_least(self, 0, "generation")
        require_finite(self, "b_split", minimum=0.0)


@dataclass(frozen=True, slots=True)
class WeightsChunk(Record):
    """One piece of a model version's safetensors blob: an entry of that version's weights stream."""

    KIND: ClassVar[str] = "weights_chunk"

    model_version: str
    index: int  # 0-based; entry id "0-<index + 1>", so the chunks are in order on the stream
    total: int  # chunks in the whole blob
    sha256: str  # the blob's, as published (`fulmen.versions.blobs.blob_sha256`), not this chunk's
    size: int  # bytes in the whole blob
    data: bytes

    def check_wire(self) -> None:
        require_at_least(self, 0, "index", "size")
        require(self, 0 <= self.index < self.total, f"chunk {self.index} of {self.total}")
