"""Advantages and policy losses, as pure functions of tensors, registered by name: the training
recipes (`--algorithm`). A recipe is a policy loss, an advantage function and the defaults of its few
knobs (`RecipeKnobs`); the trainer builds the knobs from its settings (`fulmen_trainer.loss`).

Per-token tensors are ``[B, T]``, aligned as in `fulmen_trainer.batch`. The policy loss is decoupled
PPO with truncated importance sampling; the formulas: docs/design/trainer.md; when to pick which
recipe: docs/guides/recipes.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

Objective = Callable[..., torch.Tensor]
_OBJECTIVES: dict[str, Objective] = {}
_DEFAULTS: dict[str, dict[str, object]] = {}
# What a recipe may set otherwise than the generic settings: `RecipeKnobs` fields, except that
# "overlong_penalty" (a bool) turns DAPO's penalty on when the generation limit is known.
RECIPE_KNOBS = frozenset({"clip_eps_low", "clip_eps_high", "aggregation", "ratio", "constant_normaliser",
                          "dynamic_sampling", "overlong_penalty", "value_head"})


def register_objective(name: str, **defaults: object) -> Callable[[Objective], Objective]:
    """Register a policy loss as ``name``, with the knobs (`RECIPE_KNOBS`) the recipe sets otherwise
    than the generic settings do; a knob the user sets still wins (`fulmen_trainer.loss.recipe_knobs`)."""
    unknown = set(defaults) - RECIPE_KNOBS
    if unknown:
        raise ValueError(f"recipe {name!r}: no knobs {sorted(unknown)}")

    def add(fn: Objective) -> Objective:
        _OBJECTIVES[name] = fn
        _DEFAULTS[name] = defaults
        return fn

    return add


def objective(name: str) -> Objective:
    if name not in _OBJECTIVES:
        raise ValueError(f"algorithm {name!r} unknown; choose one of {sorted(_OBJECTIVES)}")
    return _OBJECTIVES[name]


def recipe_defaults(name: str) -> dict[str, object]:
    """The knobs recipe ``name`` sets otherwise than the generic settings (empty: none)."""
    objective(name)
    return dict(_DEFAULTS[name])


def algorithms() -> list[str]:
    return sorted(_OBJECTIVES)


# --- the knobs -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OverlongPenalty:
    """DAPO's soft overlong punishment: 0 up to ``max_length - buffer`` tokens, then falling linearly to
    ``-factor`` at ``max_length``, and ``-factor`` beyond."""

    max_length: int
    buffer: int
    factor: float = 1.0

    def __call__(self, lengths: torch.Tensor) -> torch.Tensor:
        over = (lengths - (self.max_length - self.buffer)).clamp(min=0)
        return -(over / self.buffer).clamp(max=1.0) * self.factor


@dataclass(frozen=True)
class RecipeKnobs:
    """The knobs of one recipe, as plain numbers (built from the settings by `fulmen_trainer.loss.recipe_knobs`).

    ``clip_eps_low``/``clip_eps_high``: the ratio is clipped to [1 - low, 1 + high] (inf: not clipped).
    ``passes``: optimizer updates per batch: ppo_epochs, but one where the ratio is not clipped (a
    second unclipped pass over the same rollouts moves the policy without bound).
    ``ratio``: "token" (one ratio per token) or "sequence" (GSPO: one per sequence, the geometric mean).
    ``constant_normaliser``: Dr. GRPO: the summed loss is divided by samples × ``max_response_length``
    (the generation limit, a constant) instead of by the tokens trained. ``dynamic_sampling``: a group
    whose rewards are all equal is never trained on. ``overlong``: a penalty added to the rewards of
    long responses. ``value_head``: the policy carries a value head, and the advantages are GAE's per
    token (``gamma``, ``gae_lambda``, whitened over the step when ``whiten_advantages``), its loss
    clipped by ``value_clip`` around the step's start values and weighed by ``vf_coef``."""

    clip_eps_low: float = 0.2
    clip_eps_high: float = 0.2
    aggregation: str = "token"
    ratio: str = "token"
    constant_normaliser: bool = False
    max_response_length: int | None = None
    dynamic_sampling: bool = False
    overlong: OverlongPenalty | None = None
    sft_min_reward: float | None = None
    value_head: bool = False
    gamma: float = 1.0
    gae_lambda: float = 0.95
    whiten_advantages: bool = True
    value_clip: float | None = 0.2
    vf_coef: float = 0.1
    passes: int = 1


# --- advantages ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rewards:
    """One step's rewards where its advantages are computed: one per rollout (the group recipes) or one
    per sample (the others)."""

    values: torch.Tensor  # [R] float
    groups: torch.Tensor  # [R] long: 0..G-1, the task group of each
    tokens: torch.Tensor  # [R] float: the trained tokens behind each (a token-level normalisation weighs by them)


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


AdvantageFn = Callable[[Rewards, Baseline, RecipeKnobs], torch.Tensor]


@dataclass(frozen=True)
class Advantages:
    fn: AdvantageFn
    per_rollout: bool  # one reward per rollout (a rollout of three LLM calls counts once) or per sample
    # the function gives each sample's reward at its last trained token, which the trainer spreads
    # over its tokens by GAE with the value head (`generalised_advantages`)
    per_token: bool = False


_ADVANTAGES: dict[str, Advantages] = {}


def register_advantages(*names: str, per_rollout: bool = True,
                        per_token: bool = False) -> Callable[[AdvantageFn], AdvantageFn]:
    def add(fn: AdvantageFn) -> AdvantageFn:
        for name in names:
            _ADVANTAGES[name] = Advantages(fn, per_rollout, per_token)
        return fn

    return add


def advantages_for(name: str) -> Advantages:
    objective(name)  # an unknown name fails with the list
    return _ADVANTAGES[name]


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


def leave_one_out_advantages(rewards: torch.Tensor, group_index: torch.Tensor) -> torch.Tensor:
    """RLOO: each reward minus the mean of the other rewards of its group (groups of two or more)."""
    groups = int(group_index.max()) + 1 if group_index.numel() else 0
    count = torch.zeros(groups).index_add_(0, group_index, torch.ones_like(rewards))[group_index]
    total = torch.zeros(groups).index_add_(0, group_index, rewards)[group_index]
    return rewards - (total - rewards) / (count - 1).clamp(min=1)


def whitened(values: torch.Tensor, weights: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """``values`` minus their weighted mean, over their weighted (population) standard deviation: the
    whole batch's, each value counted ``weights`` times (its tokens, as a per-token whitening would)."""
    weights = weights / weights.sum().clamp(min=eps)
    mean = (values * weights).sum()
    std = ((values - mean) ** 2 * weights).sum().sqrt()
    return (values - mean) / (std + eps)


@register_advantages("grpo", "dapo", "gspo")
def _grpo_advantages(r: Rewards, baseline: Baseline, knobs: RecipeKnobs) -> torch.Tensor:
    return group_advantages(r.values, r.groups)


@register_advantages("dr_grpo")
def _dr_grpo_advantages(r: Rewards, baseline: Baseline, knobs: RecipeKnobs) -> torch.Tensor:
    return group_advantages(r.values, r.groups, scale=False)  # the group's std would favour easy and hard tasks


@register_advantages("rloo")
def _rloo_advantages(r: Rewards, baseline: Baseline, knobs: RecipeKnobs) -> torch.Tensor:
    return leave_one_out_advantages(r.values, r.groups)


@register_advantages("reinforce_pp")
def _reinforce_pp_advantages(r: Rewards, baseline: Baseline, knobs: RecipeKnobs) -> torch.Tensor:
    """REINFORCE++-baseline: the group's mean subtracted, then whitened over the whole batch's tokens."""
    return whitened(group_advantages(r.values, r.groups, scale=False), r.tokens)


@register_advantages("ppo", "reinforce", per_rollout=False)
def _baseline_advantages(r: Rewards, baseline: Baseline, knobs: RecipeKnobs) -> torch.Tensor:
    return baseline.advantages(r.values)


@register_advantages("ppo_gae", per_rollout=False, per_token=True)
def _terminal_rewards(r: Rewards, baseline: Baseline, knobs: RecipeKnobs) -> torch.Tensor:
    """Not advantages: each sample's reward, paid at its last trained token (GAE makes the advantages)."""
    return r.values


@register_advantages("sft", per_rollout=False)
def _sft_weights(r: Rewards, baseline: Baseline, knobs: RecipeKnobs) -> torch.Tensor:
    """Not advantages: sample weights, 0 below ``sft_min_reward``."""
    if knobs.sft_min_reward is None:
        return torch.ones_like(r.values)
    return (r.values >= knobs.sft_min_reward).float()


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


def constant_normalised(per_token: torch.Tensor, mask: torch.Tensor, max_length: int) -> torch.Tensor:
    """Dr. GRPO's aggregation: the summed loss over sequences × ``max_length`` (a constant, the
    generation limit), so no sequence is divided by its own length. The trainer reaches the same value
    as the token mean times the step's fill ratio (`length_scale`), which adds up across micro-batches."""
    mask = mask.to(per_token.dtype)
    return (per_token * mask).sum() / (per_token.shape[0] * max_length)


def length_scale(tokens: float, sequences: int, max_length: int) -> float:
    """The factor that turns a token mean into Dr. GRPO's constant normalisation:
    Σ loss / (B · L_max) = (Σ loss / T) · T / (B · L_max)."""
    return tokens / max(sequences * max_length, 1)


# --- generalised advantage estimation and the value loss (ppo_gae) ----------------------------------


def generalised_advantages(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, *, gamma: float = 1.0,
                           lam: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE per token: ``rewards`` [B] paid at each sequence's last trained token, ``values`` [B, T] the
    value head's at each position, ``mask`` [B, T] the trained tokens (the steps of the estimate: an
    untrained token between two turns, a tool's output, is skipped). δ_t = r_t + γ V_next - V_t and
    A_t = δ_t + γ λ A_next, with V and A 0 after the last token. Returns (advantages, returns = A + V),
    both [B, T] and 0 off the mask."""
    mask = mask.to(values.dtype)
    rows, positions = values.shape
    trained = mask > 0
    last = torch.where(trained, torch.arange(positions, device=values.device).expand_as(mask), -1).amax(-1)
    next_value = values.new_zeros(rows)
    next_advantage = values.new_zeros(rows)
    advantages = torch.zeros_like(values)
    for t in reversed(range(positions)):
        reward = torch.where(last == t, rewards.to(values.dtype), 0.0)
        delta = reward + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        here = trained[:, t]
        advantages[:, t] = torch.where(here, advantage, 0.0)
        next_value = torch.where(here, values[:, t], next_value)
        next_advantage = torch.where(here, advantage, next_advantage)
    return advantages, (advantages + values) * mask


def whitened_tokens(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Per-token ``values`` [B, T] shifted and scaled to mean 0, std 1 over the trained tokens (0 off them)."""
    mask = mask.to(values.dtype)
    count = mask.sum().clamp(min=1)
    mean = (values * mask).sum() / count
    std = (((values - mean) ** 2) * mask).sum().div(count).sqrt()
    return (values - mean) / (std + eps) * mask


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
                       clip: float | None = 0.2) -> torch.Tensor:
    """PPO's value loss per token [B, T]: ½ max((V - R)², (V_clip - R)²), V_clip = V_old + clamp(V - V_old,
    ±``clip``), so a step cannot move a value far from where the step began by chasing its return
    (``clip`` None: ½ (V - R)²)."""
    plain = (values - returns) ** 2
    if clip is None:
        return 0.5 * plain
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum(plain, (clipped - returns) ** 2)


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(R - V) / Var(R) over the trained tokens: 1 a perfect value, 0 no better than the mean,
    below 0 worse (0 when the returns do not vary: nothing to explain)."""
    mask = mask.to(values.dtype)
    count = mask.sum().clamp(min=1)

    def var(x: torch.Tensor) -> torch.Tensor:
        mean = (x * mask).sum() / count
        return (((x - mean) ** 2) * mask).sum() / count

    spread = float(var(returns))
    return 1.0 - float(var(returns - values)) / spread if spread > 0 else 0.0


# --- per-token policy losses -----------------------------------------------------------------------


def sequence_ratio(logp: torch.Tensor, prox_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """GSPO's importance ratio, one per sequence [B]: the geometric mean of its tokens' ratios,
    exp(mean over its trained tokens of log π_θ - log π_prox)."""
    mask = mask.to(logp.dtype)
    return torch.exp(((logp - prox_logp) * mask).sum(-1) / mask.sum(-1).clamp(min=1))


def policy_ratio(logp: torch.Tensor, prox_logp: torch.Tensor, mask: torch.Tensor, level: str = "token") -> torch.Tensor:
    """π_θ / π_prox per token [B, T]: each token's own ("token") or its sequence's ("sequence")."""
    if level == "token":
        return torch.exp(logp - prox_logp)
    if level == "sequence":
        return sequence_ratio(logp, prox_logp, mask)[:, None].expand_as(logp)
    raise ValueError(f"importance ratio {level!r} unknown; use token or sequence")


def clipped_policy_loss(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    prox_logp: torch.Tensor | None = None,
    clip_eps: float | tuple[float, float] = 0.2,
    tis_cap: float = 2.0,
    ratio: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Decoupled PPO-clip with truncated importance sampling, per token [B, T]. ``clip_eps``: ε, the
    ratio clipped to [1 - ε, 1 + ε], or (ε_low, ε_high) for [1 - ε_low, 1 + ε_high] (DAPO's clip-higher).

    ``advantages`` is [B] (one per sequence) or [B, T]. ``ratio``: π_θ/π_prox per token (default:
    each token's own; `policy_ratio`). Returns the per-token loss and diagnostics (ratio, importance
    weight, clipped fraction), all [B, T]."""
    if advantages.dim() == 1:
        advantages = advantages[:, None].expand_as(logp)
    prox = logp.detach() if prox_logp is None else prox_logp
    weight = torch.exp(prox - behaviour_logp).clamp(max=tis_cap)
    if ratio is None:
        ratio = torch.exp(logp - prox)
    low, high = clip_eps if isinstance(clip_eps, tuple) else (clip_eps, clip_eps)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1 - low, 1 + high) * advantages
    loss = -weight * torch.minimum(unclipped, clipped)
    return loss, {"ratio": ratio.detach(), "is_weight": weight, "clipped": (clipped < unclipped).float()}


@register_objective("grpo")
@register_objective("ppo")
@register_objective("ppo_gae", value_head=True)
@register_objective("reinforce", clip_eps_low=math.inf, clip_eps_high=math.inf)
@register_objective("rloo")
@register_objective("reinforce_pp")
@register_objective("dr_grpo", aggregation="token", constant_normaliser=True)
@register_objective("dapo", clip_eps_high=0.28, aggregation="token", dynamic_sampling=True, overlong_penalty=True)
def policy_gradient(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    prox_logp: torch.Tensor | None = None,
    clip_eps: float | tuple[float, float] = 0.2,
    tis_cap: float = 2.0,
    aggregation: str = "token",
) -> torch.Tensor:
    """The policy-gradient term; the recipes differ in their advantages (`advantages_for`) and knobs."""
    loss, _ = clipped_policy_loss(logp, behaviour_logp, advantages, prox_logp=prox_logp, clip_eps=clip_eps,
                                  tis_cap=tis_cap)
    return aggregate(loss, mask, aggregation)


@register_objective("gspo", clip_eps_low=3e-4, clip_eps_high=4e-4, aggregation="sequence", ratio="sequence")
def sequence_policy_gradient(
    logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    prox_logp: torch.Tensor | None = None,
    clip_eps: float | tuple[float, float] = (3e-4, 4e-4),
    tis_cap: float = 2.0,
    aggregation: str = "sequence",
) -> torch.Tensor:
    """GSPO: the clipped term with one importance ratio per sequence (`sequence_ratio`), clipped per
    sequence, so a sequence is kept or clipped whole; its tokens share its gradient."""
    prox = logp.detach() if prox_logp is None else prox_logp
    loss, _ = clipped_policy_loss(logp, behaviour_logp, advantages, prox_logp=prox, clip_eps=clip_eps,
                                  tis_cap=tis_cap, ratio=policy_ratio(logp, prox, mask, "sequence"))
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
