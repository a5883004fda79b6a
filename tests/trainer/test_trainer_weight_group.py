"""The trainer with ``weight_group``: each full version is held for the weight group (and said so in
the store) before its publish starts, so vLLM servers receive it while its folder is written."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import Sample
from fulmen.settings import TrainerSettings, load_settings
from fulmen.store import RedisStore
from fulmen.versions.model_version import fetch_model_version
from fulmen.versions.transport.group_asks import held
from fulmen_trainer.groups import ReadyGroup
from fulmen_trainer.trainer import Trainer
from fulmen_trainer.weight_sender import WeightSender


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _sample(rollout: str, reward: float) -> Sample:
    return Sample(f"{rollout}.1/t0", "triplet", rollout, f"{rollout}.1", "a", 0, [1, 5, 9, 12], [20, 21, 2],
                  [-1.5, -2.0, -0.5], [1, 1, 1], reward, reward, "base", mode="train", group_size=2)


async def test_a_full_version_is_held_for_the_group_before_its_publish(real_store: RedisStore, tiny: Path,
                                                                       tmp_path: Path) -> None:
    settings = load_settings(TrainerSettings, model_dir=tiny, checkpoint_dir=tmp_path / "ck", weight_group=True,
                             experiment=real_store.experiment)
    trainer = Trainer(real_store, settings)
    await trainer.setup()
    trainer.sender = WeightSender(real_store, settings)
    seen: list[str | None] = []
    publish = trainer.publisher.publish

    async def publishing(*args: Any, **kwargs: Any) -> Any:
        seen.append(await held(real_store))  # what the store says is held as the publish starts
        return await publish(*args, **kwargs)

    trainer.publisher.publish = publishing  # type: ignore[method-assign]
    await real_store.redis.hset(real_store.keys.weight_group, "host", "127.0.0.1")  # as `advertise` writes it
    await trainer.train_step([ReadyGroup("a", [_sample("a0", 1.0), _sample("a1", 0.0)], [1.0, 1.0], ["1-0", "1-1"])])
    version = trainer.version.name
    assert trainer.step == 1 and seen == [version]
    assert trainer.sender.held is not None and trainer.sender.held[0] == version
    published = await fetch_model_version(real_store, version)
    assert published.keys() == trainer.sender.held[1].keys()
    assert all(torch.equal(published[n], t) for n, t in trainer.sender.held[1].items())
