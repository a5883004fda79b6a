"""Every record Fulmen stores or sends, each with its wire form. One place, one schema version.

Messages on streams are msgpack maps with ``v`` (schema version) and ``kind`` (see `fulmen.codec`).
Rollouts and attempts change status inside Lua scripts, so they live in Redis hashes whose plain
fields the scripts can read; their free-form parts (input, metadata, error) are msgpack inside a field.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack

from fulmen import tokens
from fulmen.codec import (
    DEFAULT_MAX_RECORD_BYTES,
    SCHEMA_VERSION,
    check_version,
    pack,
    pack_record,
    unpack,
    unpack_record,
)
from fulmen.errors import InvalidInput, RecordError
from fulmen.status import RETRYABLE_ATTEMPT, AttemptStatus, RolloutMode, RolloutStatus

# --- helpers for hash fields (Redis returns bytes; Lua writes "" for "not set") -------------------


def _s(raw: Mapping[bytes, bytes], name: str) -> str:
    return raw.get(name.encode(), b"").decode()


def _f(raw: Mapping[bytes, bytes], name: str) -> float | None:
    value = raw.get(name.encode(), b"")
    return float(value) if value else None


def _i(raw: Mapping[bytes, bytes], name: str) -> int:
    value = raw.get(name.encode(), b"")
    return int(value) if value else 0


def _blob(raw: Mapping[bytes, bytes], name: str, default: Any) -> Any:
    value = raw.get(name.encode(), b"")
    return unpack(value) if value else default


def _opt(value: float | None) -> str | float:
    return "" if value is None else value


def _positive_or_none(name: str, value: float | None) -> float | None:
    if value is None:
        return None
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise InvalidInput(f"{name} must be a positive number of seconds or None, got {value!r}")
    return value


# --- rollouts and attempts --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RolloutConfig:
    """Retry and timeout policy of one rollout (Agent Lightning's RolloutConfig)."""

    timeout_seconds: float | None = None  # an attempt running longer than this becomes "timeout"
    unresponsive_seconds: float | None = None  # no heartbeat for this long: "unresponsive"
    max_attempts: int = 1  # attempts in all, the first one included
    retry_condition: tuple[str, ...] = ()  # attempt outcomes that trigger a retry

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "timeout_seconds", _positive_or_none("timeout_seconds", self.timeout_seconds)
        )
        object.__setattr__(
            self, "unresponsive_seconds", _positive_or_none("unresponsive_seconds", self.unresponsive_seconds)
        )
        if (
            isinstance(self.max_attempts, bool)
            or not isinstance(self.max_attempts, int)
            or self.max_attempts < 1
        ):
            raise InvalidInput(f"max_attempts must be an integer >= 1, got {self.max_attempts!r}")
        conditions = tuple(dict.fromkeys(str(c) for c in self.retry_condition))
        unknown = set(conditions) - set(RETRYABLE_ATTEMPT)
        if unknown:
            allowed = ", ".join(sorted(RETRYABLE_ATTEMPT))
            raise InvalidInput(f"retry_condition {sorted(unknown)} unknown; allowed: {allowed}")
        object.__setattr__(self, "retry_condition", conditions)

    @classmethod
    def from_dict(cls, value: Mapping[str, Any]) -> RolloutConfig:
        allowed = {"timeout_seconds", "unresponsive_seconds", "max_attempts", "retry_condition"}
        unknown = set(value) - allowed
        if unknown:
            raise InvalidInput(f"unknown rollout config keys {sorted(unknown)}; allowed: {sorted(allowed)}")
        data = dict(value)
        if "retry_condition" in data:
            data["retry_condition"] = tuple(data["retry_condition"] or ())
        return cls(**data)


@dataclass(frozen=True, slots=True)
class Rollout:
    rollout_id: str
    input: Any
    status: RolloutStatus = RolloutStatus.QUEUING
    mode: RolloutMode | None = None
    resources_id: str | None = None
    config: RolloutConfig = field(default_factory=RolloutConfig)
    metadata: dict[str, Any] = field(default_factory=dict)
    enqueue_time: float | None = None
    start_time: float | None = None  # first attempt's start
    end_time: float | None = None  # when it reached a terminal status
    attempt_count: int = 0  # sequence number of the latest attempt
    attempt_id: str | None = None  # the latest attempt, which drives the status

    def to_hash(self, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> dict[str, Any]:
        c = self.config
        return {
            "v": 1,
            "rollout_id": self.rollout_id,
            "status": self.status.value,
            "mode": self.mode.value if self.mode else "",
            "resources_id": self.resources_id or "",
            "input": pack(self.input, max_bytes),
            "metadata": pack(self.metadata, max_bytes),
            "max_attempts": c.max_attempts,
            "retry_on": ",".join(c.retry_condition),
            "timeout_s": _opt(c.timeout_seconds),
            "unresponsive_s": _opt(c.unresponsive_seconds),
            "enqueue_time": _opt(self.enqueue_time),
            "start_time": _opt(self.start_time),
            "end_time": _opt(self.end_time),
            "attempt_n": self.attempt_count,
            "attempt_id": self.attempt_id or "",
        }

    @classmethod
    def from_hash(cls, raw: Mapping[bytes, bytes]) -> Rollout:
        check_version(_i(raw, "v"), "rollout")
        mode = _s(raw, "mode")
        retry_on = _s(raw, "retry_on")
        return cls(
            rollout_id=_s(raw, "rollout_id"),
            input=_blob(raw, "input", None),
            status=RolloutStatus(_s(raw, "status")),
            mode=RolloutMode(mode) if mode else None,
            resources_id=_s(raw, "resources_id") or None,
            config=RolloutConfig(
                timeout_seconds=_f(raw, "timeout_s"),
                unresponsive_seconds=_f(raw, "unresponsive_s"),
                max_attempts=_i(raw, "max_attempts") or 1,
                retry_condition=tuple(retry_on.split(",")) if retry_on else (),
            ),
            metadata=_blob(raw, "metadata", {}),
            enqueue_time=_f(raw, "enqueue_time"),
            start_time=_f(raw, "start_time"),
            end_time=_f(raw, "end_time"),
            attempt_count=_i(raw, "attempt_n"),
            attempt_id=_s(raw, "attempt_id") or None,
        )


@dataclass(frozen=True, slots=True)
class Attempt:
    rollout_id: str
    attempt_id: str
    sequence_id: int  # 1 for the first attempt of the rollout
    status: AttemptStatus
    worker_id: str | None = None
    start_time: float | None = None
    end_time: float | None = None
    last_heartbeat_time: float | None = None
    error: dict[str, Any] | None = None  # {"type", "message", "traceback"} of a failure
    metadata: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_hash(cls, raw: Mapping[bytes, bytes]) -> Attempt:
        check_version(_i(raw, "v"), "attempt")
        return cls(
            rollout_id=_s(raw, "rollout_id"),
            attempt_id=_s(raw, "attempt_id"),
            sequence_id=_i(raw, "sequence_id"),
            status=AttemptStatus(_s(raw, "status")),
            worker_id=_s(raw, "worker_id") or None,
            start_time=_f(raw, "start_time"),
            end_time=_f(raw, "end_time"),
            last_heartbeat_time=_f(raw, "heartbeat_time"),
            error=_blob(raw, "error", None),
            metadata=_blob(raw, "metadata", {}),
        )


@dataclass(frozen=True, slots=True)
class AttemptedRollout:
    """What a runner gets from a claim: the rollout and the attempt it now owns."""

    rollout: Rollout
    attempt: Attempt


# --- spans --------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Span:
    """One OpenTelemetry-shaped span bound to an attempt. The store assigns ``sequence_id``."""

    rollout_id: str
    attempt_id: str
    span_id: str
    name: str
    trace_id: str = ""
    parent_id: str | None = None
    start_time: float | None = None
    end_time: float | None = None
    status_code: str = "UNSET"
    status_message: str = ""
    attributes: dict[str, Any] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    links: list[dict[str, Any]] = field(default_factory=list)
    resource: dict[str, Any] = field(default_factory=dict)
    sequence_id: int = 0  # 0 until stored

    def to_wire(self, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
        fields: dict[str, Any] = {
            "rollout_id": self.rollout_id,
            "attempt_id": self.attempt_id,
            "span_id": self.span_id,
            "name": self.name,
            "trace_id": self.trace_id,
            "parent_id": self.parent_id,
            "start_time": self.start_time,
            "end_time": self.end_time,
            "attributes": self.attributes,
        }
        # The rest only when not the default: most spans have no status, events, links or resource,
        # and each field left out is two objects fewer for every reader to decode (the adapter reads
        # tens of thousands of spans a second). `from_wire` fills in the defaults, so records with and
        # without them are the same schema version.
        if self.status_code != "UNSET":
            fields["status_code"] = self.status_code
        if self.status_message:
            fields["status_message"] = self.status_message
        if self.events:
            fields["events"] = self.events
        if self.links:
            fields["links"] = self.links
        if self.resource:
            fields["resource"] = self.resource
        return pack_record("span", fields, max_bytes)

    @classmethod
    def from_wire(cls, data: bytes, sequence_id: int, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Span:
        d = unpack_record(data, "span", max_bytes)
        del d["v"], d["kind"]
        return cls(**d, sequence_id=sequence_id)


class SpanView:
    """The parts of a stored span record that walking an attempt's span tree needs (the adapter):
    ids, name, times, attributes. Read-only by convention; same attribute names as `Span`.

    The adapter reads 8 spans per rollout at thousands of rollouts a second: building a frozen
    15-field `Span` cost more than decoding the record, so this one is a plain slotted object, and
    `from_wire` decodes in one msgpack call (tuples for arrays, which are cheaper than lists) and
    checks only what the store does not guarantee: the schema version, the kind, and the types of the
    fields used here."""

    __slots__ = ("attempt_id", "attributes", "end_time", "name", "parent_id", "rollout_id", "sequence_id",
                 "span_id", "start_time")

    def __init__(self, sequence_id: int, rollout_id: str, attempt_id: str, span_id: str, parent_id: str | None,
                 name: str, start_time: float | None, end_time: float | None, attributes: dict[str, Any]) -> None:
        self.sequence_id = sequence_id
        self.rollout_id = rollout_id
        self.attempt_id = attempt_id
        self.span_id = span_id
        self.parent_id = parent_id
        self.name = name
        self.start_time = start_time
        self.end_time = end_time
        self.attributes = attributes

    def __repr__(self) -> str:
        return f"SpanView({self.sequence_id}, {self.span_id!r}, {self.name!r})"

    @classmethod
    def from_wire(cls, data: bytes, sequence_id: int, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> SpanView:
        """Decode a span record as `Span.from_wire` would (RecordError for anything it would refuse,
        SchemaVersionError for another version), keeping only the fields above."""
        if len(data) > max_bytes:
            unpack(data, max_bytes)  # raises RecordTooLarge with the usual message
        try:
            d = msgpack.unpackb(data, raw=False, use_list=False, strict_map_key=False)
        except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData) as e:
            raise RecordError(f"not a valid msgpack record: {e}") from e
        if type(d) is not dict:
            raise RecordError(f"a span record must be a map, got {type(d).__name__}")
        if d.get("v") != SCHEMA_VERSION:
            check_version(d.get("v"), "span")
        if d.get("kind") != "span":
            raise RecordError(f"expected a span record, got kind {d.get('kind')!r}")
        try:
            view = cls(sequence_id, d["rollout_id"], d["attempt_id"], d["span_id"], d.get("parent_id"), d["name"],
                       d.get("start_time"), d.get("end_time"), d.get("attributes") or {})
        except KeyError as e:
            raise RecordError(f"span record has no {e.args[0]!r}") from None
        if type(view.span_id) is not str or type(view.name) is not str or type(view.attributes) is not dict:
            raise RecordError("span record has a span_id, name or attributes of the wrong type")
        return view


# --- stream messages ----------------------------------------------------------------------------


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
class Completion:
    """A rollout that reached a terminal status (appended exactly once per rollout)."""

    rollout_id: str
    status: RolloutStatus
    attempt_id: str | None
    entry_id: str = ""  # the completions-stream entry id, set when read

    def to_wire(self) -> bytes:
        return pack_record(
            "completion",
            {"rollout_id": self.rollout_id, "status": self.status.value, "attempt_id": self.attempt_id},
        )

    @classmethod
    def from_wire(cls, data: bytes | None, entry_id: str = "") -> Completion:
        d = unpack_record(data, "completion", required=("rollout_id", "status"))
        try:
            status = RolloutStatus(d["status"])
        except ValueError:
            raise RecordError(f"completion record has unknown status {d['status']!r}") from None
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


# --- training samples (adapter -> trainer) -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sample:
    """One training sample on the samples stream: a (prompt, response, reward) triplet of one LLM call,
    or a whole multi-turn trajectory (``shape`` says which).

    Token ids, log-probabilities and the mask are packed arrays on the wire (`fulmen.tokens`);
    `from_wire` gives lists, and a producer may hand the packed bytes straight in (the adapter does). A trajectory's ``response_token_ids`` hold everything after its first prompt: the model's own
    tokens (``response_mask`` 1, with their log-probabilities) and the tokens the environment added
    between turns (mask 0, log-probability 0.0). A triplet's mask is all ones."""

    sample_id: str  # "<attempt_id>/t<turn>" or "<attempt_id>/traj<first turn>": unique, stable
    shape: str  # "triplet" | "trajectory"
    rollout_id: str
    attempt_id: str
    group_key: str  # the task: GRPO groups the samples of one task
    turn_index: int  # triplet: the LLM call's index in the attempt; trajectory: its first turn
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    response_mask: list[int]
    reward: float | None  # the reward matched to this call (triplet) or the final one (trajectory)
    final_reward: float | None  # the attempt's last reward, for trajectory-level credit
    model_version: str | None
    mode: str | None = None  # train | val | test, from the rollout
    group_size: int | None = None  # rollouts in the group, when the algorithm said
    num_turns: int = 1
    # the last call's request body and response message as the proxy recorded them (JSON text, kept
    # as text: the adapter need not parse them; `messages`, `prompt_text`, `response_text` do, on demand)
    request_json: str = ""
    response_json: str = ""

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The OpenAI chat messages view: the request's messages, then the response (for SFT and APO)."""
        return _chat_view(self.request_json, self.response_json)[0]

    @property
    def prompt_text(self) -> str:
        return _chat_view(self.request_json, self.response_json)[1]

    @property
    def response_text(self) -> str:
        return _chat_view(self.request_json, self.response_json)[2]

    def to_wire(self, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
        return pack_sample({name: getattr(self, name) for name in self.__slots__}, max_bytes)

    @classmethod
    def from_wire(cls, data: bytes | None, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Sample:
        d = unpack_record(data, "sample", max_bytes, required=("sample_id", "shape", "rollout_id"))
        del d["v"], d["kind"]
        try:
            for name in _TOKEN_FIELDS:
                d[name] = tokens.ids(d[name])
            d["response_logprobs"] = tokens.floats(d["response_logprobs"])
            d["response_mask"] = tokens.mask(d["response_mask"])
            return cls(**d)
        except (TypeError, KeyError) as e:
            raise RecordError(f"sample record does not fit: {e!r}") from None


_TOKEN_FIELDS = ("prompt_token_ids", "response_token_ids")


def pack_sample(fields: dict[str, Any], max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
    """The wire form of a `Sample` from its fields (every field of `Sample`, by name, in its order),
    without building the object: the adapter writes thousands a second and needs only the bytes.
    Token ids, log-probabilities and the mask may be lists or packed bytes (bytes pass through).
    ``fields`` is consumed: its arrays are replaced by their packed form."""
    for name in _TOKEN_FIELDS:
        fields[name] = tokens.pack_ids(fields[name])
    fields["response_logprobs"] = tokens.pack_floats(fields["response_logprobs"])
    fields["response_mask"] = tokens.pack_mask(fields["response_mask"])
    return pack_record("sample", fields, max_bytes)


def _chat_view(request_json: str, response_json: str) -> tuple[list[dict[str, Any]], str, str]:
    """(messages, last user text, response text) from a chat or completion request and its response."""
    import json

    try:
        request = json.loads(request_json or "{}")
        response = json.loads(response_json or "null")
    except ValueError:
        return [], "", ""
    if isinstance(request, dict) and isinstance(request.get("messages"), list):
        messages = [m for m in request["messages"] if isinstance(m, dict)]
        prompt = next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "user"), "")
    elif isinstance(request, dict) and isinstance(request.get("prompt"), str):
        prompt = request["prompt"]
        messages = [{"role": "user", "content": prompt}]
    else:
        messages, prompt = [], ""
    if isinstance(response, dict) and "role" in response:
        answer = response
    elif isinstance(response, dict) and isinstance(response.get("text"), str):
        answer = {"role": "assistant", "content": response["text"]}
    else:
        answer = {"role": "assistant", "content": response if isinstance(response, str) else ""}
    return [*messages, answer], prompt, str(answer.get("content") or "")


@dataclass(frozen=True, slots=True)
class SampleSkip:
    """A terminal rollout that yielded no sample, and why; the trainer counts it towards its group's
    completeness (a group is complete when all its rollouts are terminal)."""

    rollout_id: str
    attempt_id: str | None
    group_key: str
    status: str  # the rollout's terminal status
    reason: str  # e.g. "failed", "no LLM call", "no reward", "malformed span: ..."
    mode: str | None = None
    group_size: int | None = None

    def to_wire(self) -> bytes:
        return pack_record("sample_skip", {name: getattr(self, name) for name in self.__slots__})

    @classmethod
    def from_wire(cls, data: bytes | None) -> SampleSkip:
        d = unpack_record(data, "sample_skip", required=("rollout_id", "group_key", "reason"))
        del d["v"], d["kind"]
        try:
            return cls(**d)
        except TypeError as e:
            raise RecordError(f"sample_skip record does not fit: {e}") from None


# --- compressed gradient chunks (trainer rank -> trainer ranks) ----------------------------------


@dataclass(frozen=True, slots=True)
class GradientChunk:
    """One piece of one rank's compressed gradient for one tensor or bucket at one step
    (`fulmen.compression` writes and reads these; ``data`` is a slice of the codec's payload)."""

    fmt: int  # layout version of the codec payloads (fulmen.compression.FORMAT_VERSION)
    step: int
    rank: int
    name: str  # the tensor or bucket this gradient belongs to
    codec: str  # registered codec name ("none", "bf16", "topk", "dgc", "qsgd8", "qsgd4")
    shape: list[int]  # of the gradient before encoding
    dtype: str  # of the gradient before encoding ("float32"); decoding always gives float32
    meta: dict[str, Any]  # what the codec needs to decode the payload (nnz, scale exponent, bucket size...)
    index: int  # 0-based position of this chunk
    count: int  # chunks in the whole payload
    size: int  # bytes in the whole payload
    crc32: int  # zlib.crc32 of this chunk's data
    data: bytes | memoryview

    def to_wire(self, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
        return pack_record("grad_chunk", {name: getattr(self, name) for name in self.__slots__}, max_bytes)

    @classmethod
    def from_wire(cls, data: bytes | None, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> GradientChunk:
        names = cls.__slots__
        d = unpack_record(data, "grad_chunk", max_bytes, required=names)
        types = (int, int, int, str, str, list, str, dict, int, int, int, int, bytes)
        if not all(isinstance(d[n], t) for n, t in zip(names, types, strict=True)):
            raise RecordError("grad_chunk record has a field of the wrong type")
        if not all(isinstance(x, int) and x >= 0 for x in d["shape"]):
            raise RecordError(f"grad_chunk record has a bad shape {d['shape']!r}")
        return cls(*(d[n] for n in names))


@dataclass(frozen=True, slots=True)
class RankPlan:
    """The trainer leader's share of one step for one other rank (trainer rank 0 -> rank n).

    The rank back-propagates ``epochs`` passes over ``samples`` (`Sample` wire records) with these
    ``advantages`` (packed float32, `fulmen.tokens`), scaling its gradient by its tokens over
    ``total_tokens`` (the whole step's). A rank whose step is not ``step_before`` first loads the
    weights of ``model_version``."""

    step: int  # the step being made (step_before + 1)
    rank: int  # the rank this share is for
    step_before: int
    model_version: str
    total_tokens: int
    epochs: int
    samples: list[bytes]
    advantages: bytes
    rewards: list[float]
    group_keys: list[str]

    # a step's samples may exceed one sample's limit: a plan carries up to a whole batch
    MAX_BYTES = 64 << 20

    def to_wire(self) -> bytes:
        return pack_record("rank_plan", {name: getattr(self, name) for name in self.__slots__}, self.MAX_BYTES)

    @classmethod
    def from_wire(cls, data: bytes | None) -> RankPlan:
        names = cls.__slots__
        d = unpack_record(data, "rank_plan", cls.MAX_BYTES, required=names)
        types = (int, int, int, str, int, int, list, bytes, list, list)
        if not all(isinstance(d[n], t) for n, t in zip(names, types, strict=True)):
            raise RecordError("rank_plan record has a field of the wrong type")
        return cls(*(d[n] for n in names))


# --- operations: service heartbeats and the trainer's step summaries (for `fulmen top`) -------------


@dataclass(frozen=True, slots=True)
class ServiceBeat:
    """A long-running service process as it last reported itself (every few seconds)."""

    service: str  # runner, adapter, trainer, algorithm, evaluator, watchdog, ...
    instance: str  # unique per process: "<service>-<host>-<pid>"
    host: str
    pid: int
    port: int | None  # where its /healthz, /readyz, /metrics answer (None: not served)
    started: float
    time: float

    def to_wire(self) -> bytes:
        return pack_record("service", {name: getattr(self, name) for name in self.__slots__})

    @classmethod
    def from_wire(cls, data: bytes | None) -> ServiceBeat:
        d = unpack_record(data, "service", required=cls.__slots__)
        return cls(*(d[n] for n in cls.__slots__))


@dataclass(frozen=True, slots=True)
class TrainStep:
    """One optimizer step as the trainer's leader summarises it: the reward curve's points."""

    step: int
    model_version: str
    reward_mean: float | None
    loss: float | None
    samples: int | None
    time: float

    def to_wire(self) -> bytes:
        return pack_record("train_step", {name: getattr(self, name) for name in self.__slots__})

    @classmethod
    def from_wire(cls, data: bytes | None) -> TrainStep:
        d = unpack_record(data, "train_step", required=cls.__slots__)
        return cls(*(d[n] for n in cls.__slots__))
