"""Every record Fulmen stores or sends, each with its wire form. One schema version (`fulmen.codec`).

Messages on streams are msgpack maps with ``v`` (schema version) and ``kind``; span records, read
in bulk by the adapter, are positional arrays that start with the same two (`fulmen.records.spans`). Rollouts and attempts change status inside Lua scripts, so they live in
Redis hashes whose plain fields the scripts can read; their free-form parts (input, metadata, error)
are msgpack inside a field.

One module per area, every record importable from here:

    rollouts   RolloutConfig, Rollout, Attempt, AttemptedRollout (hashes)
    spans      Span, SpanView
    status     RolloutStatus, AttemptStatus, RolloutMode, Priority and their transition table
    messages   QueueEntry, RolloutFinished, DeadLetter, ResourcesUpdate, Worker, ProxyEndpoint, WeightsChunk
    samples    Sample, SampleSkip, pack_sample, RolloutForSamples (a finished rollout as the adapter reads it)
    ranks      GradientChunk, GradientHeader, RankPlan
    ops        ServiceBeat, TrainStep
    control    ControlMessage, ControlAction (the proxies' control stream)
    base       Record: the msgpack map form derived from a dataclass's fields
"""

from fulmen.records.base import Record
from fulmen.records.control import ControlAction, ControlMessage
from fulmen.records.messages import (
    DeadLetter,
    ProxyEndpoint,
    QueueEntry,
    ReplicaState,
    ResourcesUpdate,
    RolloutFinished,
    WeightsChunk,
    Worker,
)
from fulmen.records.ops import ServiceBeat, TrainStep
from fulmen.records.ranks import GradientChunk, GradientHeader, RankPlan
from fulmen.records.rollouts import Attempt, AttemptedRollout, Rollout, RolloutConfig
from fulmen.records.samples import RolloutForSamples, Sample, SampleSkip, pack_sample
from fulmen.records.spans import Span, SpanView
from fulmen.records.status import AttemptStatus, Priority, RolloutMode, RolloutStatus

__all__ = [
    "Attempt",
    "AttemptStatus",
    "AttemptedRollout",
    "ControlAction",
    "ControlMessage",
    "DeadLetter",
    "GradientChunk",
    "GradientHeader",
    "Priority",
    "ProxyEndpoint",
    "QueueEntry",
    "RankPlan",
    "Record",
    "ReplicaState",
    "ResourcesUpdate",
    "Rollout",
    "RolloutConfig",
    "RolloutFinished",
    "RolloutForSamples",
    "RolloutMode",
    "RolloutStatus",
    "Sample",
    "SampleSkip",
    "ServiceBeat",
    "Span",
    "SpanView",
    "TrainStep",
    "WeightsChunk",
    "Worker",
    "pack_sample",
]
