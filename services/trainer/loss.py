"""A micro-batch's loss and the step's schedule: the arithmetic of one optimizer step, kept apart from
the trainer's loop (`fulmen_trainer.trainer`) that feeds it; and the recipe's knobs built from the
settings (`recipe_knobs`), the one place where a recipe's defaults meet what the user set."""

from __future__ import annotations

import logging
import math
from typing import TypeVar

import torch

from fulmen.settings import TrainerSettings
from fulmen_trainer.batch import TokenBatch
from fulmen_trainer.logprobs import token_logprobs
from fulmen_trainer.objectives import (
    OverlongPenalty,
    RecipeKnobs,
    clipped_value_loss,
    kl_to_reference,
    objective,
    policy_ratio,
    recipe_defaults,
)
from fulmen_trainer.policy import Policy
from fulmen_trainer.values import ValueTargets

log = logging.getLogger(__name__)
T = TypeVar("T")


def micro_loss(s: TrainerSettings, policy: Policy, micro: TokenBatch, adv: torch.Tensor, logp: torch.Tensor,
               token_entropy: torch.Tensor | None, prox: torch.Tensor, values: ValueTargets | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A micro-batch's loss (its token mean) and its parts: policy term, entropy, KL to the reference.
    ``values``: the value head's values for this micro-batch with their targets (`fulmen_trainer.values`;
    ``adv`` is then per token): the loss includes vf_coef × their `value_loss`."""
    mask = micro.mask
    loss_fn = objective(s.algorithm)
    knobs = recipe_knobs(s)
    if s.algorithm == "sft":
        pg = loss_fn(logp, micro.behaviour_logp, adv, mask * adv[:, None], aggregation=knobs.aggregation)
    else:
        pg = loss_fn(logp, micro.behaviour_logp, adv, mask, prox_logp=prox,
                     clip_eps=(knobs.clip_eps_low, knobs.clip_eps_high), tis_cap=s.tis_cap,
                     aggregation=knobs.aggregation)
    entropy = torch.zeros((), device=policy.device)
    if token_entropy is not None:
        entropy = (token_entropy * mask).sum() / mask.sum().clamp(min=1)
    kl = torch.zeros((), device=policy.device)
    if policy.has_reference:
        with torch.no_grad(), policy.as_reference() as reference, policy.compute():
            # the reference may sit on another device (--reference-device cpu): the batch goes to it
            on_reference = micro.to(next(reference.parameters()).device)
            ref_logp, _ = token_logprobs(reference, on_reference, chunk_tokens=s.logprob_chunk_tokens)
        kl = (kl_to_reference(logp, ref_logp.to(logp.device)) * mask).sum() / mask.sum().clamp(min=1)
    total = pg - s.ent_coef * entropy + s.kl_coef * kl
    if values is not None:
        total = total + knobs.vf_coef * value_loss(s, mask, values)
    return total, pg, entropy, kl


def value_loss(s: TrainerSettings, mask: torch.Tensor, values: ValueTargets) -> torch.Tensor:
    """The clipped value loss of a micro-batch's current values (``values.current``), its token mean."""
    assert values.current is not None, "the value head's values of this micro-batch"
    per_token = clipped_value_loss(values.current, values.old, values.returns, recipe_knobs(s).value_clip)
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def clip_range(s: TrainerSettings) -> float:
    """PPO's clip range below 1 (ε_low); REINFORCE does not clip."""
    return recipe_knobs(s).clip_eps_low


def clip_fraction(s: TrainerSettings, logp: torch.Tensor, prox: torch.Tensor, mask: torch.Tensor) -> float:
    """The share of trained tokens whose ratio to the step's start (their own, or their sequence's
    under gspo) left the clip range [1 - ε_low, 1 + ε_high] (0 in a first pass)."""
    knobs = recipe_knobs(s)
    ratio = policy_ratio(logp, prox, mask, knobs.ratio)
    outside = ((ratio < 1 - knobs.clip_eps_low) | (ratio > 1 + knobs.clip_eps_high)).to(mask.dtype)
    return float((outside * mask).sum() / mask.sum().clamp(min=1))


def recipe_knobs(s: TrainerSettings, *, announce: bool = False) -> RecipeKnobs:
    """``s.algorithm``'s knobs: a knob the user set wins, then the recipe's default, then the generic
    setting (clip_eps, loss_aggregation). Settings a recipe cannot run with raise ValueError (the
    trainer builds these at start). ``announce``: log the knobs, once, at start."""
    d = recipe_defaults(s.algorithm)
    low = _first(s.clip_eps_low, _number(d.get("clip_eps_low")), s.clip_eps)
    high = _first(s.clip_eps_high, _number(d.get("clip_eps_high")), s.clip_eps)
    aggregation = str(d.get("aggregation", s.loss_aggregation))
    if "loss_aggregation" in s.model_fields_set and s.loss_aggregation != aggregation:
        raise ValueError(f"{s.algorithm} averages its loss by {aggregation}; loss_aggregation {s.loss_aggregation} "
                         "contradicts it (unset it)")
    constant = bool(d.get("constant_normaliser", False))
    if constant and s.max_response_length is None:
        raise ValueError(f"{s.algorithm} divides the summed loss by a constant, the rollouts' generation limit: "
                         "set max_response_length (their max_tokens)")
    knobs = RecipeKnobs(
        clip_eps_low=low, clip_eps_high=high, aggregation=aggregation,
        ratio=str(d.get("ratio", "token")), constant_normaliser=constant, max_response_length=s.max_response_length,
        dynamic_sampling=_first(s.dynamic_sampling, bool(d.get("dynamic_sampling", False))),
        overlong=_overlong(s, bool(d.get("overlong_penalty", False))), sft_min_reward=s.sft_min_reward,
        value_head=bool(d.get("value_head", False)), gamma=s.gamma, gae_lambda=s.gae_lambda,
        whiten_advantages=s.whiten_advantages, value_clip=s.value_clip or None, vf_coef=s.vf_coef,
        passes=1 if math.isinf(low) or math.isinf(high) else s.ppo_epochs,
    )
    if announce:
        log.info("recipe %s: clip [1 - %g, 1 + %g], %s ratio, %s mean%s, dynamic sampling %s, overlong penalty %s",
                 s.algorithm, knobs.clip_eps_low, knobs.clip_eps_high, knobs.ratio, knobs.aggregation,
                 f" over samples × {s.max_response_length} tokens" if constant else "",
                 "on" if knobs.dynamic_sampling else "off", knobs.overlong or "off")
        if knobs.passes < s.ppo_epochs:
            log.info("%s does not clip the ratio: one pass per step (ppo_epochs %d is for the clipped recipes)",
                     s.algorithm, s.ppo_epochs)
        if knobs.value_head:
            log.info("value head: GAE γ %g, λ %g, advantages %s, value clip %s, vf_coef %g", knobs.gamma,
                     knobs.gae_lambda, "whitened" if knobs.whiten_advantages else "as they are",
                     knobs.value_clip if knobs.value_clip is not None else "off", knobs.vf_coef)
    return knobs


def _overlong(s: TrainerSettings, recipe_default: bool) -> OverlongPenalty | None:
    """The overlong penalty the settings ask for: an overlong_buffer_len set, else the recipe's (a fifth of
    the generation limit, as DAPO's 4k of 20k), which needs the limit: without it, none."""
    buffer = s.overlong_buffer_len
    if buffer is None and recipe_default and s.max_response_length is not None:
        buffer = max(1, s.max_response_length // 5)
    if not buffer:
        return None
    if s.max_response_length is None:
        raise ValueError("overlong_buffer_len needs max_response_length, the length the penalty ends at")
    if buffer > s.max_response_length:
        raise ValueError(f"overlong_buffer_len {buffer} exceeds max_response_length {s.max_response_length}")
    return OverlongPenalty(s.max_response_length, buffer, s.overlong_penalty_factor)


def _first(*values: T | None) -> T:
    """The first value that is set."""
    return next(v for v in values if v is not None)


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def learning_rate(s: TrainerSettings, step: int) -> float:
    """Linear warm-up over lr_warmup_steps, then linear decay to lr_final over lr_decay_steps."""
    if s.lr_warmup_steps and step < s.lr_warmup_steps:
        return s.learning_rate * (step + 1) / s.lr_warmup_steps
    if s.lr_decay_steps and s.lr_final is not None:
        done = min(1.0, (step - s.lr_warmup_steps) / s.lr_decay_steps)
        return s.learning_rate + (s.lr_final - s.learning_rate) * done
    return s.learning_rate
