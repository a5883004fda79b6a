"""ppo_gae's value head: a linear layer (hidden → 1) on the policy's last hidden state, trained beside the
policy (its full weights or its LoRA adapter), kept in checkpoints beside the model and never published
(a model version holds the policy's weights only); and a step's per-token targets from it: the values
at the step's start, GAE's advantages and the returns. The formulas: docs/design/trainer.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from fulmen_trainer.batch import TokenBatch
from fulmen_trainer.objectives import RecipeKnobs, explained_variance, generalised_advantages, whitened_tokens

log = logging.getLogger(__name__)

VALUE_HEAD_FILE = "value_head.safetensors"  # in a checkpoint's folder, beside model/


def new_value_head(model: Any, device: torch.device) -> torch.nn.Linear:
    """A value head for ``model``: fp32, zero at the start (the first advantages are the returns)."""
    head = torch.nn.Linear(int(model.config.hidden_size), 1)
    torch.nn.init.zeros_(head.weight)
    torch.nn.init.zeros_(head.bias)
    return head.to(device)


def save_value_head(head: torch.nn.Module, folder: Path) -> None:
    save_file({name: t.detach().cpu().contiguous() for name, t in head.state_dict().items()},
              str(folder / VALUE_HEAD_FILE))


def load_value_head(head: torch.nn.Module, folder: Path) -> bool:
    """The head saved in checkpoint ``folder`` into ``head``; False (the head as it is) when it has none."""
    path = folder / VALUE_HEAD_FILE
    if not path.exists():
        log.warning("%s holds no value head (a run without one wrote it): the value head starts at zero", folder)
        return False
    head.load_state_dict(load_file(str(path), device=str(next(head.parameters()).device)))
    return True


@dataclass(frozen=True)
class ValueTargets:
    """A batch's (or a micro-batch's) per-token targets, [B, T-1] as `TokenBatch.mask`: GAE's advantages
    (whitened and weighed as trained), the returns the head learns, the values at the step's start
    (the centre of the value clip); ``current``: the head's values now, with gradients (a micro-batch)."""

    advantages: torch.Tensor
    returns: torch.Tensor
    old: torch.Tensor
    current: torch.Tensor | None = None

    def micro(self, lo: int, hi: int, width: int, device: torch.device) -> ValueTargets:
        """Sequences lo..hi, cut to ``width`` positions (a trimmed micro-batch), on ``device``."""
        return ValueTargets(*(t[lo:hi, :width].to(device) for t in (self.advantages, self.returns, self.old)))

    def with_current(self, values: torch.Tensor | None) -> ValueTargets:
        return replace(self, current=values)


def value_targets(policy: Any, batch: TokenBatch, ranges: list[tuple[int, int]], rewards: torch.Tensor,
                  weights: torch.Tensor, knobs: RecipeKnobs, chunk_tokens: int) -> tuple[ValueTargets, dict[str, float]]:
    """The step's targets: the head's values under the policy at the step's start (a forward without
    gradients per micro-batch ``ranges``), GAE over each sequence's trained tokens with its reward
    (``rewards`` [B]) at the last, the advantages whitened over the step's tokens (a knob) and times
    the samples' ``weights`` (staleness); and the value stream's metrics."""
    old = torch.zeros(batch.mask.shape)
    with torch.no_grad():
        for lo, hi in ranges:
            micro = batch.slice(lo, hi).trimmed()
            _, _, values = policy.score(micro.to(policy.device), chunk_tokens, entropy=False)
            old[lo:hi, : values.shape[1]] = values.float().cpu()
    mask = batch.mask
    advantages, returns = generalised_advantages(rewards, old, mask, gamma=knobs.gamma, lam=knobs.gae_lambda)
    tokens = mask.sum().clamp(min=1)
    metrics = {
        "value/mean": float((old * mask).sum() / tokens),
        "value/return_mean": float((returns * mask).sum() / tokens),
        "value/advantage_mean": float((advantages * mask).sum() / tokens),
        "value/explained_variance": explained_variance(old, returns, mask),
    }
    if knobs.whiten_advantages:
        advantages = whitened_tokens(advantages, mask)
    return ValueTargets(advantages * weights[:, None], returns, old), metrics
