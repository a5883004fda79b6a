"""Each loss knob changes the loss the trainer steps on (`micro_loss`), in the direction it promises."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import Sample
from fulmen.settings import TrainerSettings, load_settings
from fulmen_trainer.batch import TokenBatch, make_batch
from fulmen_trainer.loss import micro_loss
from fulmen_trainer.objectives import entropy_from_logits
from fulmen_trainer.policy import Policy

CPU = torch.device("cpu")


def _settings(**knobs: Any) -> TrainerSettings:
    return load_settings(TrainerSettings, **knobs)


def _tokens(mask: list[list[float]], behaviour_logp: torch.Tensor) -> TokenBatch:
    """A batch for the pure cases: only the mask and the proxy's log-probs are read without a model."""
    rows, positions = len(mask), len(mask[0])
    return TokenBatch(
        torch.zeros((rows, positions + 1), dtype=torch.long), torch.ones((rows, positions + 1), dtype=torch.long),
        torch.tensor(mask), behaviour_logp, torch.zeros(rows), torch.zeros(rows, dtype=torch.long),
        torch.zeros(rows), [f"s{i}" for i in range(rows)],
    )


def _loss(s: TrainerSettings, micro: TokenBatch, adv: torch.Tensor, logp: torch.Tensor,
          entropy: torch.Tensor | None = None, prox: torch.Tensor | None = None,
          policy: Policy | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    policy = policy or Policy(None, s, CPU)  # no reference: the KL term stays 0
    return micro_loss(s, policy, micro, adv, logp, entropy, logp.detach() if prox is None else prox)


# --- the clip range and the importance weight's cap: pure functions of the log-probs ---------------------


def _ratio_gradients(s: TrainerSettings, advantage: float, ratio_log: float) -> torch.Tensor:
    """d loss / d logp for two tokens: the first with π_θ/π_prox = e^ratio_log, the second at ratio 1."""
    logp = torch.tensor([[-1.0, -1.0]], requires_grad=True)
    prox = torch.tensor([[-1.0 - ratio_log, -1.0]])
    micro = _tokens([[1.0, 1.0]], prox.clone())  # behaviour = prox: importance weight 1
    loss, *_ = _loss(s, micro, torch.tensor([advantage]), logp, prox=prox)
    loss.backward()
    assert logp.grad is not None
    return logp.grad[0]


def test_a_ratio_above_the_clip_range_with_a_positive_advantage_gets_no_gradient() -> None:
    """clip_eps 0.2, ratio e^0.3 ≈ 1.35 and A > 0: no gradient there; clip_eps 0.5 lets it through."""
    clipped = _ratio_gradients(_settings(clip_eps=0.2), advantage=1.0, ratio_log=0.3)
    assert clipped[0] == 0.0 and clipped[1] < 0  # the in-range token still pushes its log-prob up
    wide = _ratio_gradients(_settings(clip_eps=0.5), advantage=1.0, ratio_log=0.3)
    assert wide[0] == pytest.approx(-math.e**0.3 / 2)  # -ratio · A over the 2 tokens' mean


def test_a_ratio_below_the_clip_range_with_a_negative_advantage_gets_no_gradient() -> None:
    """The other side: ratio e^-0.3 ≈ 0.74 < 0.8 and A < 0: no gradient; inside clip_eps 0.5 it has one."""
    assert _ratio_gradients(_settings(clip_eps=0.2), advantage=-1.0, ratio_log=-0.3)[0] == 0.0
    assert _ratio_gradients(_settings(clip_eps=0.5), advantage=-1.0, ratio_log=-0.3)[0] > 0


def test_reinforce_does_not_clip() -> None:
    """algorithm reinforce: the same out-of-range ratio keeps its gradient whatever clip_eps says."""
    grads = _ratio_gradients(_settings(algorithm="reinforce", clip_eps=0.2), advantage=1.0, ratio_log=0.3)
    assert grads[0] == pytest.approx(-math.e**0.3 / 2)


def test_tis_cap_bounds_the_importance_weight() -> None:
    """A proxy far less likely than the policy (π_prox/π_behaviour = e^3): the weight is the cap."""
    logp = torch.tensor([[-1.0]])
    micro = _tokens([[1.0]], torch.tensor([[-4.0]]))
    low, *_ = _loss(_settings(tis_cap=2.0), micro, torch.tensor([1.0]), logp)
    high, *_ = _loss(_settings(tis_cap=4.0), micro, torch.tensor([1.0]), logp)
    assert float(low) == pytest.approx(-2.0) and float(high) == pytest.approx(-4.0)


def test_loss_aggregation_weighs_tokens_or_sequences() -> None:
    """A 3-token and a 1-token answer, per-token losses -1 and -4 (advantages 1 and 4): the token mean
    is -7/4, the sequence mean -5/2."""
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0]])
    micro = _tokens([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]], logp * torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]))
    adv = torch.tensor([1.0, 4.0])
    token, *_ = _loss(_settings(loss_aggregation="token"), micro, adv, logp)
    sequence, *_ = _loss(_settings(loss_aggregation="sequence"), micro, adv, logp)
    assert float(token) == pytest.approx(-7 / 4) and float(sequence) == pytest.approx(-5 / 2)


# --- the entropy bonus: logits as the parameters ----------------------------------------------------------

TARGETS = torch.tensor([[0, 1, 2]])


def _entropy_step(ent_coef: float, logits: torch.Tensor, lr: float = 0.5) -> tuple[float, float, float]:
    """One SGD step on ``logits`` [1, 3, V] (a copy) from the loss with ``ent_coef``, the advantage 1 on
    every token: (the loss, the entropy in it, the mean entropy after the step)."""
    logits = logits.clone().requires_grad_(True)
    logp = torch.log_softmax(logits, -1).gather(-1, TARGETS[..., None]).squeeze(-1)
    micro = _tokens([[1.0, 1.0, 1.0]], logp.detach())
    loss, _, entropy, _ = _loss(_settings(ent_coef=ent_coef), micro, torch.tensor([1.0]), logp,
                                entropy=entropy_from_logits(logits))
    loss.backward()
    with torch.no_grad():
        after = logits - lr * logits.grad  # type: ignore[operator]
        return float(loss), float(entropy), float(entropy_from_logits(after).mean())


def test_ent_coef_subtracts_the_entropy_and_keeps_the_policy_broader() -> None:
    """ent_coef > 0: the loss is lower by ent_coef · entropy, and one step from the same logits leaves
    a higher entropy than the same step with ent_coef 0 (which only sharpens toward the rewarded tokens)."""
    logits = torch.tensor([[[2.0, 0.5, 0.0, -1.0], [0.0, 1.5, -0.5, 0.3], [1.0, 0.0, 0.2, -2.0]]])
    plain_loss, entropy, plain_after = _entropy_step(0.0, logits)
    bonus_loss, _, bonus_after = _entropy_step(0.5, logits)
    assert entropy > 0 and bonus_loss == pytest.approx(plain_loss - 0.5 * entropy)
    assert bonus_after > plain_after


# --- the KL penalty: the tiny model and a reference ------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture(scope="module")
def moved(tiny: Path) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(the reference: the model as built, the policy: the same weights moved by a fixed noise)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval().requires_grad_(False)
    policy = copy.deepcopy(reference).requires_grad_(True)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.05)
    return reference, policy


def _batch() -> tuple[TokenBatch, torch.Tensor]:
    samples = [Sample(f"r{i}.1/t0", "triplet", f"r{i}", f"r{i}.1", "g", 0, [1, 5 + i, 9, 12], [20 + i, 21, 22 + i, 2],
                      [-2.0, -2.0, -2.0, -2.0], [1, 1, 1, 1], float(i % 2), float(i % 2), "base", group_size=4)
               for i in range(4)]
    batch = make_batch(samples, pad_id=0, rewards=[float(i % 2) for i in range(4)])
    return batch, torch.tensor([1.0, -1.0, 0.5, -0.5])


def _kl_policy(kl_coef: float, reference: torch.nn.Module, model: torch.nn.Module) -> tuple[TrainerSettings, Policy]:
    s = _settings(kl_coef=kl_coef)
    return s, Policy(model, s, CPU, reference)


def _kl_of(s: TrainerSettings, policy: Policy, batch: TokenBatch, adv: torch.Tensor) -> float:
    with torch.no_grad():
        logp, _ = policy.logprobs(batch, s.logprob_chunk_tokens, entropy=False)
        return float(_loss(s, batch, adv, logp, policy=policy)[3])


def test_kl_coef_adds_its_multiple_of_the_kl_to_the_loss(moved: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    """Same batch, same policy: the loss with kl_coef 0.3 exceeds the one with 0 by 0.3 · KL, KL > 0."""
    reference, model = moved
    batch, adv = _batch()
    results = []
    for kl_coef in (0.0, 0.3):
        s, policy = _kl_policy(kl_coef, reference, model)
        with torch.no_grad():
            logp, _ = policy.logprobs(batch, s.logprob_chunk_tokens, entropy=False)
            results.append(_loss(s, batch, adv, logp, policy=policy))
    (plain, plain_pg, _, kl), (penalised, pg, _, _) = results
    assert float(kl) > 0 and float(pg) == pytest.approx(float(plain_pg))
    assert float(penalised) == pytest.approx(float(plain) + 0.3 * float(kl), rel=1e-5)


def test_kl_coef_pulls_the_policy_toward_the_reference(moved: tuple[torch.nn.Module, torch.nn.Module]) -> None:
    """One SGD step from the same weights on the same batch: with kl_coef 2 the KL to the reference
    ends lower than with kl_coef 0, and lower than before the step (a small rate: the k3 estimator is
    steep, and a large step overshoots the reference)."""
    reference, start = moved
    batch, adv = _batch()
    after = {}
    for kl_coef in (0.0, 2.0):
        s, policy = _kl_policy(kl_coef, reference, copy.deepcopy(start))
        before = _kl_of(s, policy, batch, adv)
        logp, _ = policy.logprobs(batch, s.logprob_chunk_tokens, entropy=False)
        _loss(s, batch, adv, logp, policy=policy)[0].backward()
        optimizer = torch.optim.SGD(policy.trainable_parameters(), lr=1e-3)
        optimizer.step()
        after[kl_coef] = _kl_of(s, policy, batch, adv)
    assert after[2.0] < before and after[2.0] < after[0.0]
