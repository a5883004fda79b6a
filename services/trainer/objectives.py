"""Advantages and policy losses, as pure functions of tensors (registered by name, no if/elif chains).

Per-token tensors are ``[B, T]``, aligned as in `fulmen_trainer.batch`. The policy loss is decoupled
PPO with truncated importance sampling; the formula: docs/design/trainer.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

Objective = Callable[..., torch.Tensor]
_OBJECTIVES: dict[str, Objective] = {}


def register_objective(name: str) -> Callable[[Objective], Objective]:
    def add(fn: Objective) -> Objective:
        _OBJECTIVES[name] = fn
        return fn

    return add


def objective(name: str) -> Objective:
    if name not in _OBJECTIVES:
        raise ValueError(f"algorithm {name!r} unknown; choose one of {sorted(_OBJECTIVES)}")
    return _OBJECTIVES[name]


def algorithms() -> list[str]:
    return sorted(_OBJECTIVES)


# --- advantages ------------------------------------------------------------------------------------


def group_advantages(rewards: torch.Tensor, group_index: torch.Tensor, *, scale: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each reward minus its group's mean, divided by the group's standard deviation (population,
    i.e. over the n samples themselves) when ``scale``. ``group_index`` [B] numbers the groups 0..G-1."""
    groups = int(group_index.max()) + 1 if group_index.numel() else 0
    count = torch.zeros(groups).index_add_(0, group_index, torch.ones_like(rewards))
    mean = torch.zeros(groups).index_add_(0, group_index, rewards) / count
    centred = rewards - mean[group_index]
    if not scale:
        return centred
    var = torch.zeros(groups).index_add_(0, group_index, centred**2) / count
    return centred / (var.sqrt()[group_index] + eps)


@dataclass
class Baseline:
    """REINFORCE's baseline: an exponential moving average of the rewards seen so far."""

    decay: float = 0.9
    value: float | None = None

    def advantages(self, rewards: torch.Tensor) -> torch.Tensor:
        baseline = float(rewards.mean()) if self.value is None else self.value
        advantages = rewards - baseline
        batch_mean = float(rewards.mean())
        self.value = batch_mean if self.value is None else self.decay * self.value + (1 - self.decay) * batch_mean
        return advantages


# --- aggregation -----------------------------------------------------------------------------------


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, how: str = "token") -> torch.Tensor:
    """"token": mean over every trained token of the batch (long answers weigh more);
    "sequence": mean over each sequence's tokens, then over sequences (each sample weighs the same)."""
    mask = mask.to(per_token.dtype)
    if how == "token":
        return (per_token * mask).sum() / mask.sum().clamp(min=1)
    if how == "sequence":
        per_sequence = (per_token * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        return per_sequence[mask.sum(-1) > 0].mean() if bool((mask.sum(-1) > 0).any()) else per_token.sum() * 0
    raise ValueError(f"loss aggregation {how!r} unknown; use token or sequence")


# --- per-token policy losses -----------------------------------------------------------------------


def clipped_policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    prox_logp: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    tis_cap: float = 2.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO-clip with truncated importance sampling, per token [B, T].

    ``advantages`` is [B] (one per sequence) or [B, T]. Returns the per-token loss and diagnostics
    (ratio, importance weight, clipped fraction), all [B, T]."""
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    prox = logp.detach() if prox_logp is None else prox_logp
    weight = torch.exp(prox - behaviour_logp).clamp(max=tis_cap)
    ratio = torch.exp(logp - prox)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
    loss = -weight * torch.minimum(unclipped, clipped)
    return loss, {"ratio": ratio.detach(), "is_weight": weight, "clipped": (clipped < unclipped).float()}


@register_objective("grpo")
@register_objective("ppo")
@register_objective("reinforce")
def policy_gradient(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    prox_logp: torch.Tensor | None = None,
    clip_eps: float = 0.2,
    tis_cap: float = 2.0,
    aggregation: str = "token",
) -> torch.Tensor:
    """The policy-gradient term; the algorithms differ in their advantages (see `advantages_for`)."""
    loss, _ = clipped_policy_loss(
        logp, behaviour_logp, advantages, prox_logp=prox_logp, clip_eps=clip_eps, tis_cap=tis_cap
    )
    return aggregate(loss, mask, aggregation)


@register_objective("sft")
def sft(logp: torch.Tensor, behaviour_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
        *, aggregation: str = "token", **_: object) -> torch.Tensor:
    """Negative log-likelihood of the masked tokens (behaviour log-probabilities and advantages unused)."""
    return aggregate(-logp, mask, aggregation)


def kl_to_reference(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """Per-token KL(π_θ ‖ π_ref) by Schulman's k3 estimator: unbiased, always ≥ 0, low variance."""
    delta = ref_logp - logp
    return torch.exp(delta) - delta - 1


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of the next-token distribution, [B, T]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(-1)
