"""The trainer's metrics file after a crash between its checkpoint and the metrics write."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from fulmen import keys as k
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import Sample
from fulmen.settings import TrainerSettings, load_settings
from fulmen.store import RedisStore
from fulmen_trainer.trainer import Trainer


def _group(name: str) -> list[Sample]:
    return [Sample(f"{name}-r{i}.1/t0", "triplet", f"{name}-r{i}", f"{name}-r{i}.1", name, 0, [1, 5, 9, 12],
                   [20 + i % 2, 21, 2], [-1.5, -2.0, -0.5], [1, 1, 1], float(i % 2), float(i % 2), "base",
                   mode="train", group_size=4) for i in range(4)]


async def test_a_step_checkpointed_but_not_logged_is_logged_on_restart(
    real_store: RedisStore, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis gone at the acknowledgement after a checkpoint: the restarted trainer writes that step's line."""
    tiny = build_tiny_model(tmp_path / "tiny")
    await real_store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    for name in ("a", "b"):
        for sample in _group(name):
            await real_store.redis.xadd(real_store.keys.samples, {"m": sample.to_wire()})
    metrics = tmp_path / "m.jsonl"
    settings = load_settings(TrainerSettings, model_dir=tiny, groups_per_step=1, checkpoint_dir=tmp_path / "ck", metrics_file=metrics,
                             experiment=real_store.experiment, metrics_port=0, max_steps=2)
    first = Trainer(real_store, settings)
    await first.setup()

    async def redis_gone(*_: object) -> int:
        raise RedisConnectionError("Connection closed by server.")

    monkeypatch.setattr(real_store.samples, "ack_samples", redis_gone)
    with pytest.raises(RedisConnectionError):
        await asyncio.wait_for(first.run(asyncio.Event()), 60)
    assert first.step == 1 and not metrics.exists()  # checkpointed, not logged
    monkeypatch.undo()

    second = Trainer(real_store, settings)
    await second.setup()
    await asyncio.wait_for(second.run(asyncio.Event()), 60)
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2]
    trained = sorted(sid for line in lines for sid in line["sample_ids"])
    assert trained == sorted(s.sample_id for name in ("a", "b") for s in _group(name))  # each once
