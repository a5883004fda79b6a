"""Advantages, policy losses and batches on hand-made inputs, against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from fulmen.records import Sample
from fulmen_trainer.batch import make_batch
from fulmen_trainer.logprobs import token_logprobs
from fulmen_trainer.objectives import (
    Baseline,
    aggregate,
    clipped_policy_loss,
    group_advantages,
    kl_to_reference,
    objective,
)


def test_grpo_advantages_are_group_normalised() -> None:
    """Each reward minus its group mean, over the group's population standard deviation."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    a = group_advantages(rewards, groups, eps=0.0)
    std1 = math.sqrt((3 * 0.25**2 + 0.75**2) / 4)  # 0.4330
    expected = [1, -1, -1, 1, 0.25 / std1, 0.25 / std1, 0.25 / std1, -0.75 / std1]
    assert a.tolist() == pytest.approx(expected, abs=1e-6)
    assert group_advantages(rewards, groups, scale=False).tolist() == [0.5, -0.5, -0.5, 0.5, 0.25, 0.25, 0.25, -0.75]


def test_equal_rewards_give_zero_advantage() -> None:
    """A group whose samples all scored the same teaches nothing (and divides by no zero)."""
    a = group_advantages(torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0]))
    assert a.tolist() == [0.0, 0.0, 0.0]


def test_ppo_loss_on_a_hand_made_batch() -> None:
    """Decoupled PPO with truncated IS: each token's loss as computed by hand."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.1]], requires_grad=True)
    prox = torch.tensor([[-1.1, -1.9], [-1.0, -0.1]])
    behaviour = torch.tensor([[-1.2, -1.5], [-1.0, -3.0]])
    advantages = torch.tensor([2.0, 1.0])
    loss, info = clipped_policy_loss(logp, behaviour, advantages, prox_logp=prox, clip_eps=0.2, tis_cap=2.0)
    e = math.exp
    expected = [
        [-e(0.1) * e(0.1) * 2.0, -e(-0.4) * e(-0.1) * 2.0],  # inside the clip range: w · ratio · A
        [-1.0 * 1.2, -2.0 * 1.0],  # ratio e^0.5 clipped to 1.2; IS weight e^2.9 truncated to 2
    ]
    assert loss.tolist() == [pytest.approx(row, abs=1e-5) for row in expected]
    assert info["clipped"].tolist() == [[0.0, 0.0], [1.0, 0.0]]
    loss.sum().backward()
    assert logp.grad is not None and logp.grad[1, 0] == 0.0  # a clipped token gives no gradient


def test_fresh_samples_reduce_to_the_policy_gradient() -> None:
    """With behaviour = current policy, the loss value is -A per token and its gradient -A ∇log π."""
    logp = torch.tensor([[-0.7, -0.3]], requires_grad=True)
    loss = objective("grpo")(logp, logp.detach(), torch.tensor([0.5]), torch.ones(1, 2))
    assert float(loss.detach()) == pytest.approx(-0.5)
    loss.backward()
    assert logp.grad is not None and logp.grad.tolist() == [[-0.25, -0.25]]


def test_aggregation_by_token_and_by_sequence() -> None:
    """Token mean weighs long answers more; sequence mean weighs every sample the same."""
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert float(aggregate(per_token, mask, "token")) == pytest.approx(10 / 4)
    assert float(aggregate(per_token, mask, "sequence")) == pytest.approx((2 + 4) / 2)
    with pytest.raises(ValueError, match="aggregation"):
        aggregate(per_token, mask, "batch")


def test_sft_is_the_masked_negative_log_likelihood() -> None:
    """SFT averages -log π over the masked tokens."""
    logp = torch.tensor([[-1.0, -3.0], [-2.0, -5.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    assert float(objective("sft")(logp, logp, torch.zeros(2), mask)) == pytest.approx(2.0)


def test_kl_k3_estimator() -> None:
    """k3: e^(ref-logp) - (ref-logp) - 1, zero when the policies agree."""
    kl = kl_to_reference(torch.tensor([-2.0, -1.0]), torch.tensor([-1.0, -1.0]))
    assert kl.tolist() == pytest.approx([math.e - 2, 0.0])


def test_reinforce_baseline_is_a_moving_average() -> None:
    """The first batch is its own baseline; later batches use the running mean."""
    b = Baseline(decay=0.5)
    assert b.advantages(torch.tensor([1.0, 0.0])).tolist() == [0.5, -0.5]
    assert b.advantages(torch.tensor([1.0, 1.0])).tolist() == [0.5, 0.5]
    assert b.value == pytest.approx(0.75)


def test_unknown_algorithm_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="grpo"):
        objective("dpo")


def _sample(sid: str, prompt: list[int], response: list[int], logprobs: list[float], group: str = "g") -> Sample:
    return Sample(sid, "triplet", "r", "r.1", group, 0, prompt, response, logprobs, [1] * len(response),
                  1.0, 1.0, "v1")


def test_batch_aligns_response_tokens_with_their_predicting_position() -> None:
    """Response token j of a P-token prompt is trained at position P+j-1, with its behaviour logprob."""
    batch = make_batch(
        [_sample("a", [5, 6, 7], [8, 9], [-0.1, -0.2]), _sample("b", [5], [6], [-0.3], group="h")],
        pad_id=0, rewards=[1.0, 0.0],
    )
    assert batch.input_ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 0, 0, 0]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch.mask.tolist() == [[0, 0, 1, 1], [1, 0, 0, 0]]
    assert batch.behaviour_logp.tolist() == [pytest.approx([0, 0, -0.1, -0.2]), pytest.approx([-0.3, 0, 0, 0])]
    assert batch.group_index.tolist() == [0, 1]
    assert [len(batch.split(2, i)) for i in range(2)] == [1, 1]


def test_token_logprobs_match_unpadded_forward_passes(tmp_path) -> None:
    """Batched, right-padded log-probabilities equal each sequence's own forward pass."""
    from fulmen.demo.tiny_model import build_tiny_model, load_tiny_model

    model, _ = load_tiny_model(build_tiny_model(tmp_path / "m"))
    samples = [_sample("a", [1, 5, 6, 7], [8, 9, 10], [0, 0, 0]), _sample("b", [1, 5], [6], [0])]
    batch = make_batch(samples, pad_id=0, rewards=[1, 0])
    with torch.no_grad():
        logp, _ = token_logprobs(model, batch)
        for i, s in enumerate(samples):
            seq = torch.tensor([s.prompt_token_ids + s.response_token_ids])
            own = torch.log_softmax(model(input_ids=seq).logits[0, :-1].float(), -1).gather(-1, seq[0, 1:, None])[:, 0]
            trained = batch.mask[i].bool()
            assert logp[i][trained].tolist() == pytest.approx(own[len(s.prompt_token_ids) - 1 :].tolist(), abs=1e-5)
