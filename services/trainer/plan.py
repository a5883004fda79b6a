"""One optimizer step's work, planned before any gradient: the samples, their rewards and advantages,
and the stream entries it consumes. Pure data and arithmetic: the trainer loop and the ranks share it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fulmen.records import Sample
from fulmen_trainer.groups import ReadyGroup, rollout_reward
from fulmen_trainer.objectives import Advantages, Baseline, RecipeKnobs, Rewards, advantages_for, length_scale
from fulmen_trainer.values import ValueTargets


@dataclass
class StepPlan:
    """One optimizer step's work: the samples, their advantages, and every stream entry it consumes."""

    samples: list[Sample]
    rewards: list[float]
    advantages: torch.Tensor
    group_keys: list[str]
    entry_ids: list[str]
    dropped_groups: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    # The policy's log-probabilities at the start of the step, one [B, T-1] tensor per micro-batch:
    # recorded by the first pass, the centre of the clip in the later ones (see `Trainer._backward`).
    prox_logp: list[torch.Tensor] | None = None
    # ppo_gae: ``advantages`` are each sample's reward at its last token, and ``weights`` the samples'
    # (staleness) weights; the first pass turns them into per-token targets (`fulmen_trainer.values`)
    weights: torch.Tensor | None = None
    value_targets: ValueTargets | None = None

    def share(self, lo: int, hi: int) -> StepPlan:
        """Samples lo..hi: one rank's part of the step (the entries and counts stay the whole step's).
        Keep one share object over a step's passes: it carries the step's π_prox."""
        return StepPlan(self.samples[lo:hi], self.rewards[lo:hi], self.advantages[lo:hi], self.group_keys[lo:hi],
                        self.entry_ids, self.dropped_groups)


def merge_passes(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """A step's metrics from its PPO passes: the first pass's (the batch under the policy the step
    started from, comparable whatever ppo_epochs is), plus where the last pass ended."""
    metrics = dict(passes[0])
    metrics["loss/clip_frac"] = passes[-1]["loss/clip_frac"]
    metrics["loss/policy_last_pass"] = passes[-1]["loss/policy"]
    metrics["loss/ppo_epochs"] = len(passes)
    if "loss/value" in passes[-1]:
        metrics["loss/value_last_pass"] = passes[-1]["loss/value"]
    return metrics


def plan_step(groups: list[ReadyGroup], algorithm: str, reward_source: str, baseline: Baseline,
              knobs: RecipeKnobs | None = None) -> StepPlan:
    """Advantages per sample, by the recipe's advantage function (`advantages_for`). The group recipes
    compute them at the rollout level (a rollout with three LLM calls does not count three times), then
    every sample gets its rollout's advantage. ``knobs``: the recipe's (default: the generic ones)."""
    knobs = knobs or RecipeKnobs()
    samples, weights, keys, entry_ids = [], [], [], []
    dropped = 0
    for g in groups:
        entry_ids += g.entry_ids
        if not g.samples:
            dropped += 1
            continue
        samples += g.samples
        weights += g.weights
        keys += [g.key] * len(g.samples)
    rewards = [rollout_reward(s, reward_source) for s in samples]
    if not samples:
        return StepPlan(samples, rewards, torch.zeros(0), keys, entry_ids, dropped)
    tokens = torch.tensor([float(sum(s.response_mask)) for s in samples])
    spec = advantages_for(algorithm)
    advantages = _advantages(spec, samples, keys, rewards, tokens, baseline, knobs)
    if spec.per_token:  # rewards for GAE: weighed once spread over the tokens, not before
        plan = StepPlan(samples, rewards, advantages, keys, entry_ids, dropped)
        plan.weights = torch.tensor(weights, dtype=torch.float)
        return plan
    advantages = advantages * torch.tensor(weights, dtype=torch.float)
    if knobs.constant_normaliser:  # Dr. GRPO: the trainer's token mean becomes Σ loss / (B · L_max)
        assert knobs.max_response_length is not None
        advantages = advantages * length_scale(float(tokens.sum()), len(samples), knobs.max_response_length)
    return StepPlan(samples, rewards, advantages, keys, entry_ids, dropped)


def _advantages(spec: Advantages, samples: list[Sample], keys: list[str], rewards: list[float],
                tokens: torch.Tensor, baseline: Baseline, knobs: RecipeKnobs) -> torch.Tensor:
    """Each sample's advantage: from one reward per sample, or per rollout (its last sample's), with the
    overlong penalty of the rollout's longest sample added to it."""
    reward_t = torch.tensor(rewards, dtype=torch.float)
    penalty = knobs.overlong(tokens) if knobs.overlong is not None else torch.zeros_like(reward_t)
    group_of = {key: j for j, key in enumerate(dict.fromkeys(keys))}
    if not spec.per_rollout:
        groups = torch.tensor([group_of[key] for key in keys], dtype=torch.long)
        return spec.fn(Rewards(reward_t + penalty, groups, tokens), baseline, knobs)
    rollout_of = [(key, s.rollout_id) for key, s in zip(keys, samples, strict=True)]
    last = {r: i for i, r in enumerate(rollout_of)}  # a rollout's reward: its last sample's
    index = {r: j for j, r in enumerate(last)}
    of_sample = torch.tensor([index[r] for r in rollout_of], dtype=torch.long)
    # the penalty of the rollout's longest sample (penalties are <= 0: the minimum)
    worst = torch.zeros(len(last)).scatter_reduce_(0, of_sample, penalty, "amin")
    per_rollout = reward_t[list(last.values())] + worst
    rollout_groups = torch.tensor([group_of[key] for key, _ in last], dtype=torch.long)
    rollout_tokens = torch.zeros(len(last)).index_add_(0, of_sample, tokens)
    return spec.fn(Rewards(per_rollout, rollout_groups, rollout_tokens), baseline, knobs)[of_sample]


def nonfinite_plan(plan: StepPlan) -> str | None:
    """Why a step's rewards or advantages make it untrainable (a NaN or an infinity), or None."""
    if not all(math.isfinite(r) for r in plan.rewards):
        return "a reward is not finite"
    if plan.advantages.numel() and not bool(torch.isfinite(plan.advantages).all()):
        return "an advantage is not finite"
    return None
