"""ppo_gae: GAE per token on hand-made values, the clipped value loss, the value head kept in checkpoints
(full and LoRA) and left out of the published version, and training steps through the trainer."""

from __future__ import annotations

import asyncio
import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from fulmen import keys as k
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import Sample
from fulmen.settings import TrainerSettings, load_settings
from fulmen.store import RedisStore
from fulmen_trainer import checkpoints as ckpt
from fulmen_trainer.batch import TokenBatch, make_batch
from fulmen_trainer.groups import ReadyGroup
from fulmen_trainer.loss import micro_loss, recipe_knobs, value_loss
from fulmen_trainer.objectives import Baseline, generalised_advantages
from fulmen_trainer.plan import plan_step
from fulmen_trainer.policy import Policy, load_policy
from fulmen_trainer.trainer import Trainer
from fulmen_trainer.values import VALUE_HEAD_FILE, ValueTargets, value_targets

CPU = torch.device("cpu")
# two sequences, the first of two turns (its third position is a tool's output: not trained)
MASK = torch.tensor([[1.0, 1.0, 0.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
VALUES = torch.tensor([[0.5, -0.2, 9.0, 0.3], [9.0, 0.1, 0.4, 9.0]])  # 9: off the mask, never read
REWARDS = torch.tensor([1.0, -1.0])


def _same(got: torch.Tensor, want: Any) -> None:
    torch.testing.assert_close(got.float(), torch.as_tensor(want, dtype=torch.float32), atol=1e-6, rtol=1e-5)


def _settings(**knobs: Any) -> TrainerSettings:
    return load_settings(TrainerSettings, **{"algorithm": "ppo_gae", **knobs})


def _sample(rollout: str, group: str, reward: float, size: int = 2) -> Sample:
    response = [20 + int(reward), 21, 2]
    return Sample(f"{rollout}.1/t0", "triplet", rollout, f"{rollout}.1", group, 0, [1, 5, 9, 12], response,
                  [-1.5] * 3, [1] * 3, reward, reward, "base", mode="train", group_size=size)


def _groups() -> list[ReadyGroup]:
    groups = []
    for group, rewards in (("a", [1.0, 0.0]), ("b", [0.0, 1.0])):
        samples = [_sample(f"{group}-r{i}", group, r) for i, r in enumerate(rewards)]
        groups.append(ReadyGroup(group, samples, [1.0] * 2, [f"e-{s.sample_id}" for s in samples]))
    return groups


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


# --- GAE ---------------------------------------------------------------------------------------------


def test_gae_with_lambda_one_and_gamma_one_is_the_monte_carlo_return_minus_the_value() -> None:
    """λ = γ = 1: every trained token's advantage is the sequence's reward minus its value, and its
    return the reward; the untrained tool token in between gets 0 and is skipped."""
    advantages, returns = generalised_advantages(REWARDS, VALUES, MASK, gamma=1.0, lam=1.0)
    expected = (REWARDS[:, None] - VALUES) * MASK
    _same(advantages, expected)
    _same(returns, REWARDS[:, None] * MASK)


def test_gae_with_lambda_zero_is_the_one_step_td_error() -> None:
    """λ = 0, γ = 0.9: A_t = r_t + γ V(next trained token) - V_t, r only at the last trained token."""
    advantages, _ = generalised_advantages(REWARDS, VALUES, MASK, gamma=0.9, lam=0.0)
    expected = [[0.9 * -0.2 - 0.5, 0.9 * 0.3 + 0.2, 0.0, 1.0 - 0.3],
                [0.0, 0.9 * 0.4 - 0.1, -1.0 - 0.4, 0.0]]
    _same(advantages, expected)


def test_gamma_discounts_per_trained_token() -> None:
    """λ = 1, γ = 0.5, values 0: the reward discounted once per trained token after t (the tool token
    does not count)."""
    advantages, _ = generalised_advantages(REWARDS, torch.zeros(2, 4), MASK, gamma=0.5, lam=1.0)
    _same(advantages, [[0.25, 0.5, 0.0, 1.0], [0.0, -0.5, -1.0, 0.0]])


def test_lambda_mixes_the_td_error_and_the_return() -> None:
    """γ = 1, λ = 0.5 on one sequence of two tokens: A_1 = R - V_1, A_0 = δ_0 + 0.5 A_1."""
    values, mask = torch.tensor([[0.2, 0.6]]), torch.ones(1, 2)
    advantages, _ = generalised_advantages(torch.tensor([1.0]), values, mask, gamma=1.0, lam=0.5)
    _same(advantages, [[(0.6 - 0.2) + 0.5 * 0.4, 0.4]])


class _FixedValues:
    """A policy whose value head says VALUES (by the sample's number), for `value_targets`."""

    device = CPU

    def score(self, micro: TokenBatch, chunk_tokens: int, entropy: bool) -> tuple[None, None, torch.Tensor]:
        rows = [int(sid[1:]) for sid in micro.sample_ids]
        return None, None, VALUES[rows, : micro.mask.shape[1]]


def _batch() -> TokenBatch:
    return TokenBatch(torch.zeros((2, 5), dtype=torch.long), torch.ones((2, 5), dtype=torch.long), MASK,
                      torch.zeros(2, 4), REWARDS, torch.zeros(2, dtype=torch.long), torch.zeros(2), ["s0", "s1"])


@pytest.mark.parametrize("whiten", [True, False])
def test_advantages_are_whitened_over_the_step_s_tokens_when_asked(whiten: bool) -> None:
    """whiten_advantages: mean 0, std 1 over the trained tokens of the whole step (two micro-batches of
    one sequence each); off: GAE's own. Staleness weights multiply them afterwards."""
    knobs = recipe_knobs(_settings(whiten_advantages=whiten, gamma=1.0, gae_lambda=1.0))
    targets, stream = value_targets(_FixedValues(), _batch(), [(0, 1), (1, 2)], REWARDS, torch.tensor([1.0, 0.5]),
                                    knobs, 1024)
    raw = (REWARDS[:, None] - VALUES) * MASK
    trained = MASK.bool()
    assert targets.old[trained].tolist() == pytest.approx(VALUES[trained].tolist())
    unweighted = targets.advantages / torch.tensor([1.0, 0.5])[:, None]
    if whiten:
        assert float(unweighted[trained].mean()) == pytest.approx(0.0, abs=1e-6)
        assert float(unweighted[trained].std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)
    else:
        _same(unweighted, raw)
    assert stream["value/mean"] == pytest.approx(float(VALUES[trained].mean()))


# --- the value loss ----------------------------------------------------------------------------------


def _value_loss(s: TrainerSettings, current: torch.Tensor, old: torch.Tensor, returns: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """(total, value loss) of `micro_loss` and `value_loss` on one sequence of two trained tokens with a
    zero policy term."""
    mask = torch.ones(1, 2)
    micro = TokenBatch(torch.zeros((1, 3), dtype=torch.long), torch.ones((1, 3), dtype=torch.long), mask,
                       torch.zeros(1, 2), torch.zeros(1), torch.zeros(1, dtype=torch.long), torch.zeros(1), ["s0"])
    targets = ValueTargets(torch.zeros(1, 2), returns, old, current)
    logp = torch.zeros(1, 2)
    total = micro_loss(s, Policy(None, s, CPU), micro, torch.zeros(1, 2), logp, None, logp, targets)[0]
    return total, value_loss(s, mask, targets)


def test_the_value_clip_binds() -> None:
    """Old value 0, return 1: a value moved to 0.5 is clipped to 0.2 (loss ½·0.8² = 0.32, and no gradient
    pushes it further); without the clip (value_clip 0) the loss is ½·0.5² = 0.125 and the gradient
    pulls it on."""
    old, returns = torch.zeros(1, 2), torch.ones(1, 2)
    current = torch.full((1, 2), 0.5, requires_grad=True)
    _, clipped = _value_loss(_settings(value_clip=0.2), current, old, returns)
    assert float(clipped.detach()) == pytest.approx(0.32)
    clipped.backward()
    assert current.grad is not None and current.grad.abs().max() == 0.0
    current.grad = None
    _, plain = _value_loss(_settings(value_clip=0), current, old, returns)
    assert float(plain.detach()) == pytest.approx(0.125)
    plain.backward()
    _same(current.grad, [[-0.25, -0.25]])


def test_vf_coef_weighs_the_value_loss_into_the_loss() -> None:
    current, old, returns = torch.full((1, 2), 0.1), torch.zeros(1, 2), torch.ones(1, 2)
    for coef in (0.1, 0.7):
        total, value = _value_loss(_settings(vf_coef=coef), current, old, returns)
        assert float(value) == pytest.approx(0.5 * 0.9**2)
        assert float(total) == pytest.approx(coef * float(value))


def test_the_knobs_reach_the_recipe_and_ppo_stays_without_a_head() -> None:
    knobs = recipe_knobs(_settings(gamma=0.9, gae_lambda=0.5, value_clip=0, vf_coef=0.3, whiten_advantages=False))
    assert (knobs.value_head, knobs.gamma, knobs.gae_lambda, knobs.value_clip, knobs.vf_coef,
            knobs.whiten_advantages) == (True, 0.9, 0.5, None, 0.3, False)
    defaults = recipe_knobs(_settings())
    assert (defaults.gamma, defaults.gae_lambda, defaults.value_clip) == (1.0, 0.95, 0.2)
    assert recipe_knobs(_settings(algorithm="ppo")).value_head is False
    ppo = plan_step(_groups(), "ppo", "final", Baseline())
    assert ppo.weights is None and ppo.advantages.tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5])


# --- the head on the policy ----------------------------------------------------------------------------


@pytest.mark.parametrize("knobs", [{}, {"lora_rank": 4, "lora_alpha": 8}], ids=["full", "lora"])
def test_the_head_is_checkpointed_trained_and_never_published(tiny: Path, tmp_path: Path, knobs: dict) -> None:
    """ppo_gae's policy has a head among its trained parameters; a checkpoint saves it beside the model
    and a policy loaded from that checkpoint has it back; the published version holds exactly what
    ppo's does (the policy's weights or adapter), no head."""
    s = _settings(model_dir=tiny, **knobs)
    policy = load_policy(s, None)
    head = policy.value_head
    assert head is not None and head.weight.shape == (1, policy.model.config.hidden_size)
    assert {id(p) for p in head.parameters()} <= {id(p) for p in policy.trainable_parameters()}
    with torch.no_grad():
        head.weight.copy_(torch.linspace(-1, 1, head.weight.numel()).view_as(head.weight))
        head.bias.fill_(0.25)
    optimizer = torch.optim.AdamW(policy.trainable_parameters())
    path = ckpt.save(tmp_path / "ck", ckpt.Checkpoint(1, "v1", []), policy.model, optimizer, value_head=head)
    assert (path / VALUE_HEAD_FILE).exists()
    restored = load_policy(s, path / "model")
    assert restored.value_head is not None
    assert torch.equal(restored.value_head.weight, head.weight) and float(restored.value_head.bias) == 0.25
    published = policy.published_state()
    plain = load_policy(_settings(model_dir=tiny, **{**knobs, "algorithm": "ppo"}), None)
    assert plain.value_head is None
    assert set(published) == set(plain.published_state())
    assert not any(t.shape == head.weight.shape and torch.equal(t.float(), head.weight) for t in published.values())


def _fixed_batch_trainer(tiny: Path, tmp_path: Path) -> Trainer:
    settings = _settings(model_dir=tiny, learning_rate=1e-3, checkpoint_dir=tmp_path / "ck")
    trainer = Trainer(None, settings)  # type: ignore[arg-type]  # no store: passes and updates only
    torch.manual_seed(0)
    trainer.policy = load_policy(settings, None)
    trainer.optimizer = torch.optim.AdamW(trainer.policy.trainable_parameters(), lr=settings.learning_rate)
    return trainer


def test_the_value_loss_falls_over_steps_on_a_fixed_batch(tiny: Path, tmp_path: Path) -> None:
    """Four steps on the same groups: the value loss at each step's start falls, the head moves from
    zero, and the step's metrics carry the value stream."""
    trainer = _fixed_batch_trainer(tiny, tmp_path)
    losses = []
    for _ in range(4):
        plan = plan_step(_groups(), "ppo_gae", "final", trainer.baseline, trainer.knobs)
        metrics = trainer.train_passes(plan)
        losses.append(metrics["loss/value"])
    assert all(b < a for a, b in itertools.pairwise(losses)), losses
    # values 0 at the start: the returns are λ^k R (k trained tokens after), λ 0.95, R 1 or 0, 3 tokens
    assert losses[0] == pytest.approx(0.5 * 0.5 * (0.95**4 + 0.95**2 + 1) / 3, rel=1e-5)
    assert trainer.policy is not None and trainer.policy.value_head is not None
    assert float(trainer.policy.value_head.weight.abs().sum()) > 0
    for key in ("value/mean", "value/explained_variance", "value/return_mean", "loss/value_last_pass"):
        assert key in metrics


async def test_ppo_gae_trains_a_step_through_the_trainer(real_store: RedisStore, tiny: Path, tmp_path: Path) -> None:
    """Two groups a step from the stream: the weights and the head move, the step's record has the
    value stream, and the checkpoint holds the head."""
    await real_store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    for group in _groups():
        for sample in group.samples:
            await real_store.redis.xadd(real_store.keys.samples, {"m": sample.to_wire()})
    settings = _settings(model_dir=tiny, groups_per_step=2, max_steps=1, learning_rate=1e-3,
                         checkpoint_dir=tmp_path / "ck", metrics_file=tmp_path / "m.jsonl",
                         experiment=real_store.experiment)
    trainer = Trainer(real_store, settings)
    await trainer.setup()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    await asyncio.wait_for(trainer.run(asyncio.Event()), 60)
    assert trainer.step == 1
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters())
    assert trainer.policy is not None and trainer.policy.value_head is not None
    assert float(trainer.policy.value_head.weight.abs().sum()) > 0
    (line,) = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert line["loss/value"] > 0 and "value/mean" in line and "value/explained_variance" in line
    assert (ckpt.latest(trainer.checkpoint_folder) / VALUE_HEAD_FILE).exists()  # type: ignore[operator]


def test_a_value_head_refuses_ranks() -> None:
    """The head is not exchanged between ranks: ppo_gae refuses to start with them."""
    with pytest.raises(ValueError, match="without ranks"):
        Trainer(None, _settings(model_dir=Path("/nowhere")), ranks=SimpleNamespace())  # type: ignore[arg-type]


def test_the_step_plan_keeps_rewards_for_gae() -> None:
    """ppo_gae's plan: each sample's own reward (to be spread by GAE) and the weights apart."""
    plan = plan_step(_groups(), "ppo_gae", "final", Baseline(), recipe_knobs(_settings()))
    assert plan.advantages.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert plan.weights is not None and plan.weights.tolist() == [1.0] * 4
    batch = make_batch(plan.samples, pad_id=0, rewards=plan.rewards)
    assert batch.mask.sum() == 12
