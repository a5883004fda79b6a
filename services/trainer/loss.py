"""A micro-batch's loss and the step's schedule: the arithmetic of one optimizer step, kept apart from
the trainer's loop (`fulmen_trainer.trainer`) that feeds it."""

from __future__ import annotations

import math

import torch

from fulmen.settings import TrainerSettings
from fulmen_trainer.batch import TokenBatch
from fulmen_trainer.logprobs import token_logprobs
from fulmen_trainer.objectives import kl_to_reference, objective
from fulmen_trainer.policy import Policy


def micro_loss(s: TrainerSettings, policy: Policy, micro: TokenBatch, adv: torch.Tensor, logp: torch.Tensor,
               token_entropy: torch.Tensor | None, prox: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A micro-batch's loss (its token mean) and its parts: policy term, entropy, KL to the reference."""
    mask = micro.mask
    loss_fn = objective(s.algorithm)
    if s.algorithm == "sft":
        pg = loss_fn(logp, micro.behaviour_logp, adv, mask * adv[:, None], aggregation=s.loss_aggregation)
    else:
        pg = loss_fn(logp, micro.behaviour_logp, adv, mask, prox_logp=prox, clip_eps=clip_range(s),
                     tis_cap=s.tis_cap, aggregation=s.loss_aggregation)
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
    return pg - s.ent_coef * entropy + s.kl_coef * kl, pg, entropy, kl


def clip_range(s: TrainerSettings) -> float:
    """PPO's clip range; REINFORCE does not clip."""
    return math.inf if s.algorithm == "reinforce" else s.clip_eps


def learning_rate(s: TrainerSettings, step: int) -> float:
    """Linear warm-up over lr_warmup_steps, then linear decay to lr_final over lr_decay_steps."""
    if s.lr_warmup_steps and step < s.lr_warmup_steps:
        return s.learning_rate * (step + 1) / s.lr_warmup_steps
    if s.lr_decay_steps and s.lr_final is not None:
        done = min(1.0, (step - s.lr_warmup_steps) / s.lr_decay_steps)
        return s.learning_rate + (s.lr_final - s.learning_rate) * done
    return s.learning_rate
