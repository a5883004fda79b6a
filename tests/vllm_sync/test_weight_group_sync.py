"""Full versions over the weight group, end to end in this process: the trainer's `WeightSender`
(rank 0, advertised in a real Redis) and `fulmen vllm-sync` with ``weight_group`` against a fake vLLM
server whose one worker runs Fulmen's worker extension. No folder is written or reloaded; without a
trainer's group, or without the extension, versions load from folders as before."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.settings import TrainerSettings, VllmSyncSettings, load_settings
from fulmen.store import RedisStore
from fulmen.versions.model_version import publish_model_version
from fulmen.versions.transport.group_asks import advertised
from fulmen_llm_proxy.backends.torch.request import SamplingParams
from fulmen_trainer.weight_sender import WeightSender
from fulmen_vllm_sync.admin import VllmAdmin
from fulmen_vllm_sync.sync import VllmSync

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fakes.fake_vllm import FakeVllm
from polling import until

PROMPT = [1, 5, 9, 12, 7]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("m")
    return tuple(build_tiny_model(root / name, seed=seed) for name, seed in (("base", 0), ("a", 1), ("b", 2)))  # type: ignore[return-value]


async def _ids(fake: FakeVllm) -> list[int]:
    return (await fake.engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))).token_ids


async def _ready(store: RedisStore, url: str, version: str) -> bool:
    state = (await store.registry.query_replicas()).get(url)
    return state is not None and state.ready and state.model_version == version


@contextlib.asynccontextmanager
async def _sending(store: RedisStore, model_dir: Path) -> AsyncIterator[WeightSender]:
    """The trainer's end, advertised and answering asks, until the block ends."""
    settings = load_settings(TrainerSettings, model_dir=model_dir, experiment=store.experiment, weight_group=True,
                             weight_group_timeout_s=20.0)
    sender = WeightSender(store, settings)
    await sender.start()
    stop = asyncio.Event()
    task = asyncio.create_task(sender.run(stop))
    try:
        yield sender
    finally:
        stop.set()
        await task
        await sender.close()


@contextlib.asynccontextmanager
async def _syncing(store: RedisStore, base: Path, tmp: Path,
                   timeout_s: float = 20.0) -> AsyncIterator[tuple[FakeVllm, VllmSync]]:
    """A fake vLLM server with the worker extension, and vllm-sync with weight_group following it."""
    fake = FakeVllm(base)
    fake.worker_extension = True
    await fake.start()
    settings = VllmSyncSettings(vllm_url=fake.url, model_name="tiny", model_dir=base, sync_dir=tmp / "sync",
                                sync_retry_s=0.2, weight_group=True, weight_group_timeout_s=timeout_s)
    sync = VllmSync(store, VllmAdmin(fake.url, 30.0), settings, check_s=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(sync.run(stop))
    try:
        yield fake, sync
    finally:
        stop.set()
        await task
        await sync.admin.close()
        await fake.stop()


async def _publish(store: RedisStore, sender: WeightSender | None, model: Path, version: str) -> dict:
    state = load_file(str(model / "model.safetensors"))
    if sender is not None:
        await sender.hold(version, state)  # as the trainer's publish does, before the folder is written
    await publish_model_version(store, state, model="tiny")
    return state


async def _greedy(model_dir: Path) -> list[int]:
    from fulmen_llm_proxy.backends.torch.engine import TorchEngine

    engine = TorchEngine(model_dir)
    ids = (await engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))).token_ids
    await engine.close()
    return ids


async def test_full_versions_arrive_over_the_group_without_a_folder(real_store: RedisStore, models, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two versions in a row: each is asked for, sent by the trainer's rank 0 and received into the
    worker's weights (the server paused around it), served, verified; the group is joined once and no
    folder is reloaded."""
    base, a, b = models
    async with _syncing(real_store, base, tmp_path) as (fake, _), _sending(real_store, base) as sender:
        assert (await advertised(real_store)).port == sender.rendezvous.port  # type: ignore[union-attr]
        await until(lambda: _ready(real_store, fake.url, "base"))
        await _publish(real_store, sender, a, "v1")
        await until(lambda: _ready(real_store, fake.url, "v1"))
        assert await _ids(fake) == await _greedy(a)
        await _publish(real_store, sender, b, "v2")
        await until(lambda: _ready(real_store, fake.url, "v2"))
        assert await _ids(fake) == await _greedy(b)
        assert fake.calls == ["fulmen_workers", "fulmen_join",
                              "pause:wait", "fulmen_receive", "version:v1", "reset_prefix_cache", "resume",
                              "pause:wait", "fulmen_receive", "version:v2", "reset_prefix_cache", "resume"]
        assert sender.sent == 2
        assert not list((tmp_path / "sync").glob("v*"))  # no version folder written


async def test_a_held_version_is_received_while_its_folder_is_written_and_served_once_announced(
        real_store: RedisStore, models, tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """The trainer holds v1 before its publish ends: vllm-sync receives it at once, but the server
    serves it only once a resources entry names it. Held and never announced (the publish failed),
    the replica stays out of routing with the reason, and the version announced next loads."""
    caplog.set_level(logging.INFO, logger="fulmen_vllm_sync")
    base, a, b = models
    async with (_syncing(real_store, base, tmp_path, timeout_s=5.0) as (fake, _),
                _sending(real_store, base) as sender):
        await until(lambda: _ready(real_store, fake.url, "base"))
        state_a = load_file(str(a / "model.safetensors"))
        await sender.hold("v1", state_a)  # the trainer's copy, its folder still being written
        await until(lambda: _called(fake, "fulmen_receive"))
        await asyncio.sleep(0.5)
        replica = (await real_store.registry.query_replicas())[fake.url]
        assert not replica.ready and replica.model_version == "base" and "version:v1" not in fake.calls
        await publish_model_version(real_store, state_a, model="tiny")  # announced: v1
        await until(lambda: _ready(real_store, fake.url, "v1"))
        assert await _ids(fake) == await _greedy(a)
        assert sender.sent == 1 and "reload_weights" not in fake.calls
        assert "received over the weight group while its folder was written" in caplog.text

        await sender.hold("v2", load_file(str(b / "model.safetensors")))  # never announced
        await until(lambda: _said(caplog, "did not announce it within 5 s"), 30)
        replica = (await real_store.registry.query_replicas())[fake.url]
        assert not replica.ready and replica.model_version == "v1"
        await _publish(real_store, sender, b, "v2")
        await until(lambda: _ready(real_store, fake.url, "v2"))
        assert await _ids(fake) == await _greedy(b)


async def _called(fake: FakeVllm, call: str) -> bool:
    return call in fake.calls


async def _said(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return text in caplog.text


async def test_without_a_trainer_s_group_or_the_extension_versions_load_from_folders(real_store: RedisStore, models,
                                                                                       tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    """No trainer advertises a group: the version is reloaded from a folder, said once. A server
    without the worker extension: said with the flag to add, and folders from then on."""
    base, a, b = models
    async with _syncing(real_store, base, tmp_path) as (fake, sync):
        await until(lambda: _ready(real_store, fake.url, "base"))
        await _publish(real_store, None, a, "v1")
        await until(lambda: _ready(real_store, fake.url, "v1"))
        assert "reload_weights" in fake.calls and "fulmen_join" not in fake.calls
        assert "no trainer advertises a weight group" in caplog.text

        fake.worker_extension = False
        async with _sending(real_store, base) as sender:
            await _publish(real_store, sender, b, "v2")
            await until(lambda: _ready(real_store, fake.url, "v2"))
            assert await _ids(fake) == await _greedy(b)
            assert "--worker-extension-cls fulmen.versions.transport.group.WorkerExtension" in caplog.text
            assert sync.group is None and fake.calls.count("reload_weights") == 2


async def test_a_poison_or_stale_ask_does_not_stop_the_sender(real_store: RedisStore, models) -> None:  # type: ignore[no-untyped-def]
    """An ask that does not decode is dead-lettered with the reason; one Redis added long ago (aged by
    its entry id, not the asker's clock) is skipped without joining anything; a send to a group the
    trainer does not hold is logged; the sender answers on."""
    import time

    from fulmen.errors import RecordError
    from fulmen.records import WeightGroupAction, WeightGroupAsk
    from fulmen.versions.transport.group_asks import ask

    with pytest.raises(RecordError, match="world_size"):  # a group of one has nobody to send to
        WeightGroupAsk.from_wire(WeightGroupAsk(WeightGroupAction.JOIN, "g1", 1).to_wire())
    base, _, _ = models
    await real_store.redis.xadd(real_store.keys.weight_group_asks, {"m": WeightGroupAsk(
        WeightGroupAction.JOIN, "old", 2, "", "vllm-sync x", time.time()).to_wire()}, id="1-0")  # Redis: 1970
    async with _sending(real_store, base) as sender:
        await real_store.redis.xadd(real_store.keys.weight_group_asks, {"m": b"\x93not a record"})
        await ask(real_store, WeightGroupAsk(WeightGroupAction.SEND, "nobody", 2, "v1", "vllm-sync y", time.time()))
        await sender.answer(WeightGroupAsk(WeightGroupAction.JOIN, "old", 2, "", "vllm-sync x"), age_s=3600)

        async def handled(letters: int) -> bool:
            pending = await real_store.redis.xpending(real_store.keys.weight_group_asks, "weight-senders")
            return await real_store.redis.xlen(real_store.keys.dead_letters) == letters and pending["pending"] == 0

        await until(lambda: handled(1), 20)
        assert sender.groups == {}
        await real_store.redis.xadd(real_store.keys.weight_group_asks, {"m": b"\x93again"})
        await until(lambda: handled(2), 20)  # it answers on


async def test_a_receiver_that_goes_away_drops_its_group_not_the_sender(real_store: RedisStore, models) -> None:  # type: ignore[no-untyped-def]
    """A worker joins, then never receives (its server died): the send fails inside gloo after the
    timeout, the group is dropped, and the sender answers the next ask; an asker that joins again
    leaves its older group behind."""
    import threading
    import time

    from fulmen.records import WeightGroupAction, WeightGroupAsk
    from fulmen.versions.transport.group import WorkerExtension
    from fulmen.versions.transport.group_asks import advertised

    base, a, _ = models
    settings = load_settings(TrainerSettings, model_dir=base, experiment=real_store.experiment, weight_group=True,
                             weight_group_timeout_s=3.0)
    sender = WeightSender(real_store, settings)
    await sender.start()
    where = await advertised(real_store)
    assert where is not None

    class Worker(WorkerExtension):
        def fulmen_worker_rank(self) -> int:
            return 0

    try:
        for name in ("first", "second"):
            worker = Worker()
            joining = threading.Thread(target=worker.fulmen_join, args=(where.host, where.port, 2, name),
                                       kwargs={"timeout_s": 3.0}, daemon=True)
            joining.start()
            await sender.answer(WeightGroupAsk(WeightGroupAction.JOIN, name, 2, "", "vllm-sync z", time.time()))
            joining.join(5)
        assert list(sender.groups) == ["second"] and sender.group_of == {"vllm-sync z": "second"}
        await sender.hold("v1", load_file(str(a / "model.safetensors")))
        await sender.answer(WeightGroupAsk(WeightGroupAction.SEND, "second", 2, "v1", "vllm-sync z", time.time()))
        assert sender.groups == {} and sender.sent == 0  # the worker never received: dropped
    finally:
        await sender.close()


async def test_an_ask_for_a_version_not_held_yet_waits_for_it_then_is_refused(real_store: RedisStore, models,
                                                                                 monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The resources announce a version before the trainer's copy of it is taken: an ask for it waits
    for the copy (or takes a newer one) rather than get the version before; none coming, refused."""
    from fulmen_trainer import weight_sender

    base, a, _ = models
    monkeypatch.setattr(weight_sender, "HELD_WAIT_S", 1.0)
    sender = WeightSender(real_store, load_settings(TrainerSettings, model_dir=base, weight_group=True))
    state = load_file(str(a / "model.safetensors"))
    await sender.hold("v1", state)
    assert await sender._held_for("v2") is None
    later = asyncio.create_task(asyncio.sleep(0.3))
    later.add_done_callback(lambda _: asyncio.ensure_future(sender.hold("v2", state)))
    held = await sender._held_for("v2")
    assert held is not None and held[0] == "v2"
    await sender.hold("v3", state)
    assert (await sender._held_for("v2"))[0] == "v3"  # type: ignore[index]


async def test_a_restarted_trainer_is_joined_again_before_the_next_load(real_store: RedisStore, models,
                                                                         tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The trainer restarts (a new rendezvous, its groups gone): vllm-sync sees the advertisement
    change before it pauses the server, joins the new trainer's group, and the next version arrives
    over it."""
    base, a, b = models
    async with _syncing(real_store, base, tmp_path) as (fake, _):
        async with _sending(real_store, base) as sender:
            await _publish(real_store, sender, a, "v1")
            await until(lambda: _ready(real_store, fake.url, "v1"))
        async with _sending(real_store, base) as sender:  # the trainer again
            await _publish(real_store, sender, b, "v2")
            await until(lambda: _ready(real_store, fake.url, "v2"))
            assert await _ids(fake) == await _greedy(b)
        assert fake.calls.count("fulmen_join") == 2 and "reload_weights" not in fake.calls
