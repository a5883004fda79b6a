"""Samples that decode but cannot be trained on, and steps that would train on NaN or infinity: the
trainer dead-letters or skips them with the reason and keeps training (issue 20, items 7 and 8)."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from fulmen import codec, tokens
from fulmen import keys as k
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import Sample
from fulmen.settings import TrainerSettings, load_settings
from fulmen.store import RedisStore
from fulmen_trainer.groups import ReadyGroup
from fulmen_trainer.trainer import Trainer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _sample(rollout: str, group: str, reward: float, size: int = 2) -> Sample:
    return Sample(f"{rollout}.1/t0", "triplet", rollout, f"{rollout}.1", group, 0, [1, 5, 9, 12], [20, 21, 2],
                  [-1.5, -2.0, -0.5], [1, 1, 1], reward, reward, "base", mode="train", group_size=size)


def _poison(**changes: Any) -> bytes:
    """A sample's wire record with some fields replaced: it still decodes as a msgpack map."""
    record = codec.unpack(_sample("p", "poison", 1.0).to_wire())
    record.update(changes)
    return codec.pack(record)


POISON = {
    "list group_key": _poison(group_key=["a", "b"]),
    "string reward": _poison(reward="1.0"),
    "string group size": _poison(group_size="4"),
    "NaN reward": _poison(reward=math.nan),
    "infinite final reward": _poison(final_reward=-math.inf),
    "empty prompt": _poison(prompt_token_ids=b""),
    "empty response": _poison(response_token_ids=b"", response_logprobs=b"", response_mask=b""),
    "negative token id": _poison(prompt_token_ids=tokens.pack_ids([1, -3])),
    "token id outside the vocabulary": _poison(response_token_ids=tokens.pack_ids([20, 10_000_000, 2])),
    "logprobs not matching tokens": _poison(response_logprobs=tokens.pack_floats([-1.0])),
    "NaN logprob": _poison(response_logprobs=tokens.pack_floats([-1.0, math.nan, -1.0])),
    "empty id": _poison(sample_id=""),
    "zero group size": _poison(group_size=0),
}


async def test_poison_samples_are_dead_lettered_and_training_goes_on(
    real_store: RedisStore, tiny: Path, tmp_path: Path
) -> None:
    """Each unusable sample is dead-lettered with a reason and acknowledged; the good groups make a step."""
    store = real_store
    await store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    for data in POISON.values():
        await store.redis.xadd(store.keys.samples, {"m": data})
    for item in [_sample("a0", "a", 1.0), _sample("a1", "a", 0.0)]:
        await store.redis.xadd(store.keys.samples, {"m": item.to_wire()})
    settings = load_settings(TrainerSettings, model_dir=tiny, groups_per_step=1, checkpoint_dir=tmp_path / "ck",
                             max_steps=1, experiment=store.experiment)
    trainer = Trainer(store, settings)
    await trainer.setup()
    await asyncio.wait_for(trainer.run(asyncio.Event()), 60)
    assert trainer.step == 1
    letters = await store.dead_letters.query_dead_letters(limit=100)
    assert len(letters) == len(POISON) and all(letter.reason for letter in letters)
    assert any("vocabulary" in letter.reason for letter in letters)
    assert (await store.redis.xpending(store.keys.samples, k.TRAINERS_GROUP))["pending"] == 0


async def test_a_step_with_a_non_finite_reward_is_skipped_and_publishes_nothing(
    real_store: RedisStore, tiny: Path, tmp_path: Path
) -> None:
    """Rewards too large for float32 make infinite advantages: no update, no version, entries consumed."""
    settings = load_settings(TrainerSettings, model_dir=tiny, checkpoint_dir=tmp_path / "ck",
                             experiment=real_store.experiment)
    trainer = Trainer(real_store, settings)
    await trainer.setup()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    samples = [_sample("a0", "a", 1e39), _sample("a1", "a", 0.0)]
    assert await trainer.train_step([ReadyGroup("a", samples, [1.0, 1.0], ["1-0", "1-1"])]) == {}
    assert trainer.step == 0 and trainer.collector.counts["steps/skipped_nonfinite"] == 1
    assert trainer.consumed_since_checkpoint == ["1-0", "1-1"]
    assert await real_store.resources.get_latest_resources() is None
    # the algorithm replaces the group at once
    assert await real_store.redis.smembers(real_store.keys.trainer_untrained) == {b"a"}
    assert all((p.detach() == before[n]).all() for n, p in trainer.model.named_parameters())


async def test_a_non_finite_gradient_makes_no_update(real_store: RedisStore, tiny: Path) -> None:
    """A NaN in a gradient: the optimizer does not step, the step is marked non-finite, the gradients are cleared."""
    trainer = Trainer(real_store, load_settings(TrainerSettings, model_dir=tiny, experiment=real_store.experiment))
    await trainer.setup()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    for p in trainer.model.parameters():
        p.grad = torch.ones_like(p)
    next(trainer.model.parameters()).grad[0] = math.nan
    assert not math.isfinite(trainer.update())
    assert trainer.nonfinite is not None and "gradient" in trainer.nonfinite
    assert all(p.grad is None for p in trainer.model.parameters())
    assert all((p.detach() == before[n]).all() for n, p in trainer.model.named_parameters())
