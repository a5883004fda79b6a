"""Collecting samples into GRPO groups: a group is the n rollouts of one task, complete when all n
are terminal (a rollout that yielded nothing arrives as a `SampleSkip`, so it still counts).

What is dropped and counted: docs/design/trainer.md.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from dataclasses import dataclass, field

from fulmen.records import Sample, SampleSkip
from fulmen.settings.services import RewardSource, SampleShape, StalePolicy
from fulmen.versions.model_version import ModelVersion

log = logging.getLogger(__name__)
TOO_FEW, ZERO_VARIANCE = "too_few", "zero_variance"  # why a complete group is not trained on


def rollout_reward(sample: Sample, source: str) -> float:
    """The reward a sample trains on: its own call's ("matched", when it has one) or its rollout's last."""
    if source == "matched" and sample.reward is not None:
        return sample.reward
    value = sample.final_reward if sample.final_reward is not None else sample.reward
    return float(value if value is not None else 0.0)


@dataclass
class Group:
    key: str
    size: int | None
    samples: dict[str, list[tuple[str, Sample]]] = field(default_factory=dict)  # rollout → (entry id, sample)
    skipped: dict[str, str] = field(default_factory=dict)  # rollout → entry id of its skip
    first_seen: float = field(default_factory=time.monotonic)

    @property
    def terminal(self) -> int:
        return len(self.samples) + len(self.skipped)

    def entry_ids(self) -> list[str]:
        return [e for pairs in self.samples.values() for e, _ in pairs] + list(self.skipped.values())


@dataclass
class ReadyGroup:
    key: str
    samples: list[Sample]  # the samples to train on, every rollout's
    weights: list[float]  # per sample: 1, or less for a stale one
    entry_ids: list[str]  # every stream entry of the group, trained on or not
    weighed_at: int = 0  # the trainer's model version when the weights were computed
    filtered: bool = False  # left out by dynamic sampling (its rewards all equal), not lost: replaced freely


@dataclass
class GroupCollector:
    """Feed it the samples stream; take the complete groups out.

    ``shape``: train on "triplet" samples (one per LLM call) or "trajectory" samples (one per
    multi-turn conversation; single-turn rollouts fall back to their triplet). ``group_size``: used
    when a sample does not carry its own; a group is also complete once idle for ``idle_s``.
    ``dynamic_sampling`` (DAPO): a group whose rollouts' rewards (by ``reward_source``) are all equal
    is dropped like one with too few rollouts: its advantages would all be zero."""

    group_size: int | None = None
    shape: SampleShape = "triplet"
    max_staleness: int | None = None
    stale_policy: StalePolicy = "drop"
    idle_s: float = 120.0
    # an RL objective: samples re-tokenised from a text-only call (no log-probabilities) are refused
    rl: bool = True
    dynamic_sampling: bool = False
    reward_source: RewardSource = "final"
    groups: dict[str, Group] = field(default_factory=dict)
    counts: Counter[str] = field(default_factory=Counter)

    def add(self, entry_id: str, item: Sample | SampleSkip) -> bool:
        """Take a samples-stream entry; False if it is not for training (a validation or APO rollout):
        the caller then only acknowledges it."""
        if item.mode in ("val", "test"):
            self.counts[f"ignored/{item.mode}"] += 1
            return False
        group = self.groups.get(item.group_key)
        if group is None:
            group = self.groups[item.group_key] = Group(item.group_key, item.group_size or self.group_size)
        if isinstance(item, SampleSkip):
            group.skipped[item.rollout_id] = entry_id
            self.counts[f"skipped/{item.reason}"] += 1
        else:
            group.samples.setdefault(item.rollout_id, []).append((entry_id, item))
        return True

    def pending_samples(self) -> int:
        return sum(len(p) for g in self.groups.values() for p in g.samples.values())

    def take_complete(self, current_version: int) -> list[ReadyGroup]:
        """Remove and return the complete groups, oldest first, filtered and weighted."""
        now = time.monotonic()
        done = [
            g for g in self.groups.values()
            if (g.size is not None and g.terminal >= g.size) or now - g.first_seen > self.idle_s
        ]
        ready = []
        for g in sorted(done, key=lambda g: g.first_seen):
            del self.groups[g.key]
            samples, weights = self._select(g, current_version)
            why = self._untrainable(samples)
            if why is not None:
                ready.append(ReadyGroup(g.key, [], [], g.entry_ids(), current_version, filtered=why == ZERO_VARIANCE))
                continue
            self.counts["groups/complete"] += 1
            ready.append(ReadyGroup(g.key, samples, weights, g.entry_ids(), current_version))
        return ready

    def reweigh(self, group: ReadyGroup, current_version: int) -> ReadyGroup:
        """A complete group that waited for a step while the trainer's version moved on: its samples'
        staleness again, against the version that will train on them (dropped, down-weighted, or the
        whole group dropped as in `take_complete`)."""
        if group.weighed_at == current_version or not group.samples:
            return group
        samples, weights = [], []
        for s in group.samples:
            weight = 1.0 if s.retokenized else self._weight(current_version - ModelVersion.parse(s.model_version).number)
            if weight == 0.0:
                self.counts["samples/dropped_stale"] += 1
                continue
            samples.append(s)
            weights.append(weight)
        why = self._untrainable(samples)
        if why is not None:
            return ReadyGroup(group.key, [], [], group.entry_ids, current_version, filtered=why == ZERO_VARIANCE)
        return ReadyGroup(group.key, samples, weights, group.entry_ids, current_version)

    def _untrainable(self, samples: list[Sample]) -> str | None:
        """Why a group's samples cannot teach anything (counted), or None when they can."""
        if len({s.rollout_id for s in samples}) < 2:
            self.counts["groups/dropped_too_few"] += 1
            return TOO_FEW
        if self.dynamic_sampling:
            # one reward per rollout, its last sample's, as `fulmen_trainer.plan` reads them
            rewards = {s.rollout_id: rollout_reward(s, self.reward_source) for s in samples}
            if len(set(rewards.values())) == 1:
                self.counts["groups/dropped_zero_variance"] += 1
                return ZERO_VARIANCE
        return None

    def _select(self, group: Group, current_version: int) -> tuple[list[Sample], list[float]]:
        samples, weights = [], []
        for pairs in group.samples.values():
            rollout_samples = [s for _, s in pairs]
            trajectories = [s for s in rollout_samples if s.shape == "trajectory"]
            chosen = trajectories if self.shape == "trajectory" and trajectories else [
                s for s in rollout_samples if s.shape == "triplet"
            ]
            for s in chosen:
                if s.retokenized:
                    if self.rl:
                        self._refuse_retokenized(s)
                        continue
                    samples.append(s)  # a teacher's answer: no staleness, the policy did not write it
                    weights.append(1.0)
                    continue
                weight = self._weight(current_version - ModelVersion.parse(s.model_version).number)
                if weight == 0.0:
                    self.counts["samples/dropped_stale"] += 1
                    continue
                if weight < 1.0:
                    self.counts["samples/downweighted_stale"] += 1
                samples.append(s)
                weights.append(weight)
        return samples, weights

    def _refuse_retokenized(self, sample: Sample) -> None:
        if not self.counts["samples/refused_retokenized"]:
            log.warning("sample %s was re-tokenised from a text-only call (a teacher's answer): an RL objective "
                        "needs the serving model's own token ids and log-probabilities, so such samples are "
                        "refused; train on them with --algorithm sft", sample.sample_id)
        self.counts["samples/refused_retokenized"] += 1

    def _weight(self, staleness: int) -> float:
        if self.max_staleness is None or staleness <= self.max_staleness:
            return 1.0
        if self.stale_policy == "drop":
            return 0.0
        return math.pow(0.5, staleness - self.max_staleness)  # halve per version beyond the bound
