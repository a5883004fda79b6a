"""Every record Fulmen stores or sends, each with its wire form. One schema version (`fulmen.codec`).

One module per area (rollouts, spans, status, messages, samples, ranks, ops, control, rebuilds, weight_groups; `base` for
`Record`), every record importable from here. Wire forms and why: docs/design/records.md.
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
from fulmen.records.rebuilds import RebuildAction, VersionRebuild
from fulmen.records.rollouts import Attempt, AttemptedRollout, Rollout, RolloutConfig
from fulmen.records.samples import RolloutForSamples, Sample, SampleSkip, pack_sample
from fulmen.records.spans import Span, SpanView
from fulmen.records.status import AttemptStatus, Priority, RolloutMode, RolloutStatus
from fulmen.records.weight_groups import WeightGroupAction, WeightGroupAsk

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
    "RebuildAction",
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
    "VersionRebuild",
    "WeightGroupAction",
    "WeightGroupAsk",
    "WeightsChunk",
    "Worker",
    "pack_sample",
]
