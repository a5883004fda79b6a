"""One optimizer step's work, planned before any gradient: the samples, their rewards and advantages,
and the stream entries it consumes. Pure data and arithmetic: the trainer loop and the ranks share it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from fulmen.records import Sample
from fulmen_trainer.groups import ReadyGroup
from fulmen_trainer.objectives import Baseline, group_advantages


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
    return metrics


def rollout_reward(sample: Sample, source: str) -> float:
    if source == "matched" and sample.reward is not None:
        return sample.reward
    value = sample.final_reward if sample.final_reward is not None else sample.reward
    return float(value if value is not None else 0.0)


def plan_step(groups: list[ReadyGroup], algorithm: str, reward_source: str, baseline: Baseline,
              sft_min_reward: float | None = None) -> StepPlan:
    """Advantages per sample. GRPO normalises within each group at the rollout level (a rollout with
    three LLM calls does not count three times), then every sample gets its rollout's advantage."""
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
    reward_t = torch.tensor(rewards, dtype=torch.float)
    if algorithm == "grpo":
        rollouts = {(key, s.rollout_id): i for i, (key, s) in enumerate(zip(keys, samples, strict=True))}
        index = {r: j for j, r in enumerate(rollouts)}
        per_rollout = torch.tensor([rewards[i] for i in rollouts.values()], dtype=torch.float)
        group_of = {key: j for j, key in enumerate(dict.fromkeys(keys))}
        rollout_groups = torch.tensor([group_of[key] for key, _ in rollouts], dtype=torch.long)
        rollout_adv = group_advantages(per_rollout, rollout_groups) if len(per_rollout) else per_rollout
        advantages = torch.stack([rollout_adv[index[(key, s.rollout_id)]] for key, s in zip(keys, samples, strict=True)]) \
            if samples else torch.zeros(0)
    elif algorithm in ("ppo", "reinforce"):
        advantages = baseline.advantages(reward_t) if samples else torch.zeros(0)
    else:  # sft: advantages unused; a sample below the reward threshold gets weight 0
        advantages = torch.zeros(len(samples))
        if sft_min_reward is not None:
            weights = [w if r >= sft_min_reward else 0.0 for w, r in zip(weights, rewards, strict=True)]
    advantages = advantages * torch.tensor(weights, dtype=torch.float) if samples else advantages
    plan = StepPlan(samples, rewards, advantages, keys, entry_ids, dropped)
    if algorithm == "sft":
        plan.stats["sft_weights"] = float(sum(weights))
        plan.advantages = torch.tensor(weights, dtype=torch.float)  # sft reads them as sample weights
    return plan


def nonfinite_plan(plan: StepPlan) -> str | None:
    """Why a step's rewards or advantages make it untrainable (a NaN or an infinity), or None."""
    if not all(math.isfinite(r) for r in plan.rewards):
        return "a reward is not finite"
    if plan.advantages.numel() and not bool(torch.isfinite(plan.advantages).all()):
        return "an advantage is not finite"
    return None
