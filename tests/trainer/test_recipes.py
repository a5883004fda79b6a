"""The training recipes (`--algorithm`): each knob changes the advantages or the loss the way its paper
says, on hand-made tensors; and each new recipe trains a step through the trainer."""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from fulmen import keys as k
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.errors import InvalidInput
from fulmen.records import Sample
from fulmen.settings import TrainerSettings, load_settings
from fulmen.store import RedisStore
from fulmen_trainer.batch import make_batch
from fulmen_trainer.groups import GroupCollector, ReadyGroup
from fulmen_trainer.loss import micro_loss, recipe_knobs
from fulmen_trainer.objectives import (
    Baseline,
    OverlongPenalty,
    RecipeKnobs,
    Rewards,
    advantages_for,
    algorithms,
    constant_normalised,
    objective,
    sequence_ratio,
)
from fulmen_trainer.plan import plan_step
from fulmen_trainer.policy import Policy
from fulmen_trainer.trainer import Trainer

CPU = torch.device("cpu")
NEW = ["dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp"]


def _settings(**knobs: Any) -> TrainerSettings:
    return load_settings(TrainerSettings, **knobs)


def _sample(rollout: str, group: str, reward: float, length: int = 3, size: int = 4) -> Sample:
    response = [20 + int(reward), *([21] * (length - 2)), 2][:length]
    return Sample(f"{rollout}.1/t0", "triplet", rollout, f"{rollout}.1", group, 0, [1, 5, 9, 12], response,
                  [-1.5] * length, [1] * length, reward, reward, "base", mode="train", group_size=size)


def _ready(group: str, rewards: list[float], lengths: list[int] | None = None) -> ReadyGroup:
    lengths = lengths or [3] * len(rewards)
    samples = [_sample(f"{group}-r{i}", group, r, n, len(rewards))
               for i, (r, n) in enumerate(zip(rewards, lengths, strict=True))]
    return ReadyGroup(group, samples, [1.0] * len(samples), [f"e-{s.sample_id}" for s in samples])


def _advantages(name: str, rewards: list[float], groups: list[int], tokens: list[float] | None = None) -> list[float]:
    r = Rewards(torch.tensor(rewards), torch.tensor(groups), torch.tensor(tokens or [1.0] * len(rewards)))
    return advantages_for(name).fn(r, Baseline(), RecipeKnobs()).tolist()


def _pg(s: TrainerSettings, logp: torch.Tensor, prox: torch.Tensor, adv: torch.Tensor, mask: list[list[float]]
        ) -> torch.Tensor:
    """The policy term `micro_loss` steps on, behaviour = prox (importance weight 1)."""
    from fulmen_trainer.batch import TokenBatch

    rows, positions = len(mask), len(mask[0])
    micro = TokenBatch(torch.zeros((rows, positions + 1), dtype=torch.long), torch.ones((rows, positions + 1), dtype=torch.long),
                       torch.tensor(mask), prox.clone(), torch.zeros(rows), torch.zeros(rows, dtype=torch.long),
                       torch.zeros(rows), [f"s{i}" for i in range(rows)])
    return micro_loss(s, Policy(None, s, CPU), micro, adv, logp, None, prox)[1]


def _gradient(s: TrainerSettings, log_ratios: list[list[float]], advantage: float) -> list[list[float]]:
    """d loss / d logp for one or more sequences of two tokens whose π_θ/π_prox are e^log_ratios."""
    logp = torch.full((len(log_ratios), 2), -1.0, requires_grad=True)
    prox = logp.detach() - torch.tensor(log_ratios)
    _pg(s, logp, prox, torch.full((len(log_ratios),), advantage), [[1.0, 1.0]] * len(log_ratios)).backward()
    assert logp.grad is not None
    return logp.grad.tolist()


# --- the registry -----------------------------------------------------------------------------------


def test_every_recipe_has_a_loss_and_advantages_and_unknown_names_list_them() -> None:
    """Each --algorithm value names a policy loss and an advantage function; another name fails at
    load and in the registry, both listing every recipe."""
    assert set(NEW) < set(algorithms())
    for name in algorithms():
        assert objective(name) is not None and advantages_for(name) is not None
    with pytest.raises(ValueError, match=r"dapo.*dr_grpo.*gspo.*reinforce_pp.*rloo"):
        objective("dpo")
    with pytest.raises(InvalidInput, match="dr_grpo"):
        _settings(algorithm="dpo")


# --- Dr. GRPO ---------------------------------------------------------------------------------------


def test_dr_grpo_advantages_are_not_divided_by_the_group_std() -> None:
    """Dr. GRPO: reward minus the group's mean, no std (GRPO would give 1/0.433 = 2.31 for 0.75)."""
    assert _advantages("dr_grpo", [1.0, 0.0, 0.0, 0.0], [0] * 4) == pytest.approx([0.75, -0.25, -0.25, -0.25])


def test_dr_grpo_divides_the_summed_loss_by_a_constant_not_by_lengths() -> None:
    """A 3-token and a 1-token answer (advantages ±0.5), generation limit 8: the step's loss is
    Σ loss / (2 · 8) = -1/16 (the token mean would be -1/4, the sequence mean 0), and every token's
    gradient is ∓0.5/16, whatever its answer's length."""
    s = _settings(algorithm="dr_grpo", max_response_length=8)
    group = _ready("g", [1.0, 0.0], lengths=[3, 1])
    plan = plan_step([group], "dr_grpo", "final", Baseline(), recipe_knobs(s))
    batch = make_batch(plan.samples, pad_id=0, rewards=plan.rewards)
    logp = batch.behaviour_logp.clone().requires_grad_(True)  # fresh samples: ratio 1, weight 1
    loss = micro_loss(s, Policy(None, s, CPU), batch, plan.advantages, logp, None, logp.detach())[1]
    assert float(loss.detach()) == pytest.approx(-1 / 16)
    definition = constant_normalised(-torch.tensor([0.5, -0.5])[:, None] * batch.mask, batch.mask, 8)
    assert float(loss.detach()) == pytest.approx(float(definition))
    loss.backward()
    assert logp.grad is not None
    trained = logp.grad[batch.mask.bool()].tolist()
    assert trained == pytest.approx([-0.5 / 16] * 3 + [0.5 / 16])


def test_dr_grpo_needs_the_generation_limit() -> None:
    """Its constant is the rollouts' max_tokens: without max_response_length it refuses to start."""
    with pytest.raises(ValueError, match="max_response_length"):
        recipe_knobs(_settings(algorithm="dr_grpo"))


# --- DAPO -------------------------------------------------------------------------------------------


def test_dapo_clips_higher_above_one_than_below() -> None:
    """ε_low 0.2, ε_high 0.28: with A > 0 a ratio of e^0.24 = 1.27 still learns (GRPO's 1.2 clips it),
    e^0.3 = 1.35 does not; with A < 0 a ratio of e^-0.25 = 0.78 is clipped as in GRPO."""
    dapo, grpo = _settings(algorithm="dapo"), _settings(algorithm="grpo")
    assert _gradient(dapo, [[0.24, 0.0]], 1.0)[0][0] == pytest.approx(-math.exp(0.24) / 2)
    assert _gradient(grpo, [[0.24, 0.0]], 1.0)[0][0] == 0.0
    assert _gradient(dapo, [[0.3, 0.0]], 1.0)[0][0] == 0.0
    assert _gradient(dapo, [[-0.25, 0.0]], -1.0)[0][0] == 0.0


def test_clip_eps_low_and_high_are_settings_of_their_own() -> None:
    """clip_eps_high 0.4 lets e^0.3 through under grpo too; clip_eps_low 0.3 lets e^-0.3 = 0.74 through."""
    assert _gradient(_settings(clip_eps_high=0.4), [[0.3, 0.0]], 1.0)[0][0] < 0
    assert _gradient(_settings(clip_eps_low=0.3), [[-0.3, 0.0]], -1.0)[0][0] > 0
    assert _gradient(_settings(), [[-0.3, 0.0]], -1.0)[0][0] == 0.0


def test_dapo_averages_over_tokens_and_refuses_a_sequence_mean() -> None:
    """A 3-token and a 1-token answer (advantages 1 and 4): dapo's loss is the token mean -7/4, and
    loss_aggregation sequence contradicts the recipe."""
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0]])
    mask = [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    assert float(_pg(_settings(algorithm="dapo"), logp, logp, torch.tensor([1.0, 4.0]), mask)) == pytest.approx(-7 / 4)
    with pytest.raises(ValueError, match="token"):
        recipe_knobs(_settings(algorithm="dapo", loss_aggregation="sequence"))


def test_dynamic_sampling_drops_groups_whose_rewards_are_all_equal() -> None:
    """With dynamic sampling a group of equal rewards comes out empty and counted (the trainer does not
    count it toward a step); a mixed group is kept; without it both are kept."""
    for dynamic, expected in ((True, [0, 4]), (False, [4, 4])):
        c = GroupCollector(dynamic_sampling=dynamic)
        for group, rewards in (("same", [1.0] * 4), ("mixed", [1.0, 0.0, 0.0, 1.0])):
            for i, r in enumerate(rewards):
                c.add(f"{group}-{i}", _sample(f"{group}-r{i}", group, r))
        ready = c.take_complete(0)
        assert [len(g.samples) for g in ready] == expected
        assert [len(g.entry_ids) for g in ready] == [4, 4]  # consumed with the step either way
        assert c.counts["groups/dropped_zero_variance"] == (1 if dynamic else 0)


def test_dynamic_sampling_also_judges_a_group_that_waited() -> None:
    """A group re-weighed for a later version loses its stale rollouts; if the rest score the same, it
    is dropped then."""
    c = GroupCollector(dynamic_sampling=True, max_staleness=0)
    group = _ready("g", [1.0, 1.0, 0.0])
    fresh = [replace(s, model_version="v1") for s in group.samples[:2]] + group.samples[2:]
    waited = ReadyGroup("g", fresh, [1.0] * 3, group.entry_ids, weighed_at=0)
    assert c.reweigh(waited, 1).samples == []  # the 0-reward rollout was stale: two 1s remain
    assert c.counts["groups/dropped_zero_variance"] == 1


def test_dynamic_sampling_is_on_for_dapo_and_a_setting_for_the_others() -> None:
    assert recipe_knobs(_settings(algorithm="dapo")).dynamic_sampling is True
    assert recipe_knobs(_settings(algorithm="grpo")).dynamic_sampling is False
    assert recipe_knobs(_settings(algorithm="grpo", dynamic_sampling=True)).dynamic_sampling is True
    assert recipe_knobs(_settings(algorithm="dapo", dynamic_sampling=False)).dynamic_sampling is False


def test_overlong_penalty_ramps_over_the_buffer() -> None:
    """Limit 20, buffer 4: nothing up to 16 tokens, -0.5 at 18, -1 at 20 and beyond (× the factor)."""
    lengths = torch.tensor([10.0, 16.0, 18.0, 20.0, 25.0])
    assert OverlongPenalty(20, 4)(lengths).tolist() == pytest.approx([0, 0, -0.5, -1, -1])
    assert OverlongPenalty(20, 4, 0.5)(lengths).tolist() == pytest.approx([0, 0, -0.25, -0.5, -0.5])


def test_overlong_penalty_lowers_a_long_answer_s_advantage() -> None:
    """dapo, limit 20 (buffer 4 by default, a fifth): of two correct answers the 18-token one gets a
    lower advantage than the 10-token one; without the penalty they would be equal."""
    s = _settings(algorithm="dapo", max_response_length=20)
    assert recipe_knobs(s).overlong == OverlongPenalty(20, 4, 1.0)
    plan = plan_step([_ready("g", [1.0, 1.0, 0.0], lengths=[10, 18, 10])], "dapo", "final", Baseline(),
                     recipe_knobs(s))
    short, long, wrong = plan.advantages.tolist()
    assert short > long > wrong
    assert plan.rewards == [1.0, 1.0, 0.0]  # the rewards reported stay the task's


def test_overlong_penalty_is_a_setting_that_needs_the_limit() -> None:
    assert recipe_knobs(_settings(algorithm="grpo", max_response_length=20)).overlong is None
    assert recipe_knobs(_settings(overlong_buffer_len=5, max_response_length=20)).overlong == OverlongPenalty(20, 5)
    assert recipe_knobs(_settings(algorithm="dapo", max_response_length=20, overlong_buffer_len=0)).overlong is None
    with pytest.raises(ValueError, match="max_response_length"):
        recipe_knobs(_settings(overlong_buffer_len=5))


# --- GSPO -------------------------------------------------------------------------------------------


def test_gspo_ratio_is_one_number_per_sequence() -> None:
    """The geometric mean of the tokens' ratios: log-ratios +0.3 and -0.3 make 1, +0.1 and +0.3 make e^0.2."""
    logp = torch.tensor([[0.3, -0.3, 0.0], [0.1, 0.3, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]])
    assert sequence_ratio(logp, torch.zeros(2, 3), mask).tolist() == pytest.approx([1.0, math.exp(0.2)])


def test_gspo_clips_whole_sequences() -> None:
    """Token ratios e^0.3 and e^-0.3: the sequence's ratio is 1, inside GSPO's tiny range, so both
    tokens learn alike (token-level clipping at 4e-4 would cut the first); e^0.1 and e^0.1: the
    sequence's ratio is above 1 + 4e-4 and neither token learns."""
    s = _settings(algorithm="gspo")
    kept, clipped = _gradient(s, [[0.3, -0.3], [0.1, 0.1]], 1.0)
    assert kept == pytest.approx([-1 / 4, -1 / 4])  # -s·A/|y|, over 2 sequences (a sequence mean)
    assert clipped == [0.0, 0.0]


def test_gspo_averages_over_sequences() -> None:
    """Per-token losses -1 (3 tokens) and -4 (1 token): gspo's loss is the sequence mean -5/2."""
    logp = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, 0.0, 0.0]])
    mask = [[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    assert float(_pg(_settings(algorithm="gspo"), logp, logp, torch.tensor([1.0, 4.0]), mask)) == pytest.approx(-5 / 2)


# --- RLOO and REINFORCE++ ---------------------------------------------------------------------------


def test_rloo_subtracts_the_mean_of_the_others() -> None:
    """1, 0, 0, 0: the first is 1 - 0, each other 0 - 1/3 (the group's mean would give 0.75, -0.25)."""
    assert _advantages("rloo", [1.0, 0.0, 0.0, 0.0], [0] * 4) == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])


def test_reinforce_pp_whitens_over_the_whole_batch_s_tokens() -> None:
    """Groups [1, 0] and [1, 0, 0, 0]: the group means subtracted ([.5, -.5] and [.75, -.25 ×3]), then
    one mean and std over the batch, each rollout counted once per token (not per group, as GRPO)."""
    tokens = [1.0, 3.0, 2.0, 2.0, 1.0, 1.0]
    got = torch.tensor(_advantages("reinforce_pp", [1.0, 0.0, 1.0, 0.0, 0.0, 0.0], [0, 0, 1, 1, 1, 1], tokens))
    centred = torch.tensor([0.5, -0.5, 0.75, -0.25, -0.25, -0.25])
    w = torch.tensor(tokens) / sum(tokens)
    mean = (centred * w).sum()
    std = (((centred - mean) ** 2) * w).sum().sqrt()
    assert got.tolist() == pytest.approx(((centred - mean) / std).tolist(), abs=1e-5)
    assert float((got * w).sum()) == pytest.approx(0.0, abs=1e-6)


def test_the_four_first_recipes_keep_their_advantages() -> None:
    """grpo normalises per group, ppo and reinforce use the moving baseline, sft weighs samples."""
    groups = [_ready("a", [1.0, 0.0]), _ready("b", [1.0, 1.0, 0.0])]
    grpo = plan_step(groups, "grpo", "final", Baseline()).advantages.tolist()
    assert grpo == pytest.approx([1, -1, 0.7071, 0.7071, -1.4142], abs=1e-3)
    assert plan_step(groups, "ppo", "final", Baseline()).advantages.tolist() == pytest.approx([0.4, -0.6, 0.4, 0.4, -0.6])
    sft = plan_step(groups, "sft", "final", Baseline(), RecipeKnobs(sft_min_reward=0.5)).advantages.tolist()
    assert sft == [1.0, 0.0, 1.0, 1.0, 0.0]


# --- each new recipe trains a step --------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.mark.parametrize("algorithm", NEW)
async def test_each_recipe_trains_a_step(real_store: RedisStore, tiny: Path, tmp_path: Path, algorithm: str) -> None:
    """Groups z (all rewards equal), a and b, two groups a step: the weights move; dapo (dynamic
    sampling) skips z and fills the step with a and b, counting z as dropped; the others train z and a."""
    await real_store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    for group, rewards in (("z", [1.0, 1.0]), ("a", [1.0, 0.0]), ("b", [0.0, 1.0])):
        for i, r in enumerate(rewards):
            await real_store.redis.xadd(real_store.keys.samples, {"m": _sample(f"{group}-r{i}", group, r, size=2).to_wire()})
    settings = load_settings(TrainerSettings, model_dir=tiny, algorithm=algorithm, groups_per_step=2, max_steps=1,
                             max_response_length=8, learning_rate=1e-3, checkpoint_dir=tmp_path / "ck",
                             metrics_file=tmp_path / "m.jsonl", experiment=real_store.experiment)
    trainer = Trainer(real_store, settings)
    await trainer.setup()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    await asyncio.wait_for(trainer.run(asyncio.Event()), 60)
    assert trainer.step == 1
    assert any(not torch.equal(p.detach(), before[n]) for n, p in trainer.model.named_parameters())
    (line,) = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    trained = {sid.split("-")[0] for sid in line["sample_ids"]}
    if algorithm == "dapo":
        assert trained == {"a", "b"} and line["groups/dropped"] == 1
        assert line["count/groups/dropped_zero_variance"] == 1
        # left out by design: replaced apart from the lost groups (`fulmen_algorithm.scheduler.FILTERED_ROUNDS`)
        assert await real_store.redis.smembers(real_store.keys.trainer_filtered) == {b"z"}
        assert await real_store.redis.smembers(real_store.keys.trainer_untrained) == set()
    else:
        assert trained == {"z", "a"} and line["groups/dropped"] == 0
