"""Stream messages between the services: queue entries, finished rollouts, dead letters, resources,
workers, proxies and weights chunks."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fulmen.codec import (
    DEFAULT_MAX_RECORD_BYTES,
    pack_record,
    unpack_record,
)
from fulmen.errors import RecordError
from fulmen.records.status import RolloutStatus


@dataclass(frozen=True, slots=True)
class QueueEntry:
    """One rollout waiting on the queue stream."""

    rollout_id: str

    def to_wire(self) -> bytes:
        return pack_record("queue", {"rollout_id": self.rollout_id})

    @classmethod
    def from_wire(cls, data: bytes) -> QueueEntry:
        d = unpack_record(data, "queue", required=("rollout_id",))
        if not isinstance(d["rollout_id"], str):
            raise RecordError("queue record's rollout_id is not a string")
        return cls(d["rollout_id"])


@dataclass(frozen=True, slots=True)
class RolloutFinished:
    """A rollout that reached a terminal status: an entry of the finished stream, appended exactly
    once per rollout."""

    rollout_id: str
    status: RolloutStatus
    attempt_id: str | None
    entry_id: str = ""  # the finished-stream entry id, set when read

    def to_wire(self) -> bytes:
        return pack_record(
            "rollout_finished",
            {"rollout_id": self.rollout_id, "status": self.status.value, "attempt_id": self.attempt_id},
        )

    @classmethod
    def from_wire(cls, data: bytes | None, entry_id: str = "") -> RolloutFinished:
        d = unpack_record(data, "rollout_finished", required=("rollout_id", "status"))
        try:
            status = RolloutStatus(d["status"])
        except ValueError:
            raise RecordError(f"rollout_finished record has unknown status {d['status']!r}") from None
        return cls(d["rollout_id"], status, d.get("attempt_id"), entry_id)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """A message that could not be processed, kept with the reason for a person to look at."""

    source: str  # the stream it came from
    entry_id: str
    reason: str
    payload: dict[str, bytes]  # the raw fields of the entry, as they were
    time: float
    dead_letter_id: str = ""

    def to_wire(self) -> bytes:
        return pack_record(
            "dead_letter",
            {
                "source": self.source,
                "entry_id": self.entry_id,
                "reason": self.reason,
                "payload": self.payload,
                "time": self.time,
            },
        )

    @classmethod
    def from_wire(cls, data: bytes, dead_letter_id: str = "") -> DeadLetter:
        d = unpack_record(data, "dead_letter")
        del d["v"], d["kind"]
        return cls(**d, dead_letter_id=dead_letter_id)


@dataclass(frozen=True, slots=True)
class ResourcesUpdate:
    """An immutable snapshot of named resources (prompt templates, an LLM endpoint, ...).

    ``version`` is experiment-wide and strictly increasing, so "latest" is always well defined.
    """

    resources_id: str
    version: int
    resources: dict[str, Any]
    create_time: float
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_wire(self, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
        return pack_record(
            "resources",
            {
                "resources_id": self.resources_id,
                "version": self.version,
                "resources": self.resources,
                "create_time": self.create_time,
                "metadata": self.metadata,
            },
            max_bytes,
        )

    @classmethod
    def from_wire(cls, data: bytes, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> ResourcesUpdate:
        d = unpack_record(data, "resources", max_bytes)
        del d["v"], d["kind"]
        return cls(**d)


@dataclass(frozen=True, slots=True)
class Worker:
    """A process that claims work (a runner), as it last reported itself."""

    worker_id: str
    status: str = "idle"  # idle | busy | stopping | stopped
    last_heartbeat_time: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> bytes:
        return pack_record(
            "worker",
            {
                "worker_id": self.worker_id,
                "status": self.status,
                "last_heartbeat_time": self.last_heartbeat_time,
                "metadata": self.metadata,
            },
        )

    @classmethod
    def from_wire(cls, data: bytes) -> Worker:
        d = unpack_record(data, "worker")
        del d["v"], d["kind"]
        return cls(**d)


@dataclass(frozen=True, slots=True)
class ProxyEndpoint:
    """An LLM proxy as it last registered itself; runners hand its ``base_url`` to agents."""

    proxy_id: str
    base_url: str  # ends before /v1, e.g. http://10.0.0.5:8000
    model: str = ""
    model_version: str | None = None
    last_heartbeat_time: float | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_wire(self) -> bytes:
        return pack_record(
            "proxy",
            {
                "proxy_id": self.proxy_id,
                "base_url": self.base_url,
                "model": self.model,
                "model_version": self.model_version,
                "last_heartbeat_time": self.last_heartbeat_time,
                "metadata": self.metadata,
            },
        )

    @classmethod
    def from_wire(cls, data: bytes) -> ProxyEndpoint:
        d = unpack_record(data, "proxy", required=("proxy_id", "base_url"))
        del d["v"], d["kind"]
        return cls(**d)


@dataclass(frozen=True, slots=True)
class WeightsChunk:
    """One piece of a model version's safetensors blob: an entry of that version's weights stream."""

    model_version: str
    index: int  # 0-based; entry id "0-<index + 1>", so the chunks are in order on the stream
    total: int  # chunks in the whole blob
    sha256: str  # hex digest of the whole blob, not of this chunk
    size: int  # bytes in the whole blob
    data: bytes

    def to_wire(self, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
        return pack_record(
            "weights_chunk",
            {
                "model_version": self.model_version,
                "index": self.index,
                "total": self.total,
                "sha256": self.sha256,
                "size": self.size,
                "data": self.data,
            },
            max_bytes,
        )

    @classmethod
    def from_wire(cls, data: bytes | None, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> WeightsChunk:
        names = ("model_version", "index", "total", "sha256", "size", "data")
        d = unpack_record(data, "weights_chunk", max_bytes, required=names)
        types = (str, int, int, str, int, bytes)
        if not all(isinstance(d[n], t) for n, t in zip(names, types, strict=True)):
            raise RecordError("weights_chunk record has a field of the wrong type")
        return cls(*(d[n] for n in names))
