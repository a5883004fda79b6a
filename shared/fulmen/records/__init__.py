"""Every record Fulmen stores or sends, each with its wire form. One schema version (`fulmen.codec`).

Messages on streams are msgpack maps with ``v`` (schema version) and ``kind``; span records, read
tens of thousands a second by the adapter, are positional arrays that start with the same two
(`fulmen.records.spans`). Rollouts and attempts change status inside Lua scripts, so they live in
Redis hashes whose plain fields the scripts can read; their free-form parts (input, metadata, error)
are msgpack inside a field.

One module per area, every record importable from here:

    rollouts   RolloutConfig, Rollout, Attempt, AttemptedRollout (hashes)
    spans      Span, SpanView
    messages   QueueEntry, Completion, DeadLetter, ResourcesUpdate, Worker, ProxyEndpoint, WeightsChunk
    samples    Sample, SampleSkip, pack_sample
    ranks      GradientChunk, GradientHeader, RankPlan
    ops        ServiceBeat, TrainStep
"""

from fulmen.records.messages import (
    Completion,
    DeadLetter,
    ProxyEndpoint,
    QueueEntry,
    ResourcesUpdate,
    WeightsChunk,
    Worker,
)
from fulmen.records.ops import ServiceBeat, TrainStep
from fulmen.records.ranks import GradientChunk, GradientHeader, RankPlan
from fulmen.records.rollouts import Attempt, AttemptedRollout, Rollout, RolloutConfig
from fulmen.records.samples import Sample, SampleSkip, pack_sample
from fulmen.records.spans import Span, SpanView

__all__ = [
    "Attempt",
    "AttemptedRollout",
    "Completion",
    "DeadLetter",
    "GradientChunk",
    "GradientHeader",
    "ProxyEndpoint",
    "QueueEntry",
    "RankPlan",
    "ResourcesUpdate",
    "Rollout",
    "RolloutConfig",
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
