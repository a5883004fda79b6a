"""The trainer against a real Redis and a tiny model: groups, steps, publishing, checkpoints, resume."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fulmen import keys as k
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import Sample, SampleSkip
from fulmen.settings import TrainerSettings, load_settings
from fulmen.store import RedisStore
from fulmen.versions.model_version import ModelVersion
from fulmen_trainer.checkpoints import CheckpointOfAnotherExperiment, recover_pending
from fulmen_trainer.groups import GroupCollector
from fulmen_trainer.trainer import Trainer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _sample(rollout: str, group: str, reward: float, size: int = 4, version: str = "base") -> Sample:
    prompt = [1, 5 + len(rollout) % 7, 9, 12]
    response = [20 + int(reward), 21, 2]
    return Sample(f"{rollout}.1/t0", "triplet", rollout, f"{rollout}.1", group, 0, prompt, response,
                  [-1.5, -2.0, -0.5], [1, 1, 1], reward, reward, version, mode="train", group_size=size)


async def _push(store: RedisStore, items: list[Sample | SampleSkip]) -> None:
    for item in items:
        await store.redis.xadd(store.keys.samples, {"m": item.to_wire()})


def _group(name: str, rewards: list[float]) -> list[Sample | SampleSkip]:
    return [_sample(f"{name}-r{i}", name, r, size=len(rewards)) for i, r in enumerate(rewards)]


def test_groups_complete_when_every_rollout_is_terminal() -> None:
    """A group waits for all n rollouts; skips count towards n; fewer than two usable drops it."""
    c = GroupCollector()
    for i, item in enumerate(_group("a", [1.0, 0.0, 1.0])[:2]):
        c.add(f"1-{i}", item)
    assert c.take_complete(0) == []
    c.add("1-9", SampleSkip("a-r2", "a-r2.1", "a", "failed", "rollout failed", group_size=3))
    (ready,) = c.take_complete(0)
    assert [s.rollout_id for s in ready.samples] == ["a-r0", "a-r1"]
    assert sorted(ready.entry_ids) == ["1-0", "1-1", "1-9"]
    c.add("2-0", _sample("b-r0", "b", 1.0, size=2))
    c.add("2-1", SampleSkip("b-r1", None, "b", "failed", "rollout failed", group_size=2))
    (dropped,) = c.take_complete(0)
    assert dropped.samples == [] and dropped.entry_ids == ["2-0", "2-1"]
    assert c.counts["groups/dropped_too_few"] == 1


def test_learning_rate_warms_up_then_decays(tmp_path: Path) -> None:
    """Linear warm-up to the rate, then linear decay to lr_final, then flat."""
    settings = load_settings(TrainerSettings, model_dir=tmp_path, learning_rate=1e-3, lr_warmup_steps=4, lr_decay_steps=10,
                             lr_final=2e-4)
    t = Trainer.__new__(Trainer)
    t.s = settings
    assert [round(t.learning_rate(i), 6) for i in (0, 1, 3, 4, 9, 14, 100)] == [
        0.00025, 0.0005, 0.001, 0.001, 0.0006, 0.0002, 0.0002,
    ]


def test_validation_samples_are_never_trained_on() -> None:
    """Samples of val or test rollouts (validation, APO) are refused by the collector and counted."""
    from dataclasses import replace

    c = GroupCollector()
    assert c.add("1", replace(_sample("a", "g", 1.0, size=1), mode="val")) is False
    assert c.groups == {} and c.counts["ignored/val"] == 1


def test_stale_samples_are_dropped_or_downweighted() -> None:
    """Beyond max_staleness a sample is dropped, or halved per extra version, as configured."""
    for policy, expected in (("drop", [1.0]), ("downweight", [1.0, 0.25])):
        c = GroupCollector(max_staleness=1, stale_policy=policy)
        c.add("1", _sample("a", "g", 1.0, size=2, version="v5"))
        c.add("2", _sample("b", "g", 0.0, size=2, version="v2"))
        (ready,) = c.take_complete(5)
        assert ready.weights == expected or (policy == "drop" and ready.samples == [])


async def test_a_step_trains_publishes_checkpoints_and_acknowledges(real_store: RedisStore, tiny: Path, tmp_path: Path) -> None:
    """Two complete groups make one step: version v1 published, checkpoint written, entries acked, metrics logged."""
    await real_store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    await _push(real_store, _group("a", [1.0, 0.0, 1.0, 0.0]) + _group("b", [1.0, 1.0, 0.0, 1.0]))
    from fulmen.store.redis.embedded import free_port

    port = free_port()
    settings = load_settings(TrainerSettings, model_dir=tiny, groups_per_step=2, checkpoint_dir=tmp_path / "ck",
                             metrics_file=tmp_path / "m.jsonl", max_steps=1, experiment=real_store.experiment,
                             learning_rate=1e-3, metrics_port=port)
    trainer = Trainer(real_store, settings)
    await trainer.setup()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    await asyncio.wait_for(trainer.run(asyncio.Event()), 60)
    assert trainer.step == 1 and trainer.version == ModelVersion(1, "v1")
    assert any(not (p.detach() == before[n]).all() for n, p in trainer.model.named_parameters())
    latest = await real_store.resources.get_latest_resources()
    assert latest is not None and latest.resources["llm"]["model_version"] == "v1"
    (line,) = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert sorted(line["sample_ids"]) == sorted(f"{g}-r{i}.1/t0" for g in "ab" for i in range(4))
    assert line["rollout/reward_mean"] == pytest.approx(5 / 8)
    assert line["rollout/logp_mismatch"] > 0  # the made-up behaviour logprobs are not the model's
    pending = await real_store.redis.xpending(real_store.keys.samples, k.TRAINERS_GROUP)
    assert pending["pending"] == 0
    assert (tmp_path / "ck" / "rank-0" / "LATEST").read_text() == "step-1"
    import urllib.request

    scraped = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    assert 'fulmen_trainer_step{rank="0"} 1.0' in scraped
    assert 'fulmen_trainer_rollout_reward_mean{rank="0"} 0.625' in scraped


async def test_a_dropped_group_is_listed_for_the_algorithm(real_store: RedisStore, tiny: Path, tmp_path: Path) -> None:
    """A complete group with one usable rollout is dropped and listed in the store (the algorithm
    replaces it); the trained group is not listed."""
    await real_store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    failed = SampleSkip("d-r1", "d-r1.1", "d", "failed", "rollout failed", group_size=2)
    await _push(real_store, [_sample("d-r0", "d", 1.0, size=2), failed, *_group("t", [1.0, 0.0])])
    settings = load_settings(TrainerSettings, model_dir=tiny, groups_per_step=1, checkpoint_dir=tmp_path / "ck",
                             max_steps=1, experiment=real_store.experiment)
    trainer = Trainer(real_store, settings)
    await trainer.setup()
    await asyncio.wait_for(trainer.run(asyncio.Event()), 60)
    assert trainer.step == 1 and trainer.collector.counts["groups/dropped_too_few"] == 1
    assert await real_store.redis.smembers(real_store.keys.trainer_untrained) == {b"d"}


async def test_a_group_that_waits_for_a_later_step_is_weighed_against_that_step(
    real_store: RedisStore, tiny: Path, tmp_path: Path
) -> None:
    """Three groups of base-version samples complete at once and a step takes two: the third waits,
    and once v1 is out it is one version behind, past a bound of 0, so it is dropped (and listed for
    the algorithm), never trained on by the weights after v1."""
    await real_store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    await _push(real_store, _group("a", [1.0, 0.0]) + _group("b", [1.0, 0.0]) + _group("c", [1.0, 0.0]))
    fresh = [_sample(f"{g}-r{i}", g, float(i), size=2, version="v1") for g in "de" for i in range(2)]
    settings = load_settings(TrainerSettings, model_dir=tiny, groups_per_step=2, checkpoint_dir=tmp_path / "ck",
                             metrics_file=tmp_path / "m.jsonl", max_steps=2, max_staleness=0,
                             experiment=real_store.experiment)
    trainer = Trainer(real_store, settings)
    await trainer.setup()
    run = asyncio.create_task(trainer.run(asyncio.Event()))
    for _ in range(600):
        if trainer.step == 1:
            break
        await asyncio.sleep(0.05)
    await _push(real_store, fresh)
    await asyncio.wait_for(run, 60)
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    trained = [{sid.split("-")[0] for sid in line["sample_ids"]} for line in lines]
    assert trained == [{"a", "b"}, {"d", "e"}]
    assert await real_store.redis.smembers(real_store.keys.trainer_untrained) == {b"c"}
    assert trainer.collector.counts["samples/dropped_stale"] == 2


@pytest.mark.parametrize("every", [1, 3], ids=["checkpoint-every-step", "checkpoint-every-3"])
async def test_restart_after_a_kill_consumes_every_sample_exactly_once(
    real_store: RedisStore, redis_url: str, tiny: Path, tmp_path: Path, every: int
) -> None:
    """SIGKILL mid-run, restart: the sample ids trained on equal the ids produced, each once — also
    when checkpoints (and versions) come every 3 steps and the steps since the last one are lost."""
    await real_store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    produced = []
    for g in range(8):
        items = _group(f"g{g}", [1.0, 0.0, float(g % 2), 1.0])
        produced += [s.sample_id for s in items if isinstance(s, Sample)]
        await _push(real_store, items)
    metrics = tmp_path / "m.jsonl"
    env = {**os.environ, "REDIS_URL": redis_url, "FULMEN_EXPERIMENT": real_store.experiment,
           "FULMEN_MODEL_DIR": str(tiny), "FULMEN_GROUPS_PER_STEP": "1", "FULMEN_CHECKPOINT_DIR": str(tmp_path / "ck"),
           "FULMEN_METRICS_FILE": str(metrics), "FULMEN_TORCH_THREADS": "1",
           "FULMEN_CHECKPOINT_EVERY": str(every), "FULMEN_PUBLISH_EVERY": str(every)}
    fulmen = str(Path(sys.executable).with_name("fulmen"))

    def steps_logged() -> int:
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    first = subprocess.Popen([fulmen, "trainer"], env=env)
    try:
        for _ in range(600):
            if steps_logged() >= 3:
                break
            await asyncio.sleep(0.05)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    finally:
        first.kill()
    assert 3 <= steps_logged() < 8, "the kill should land mid-run"
    checkpoints = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "ck" / "rank-0").glob("step-*"))
    assert all(step % every == 0 for step in checkpoints)
    second = subprocess.Popen([fulmen, "trainer", "--max-steps", "8"], env=env)
    try:
        assert second.wait(timeout=120) == 0
    finally:
        second.kill()
    lines = [json.loads(x) for x in metrics.read_text().splitlines()]
    trained = [sid for line in lines for sid in line["sample_ids"]]
    assert sorted(trained) == sorted(produced)  # every sample, once
    assert [line["step"] for line in lines] == list(range(1, 9))
    assert (await real_store.redis.xpending(real_store.keys.samples, k.TRAINERS_GROUP))["pending"] == 0


async def test_restart_recovers_every_pending_sample_past_the_first_page(real_store: RedisStore, tiny: Path) -> None:
    """More entries pending than one read returns (1,000): a restarted trainer puts all of them back."""
    groups = [_group(f"p{g}", [1.0, 0.0, 1.0]) for g in range(600)]
    await _push(real_store, [s for g in groups for s in g[:2]] + [g[2] for g in groups[:10]])
    await real_store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    read = []
    while batch := await real_store.samples.read_samples(k.TRAINERS_GROUP, "trainer-0", count=500):
        read += batch  # the trainer read them all, then died before any checkpoint
    assert len(read) == 1210
    settings = load_settings(TrainerSettings, model_dir=tiny, groups_per_step=1000)
    trainer = Trainer(real_store, settings)
    await recover_pending(trainer, set())
    complete = trainer.collector.take_complete(0)
    assert len(complete) == 10  # the groups whose third sample arrived
    assert sum(len(g.entry_ids) for g in complete) + trainer.collector.pending_samples() == 1210


class _Killed(Exception):
    """Stands for a SIGKILL at one point of the step: nothing after it runs."""


async def _one_step_then_killed(store: RedisStore, settings: TrainerSettings, monkeypatch: pytest.MonkeyPatch,
                                after_publishing: bool) -> None:
    import fulmen_trainer.publishing as trainer_module

    real = trainer_module.publish_model_version

    async def publish_then_die(store_: RedisStore, *args: object, **kwargs: object) -> object:
        if after_publishing:
            await real(store_, *args, **kwargs)
        else:  # killed half-way through writing the chunks: the name is claimed, no resource names it
            await store_.redis.xadd(store_.keys.weights(str(kwargs["model_version"])), {"m": b"half"}, id="0-1")
        raise _Killed

    monkeypatch.setattr(trainer_module, "publish_model_version", publish_then_die)
    trainer = Trainer(store, settings)
    await trainer.setup()
    with pytest.raises(_Killed):
        await asyncio.wait_for(trainer.run(asyncio.Event()), 60)
    monkeypatch.setattr(trainer_module, "publish_model_version", real)


@pytest.mark.parametrize("after_publishing", [False, True], ids=["before-publishing", "after-publishing"])
async def test_every_served_version_is_in_the_lineage_a_restart_resumes_from(
    real_store: RedisStore, tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, after_publishing: bool
) -> None:
    """A trainer killed just before or just after publishing a version: after the restart, v1 is
    published with exactly the weights the trainer resumed from (step 1), and the next step is v2."""
    from fulmen.telemetry.steps import read_curve
    from fulmen.versions.model_version import fetch_model_version

    await real_store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    await _push(real_store, _group("a", [1.0, 0.0, 1.0, 0.0]) + _group("b", [1.0, 1.0, 0.0, 1.0]))
    settings = load_settings(TrainerSettings, model_dir=tiny, groups_per_step=1, checkpoint_dir=tmp_path / "ck",
                             metrics_file=tmp_path / "m.jsonl", max_steps=2, experiment=real_store.experiment,
                             learning_rate=1e-3)
    await _one_step_then_killed(real_store, settings, monkeypatch, after_publishing)

    restarted = Trainer(real_store, settings)
    await restarted.setup()
    assert restarted.step == 1 and restarted.version == ModelVersion(1, "v1")
    latest = await real_store.resources.get_latest_resources()
    assert latest is not None and latest.resources["llm"]["model_version"] == "v1"
    await restarted.metrics.flush()
    (logged,) = await read_curve(real_store.redis, real_store.keys)  # the algorithm paces on it
    assert (logged.step, logged.model_version) == (1, "v1")
    served = await fetch_model_version(real_store, "v1")
    for name, param in restarted.model.state_dict().items():
        assert torch.equal(served[name], param), name
    await asyncio.wait_for(restarted.run(asyncio.Event()), 60)
    assert restarted.step == 2 and restarted.version == ModelVersion(2, "v2")
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [(line["step"], line["model_version"]) for line in lines] == [(1, "v1"), (2, "v2")]


async def test_a_checkpoint_resumes_only_in_the_experiment_that_wrote_it(
    real_store: RedisStore, tiny: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A checkpoint records its experiment: another experiment's trainer refuses it at setup, naming
    both and the way out; its own resumes it; one that records none (older) resumes, with a warning."""
    await real_store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    await _push(real_store, _group("a", [1.0, 0.0, 1.0, 0.0]))
    a, b = real_store.experiment, f"{real_store.experiment}-b"
    common = {"model_dir": tiny, "groups_per_step": 1, "checkpoint_dir": tmp_path / "ck",
              "metrics_file": tmp_path / "m.jsonl", "max_steps": 1}
    first = Trainer(real_store, load_settings(TrainerSettings, experiment=a, **common))
    await first.setup()
    await asyncio.wait_for(first.run(asyncio.Event()), 60)
    meta_file = tmp_path / "ck" / "rank-0" / "step-1" / "meta.json"
    assert json.loads(meta_file.read_text())["experiment"] == a

    with pytest.raises(CheckpointOfAnotherExperiment) as refused:
        await Trainer(real_store, load_settings(TrainerSettings, experiment=b, **common)).setup()
    message = str(refused.value)
    assert f"experiment {a!r}" in message and f"experiment {b!r}" in message
    assert "--checkpoint-dir" in message and f"FULMEN_EXPERIMENT={a}" in message

    resumed = Trainer(real_store, load_settings(TrainerSettings, experiment=a, **common))
    await resumed.setup()
    assert resumed.step == 1 and resumed.version == ModelVersion(1, "v1")

    older = json.loads(meta_file.read_text())
    del older["experiment"]
    meta_file.write_text(json.dumps(older))
    with caplog.at_level(logging.WARNING, logger="fulmen_trainer.checkpoints"):
        taken_up = Trainer(real_store, load_settings(TrainerSettings, experiment=b, **common))
        await taken_up.setup()
    assert taken_up.step == 1 and "records no experiment" in caplog.text
