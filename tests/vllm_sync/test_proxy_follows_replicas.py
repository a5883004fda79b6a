"""The proxy's vllm backend with vllm-sync: calls go only to ready replicas, each recorded call carries
the version that served it, and no call's tokens come from two versions (a fake vLLM server swaps
weights between decoding steps, so a call that straddles a load would mix them)."""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import ReplicaState
from fulmen.records.messages import TRACKING_GRACE_S
from fulmen.settings import VllmSyncSettings
from fulmen.store import RedisStore
from fulmen.versions.model_version import publish_model_version
from fulmen_llm_proxy.backends.base import Call, Result
from fulmen_llm_proxy.backends.torch.engine import TorchEngine
from fulmen_llm_proxy.backends.torch.request import SamplingParams
from fulmen_llm_proxy.backends.upstream.replicas import ReplicaView
from fulmen_llm_proxy.backends.upstream.vllm import VllmBackend
from fulmen_llm_proxy.errors import ProxyError
from fulmen_vllm_sync.admin import VllmAdmin
from fulmen_vllm_sync.sync import VllmSync

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fakes.fake_vllm import FakeVllm

PROMPT = [1, 5, 9, 12, 7]
TOKENS = 24


def _call(rollout: str) -> Call:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0}
    return Call("text_completion", body, "tiny", False, TOKENS, 0.0, 1.0, None, [], rollout_id=rollout)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("m")
    return [build_tiny_model(root / f"m{seed}", seed=seed) for seed in range(4)]


async def test_calls_go_to_ready_replicas_only(real_store: RedisStore) -> None:
    backend = VllmBackend(["http://127.0.0.1:1", "http://127.0.0.1:2"])
    view = ReplicaView(real_store)
    backend.follow_replicas(view)
    await real_store.registry.set_replica(ReplicaState("http://127.0.0.1:1/v1", "v3", ready=False, reason="loading v3"))
    await view.refresh()
    assert [p.base_url for p in backend.upstreams.order("r1")] == ["http://127.0.0.1:2"]  # untracked: routable
    await real_store.registry.set_replica(ReplicaState("http://127.0.0.1:2", "v2", ready=False, reason="loading failed"))
    await view.refresh()
    with pytest.raises(ProxyError) as caught:
        backend.upstreams.order("r1")
    assert caught.value.status == 503 and "loading" in str(caught.value)
    await backend.close()


async def test_a_call_waits_while_the_only_replica_loads_then_goes_to_it(real_store: RedisStore) -> None:
    """No 503 for a reload: with every replica loading, a call waits (up to upstream_load_wait_s) and
    goes out once one is ready; past the wait it is refused, saying why."""
    backend = VllmBackend(["http://127.0.0.1:1"])
    view = ReplicaView(real_store)
    backend.follow_replicas(view)
    await real_store.registry.set_replica(ReplicaState("http://127.0.0.1:1", "v3", ready=False, reason="loading v3"))
    await view.refresh()

    async def loaded() -> None:
        await asyncio.sleep(0.3)
        await real_store.registry.set_replica(ReplicaState("http://127.0.0.1:1", "v3", ready=True))
        await view.refresh()

    loading = asyncio.create_task(loaded())
    waiting = asyncio.create_task(backend.upstreams.ready_order("r1"))
    await asyncio.sleep(0.2)
    assert not waiting.done()  # still loading: the call waits instead of a 503
    assert [p.base_url for p in await waiting] == ["http://127.0.0.1:1"]
    await loading
    assert backend.upstreams.load_waits > 0
    await real_store.registry.set_replica(ReplicaState("http://127.0.0.1:1", "v4", ready=False, reason="loading v4"))
    await view.refresh()
    backend.upstreams.policy = dataclasses.replace(backend.upstreams.policy, load_wait_s=0.1)
    with pytest.raises(ProxyError) as caught:
        await backend.upstreams.ready_order("r1")
    assert caught.value.status == 503 and caught.value.code == "upstream_loading"
    await backend.close()


async def test_a_call_sent_untracked_is_uncertain_once_its_replica_is_tracked(real_store: RedisStore) -> None:
    """A call that left for a replica no vllm-sync recorded yet may straddle that replica's first load
    if one started meanwhile: once the view (or, when the view is stale, the registry) knows the
    replica, such a call is not recorded as the default version but sent again."""
    view = ReplicaView(real_store)
    await view.refresh()
    untracked = view.stamp("http://127.0.0.1:3")
    assert untracked.state is None and await view.confirm(untracked) == ""  # still untracked: default
    await real_store.registry.set_replica(ReplicaState("http://127.0.0.1:3/v1", "v1", ready=True))
    # a view read less than TRACKING_GRACE_S ago: no vllm-sync recorded since could have loaded yet
    assert await view.confirm(untracked) == ""
    view.read_at -= TRACKING_GRACE_S  # a stalled refresh: the registry is asked, and knows it
    assert await view.confirm(untracked) is None
    await view.refresh()
    assert await view.confirm(untracked) is None  # the view knows it now
    assert await view.confirm(view.stamp("http://127.0.0.1:3")) == "v1"  # tracked when sent and now


async def test_vllm_sync_changes_no_weights_within_the_grace_after_it_recorded_the_replica(
        real_store: RedisStore, models: list[Path], tmp_path: Path) -> None:
    """The first load of a newly recorded replica waits until TRACKING_GRACE_S after it was recorded."""
    import time

    fake = FakeVllm(models[0])
    url = await fake.start()
    admin = VllmAdmin(url, 10.0)
    settings = VllmSyncSettings(vllm_url=url, model_name="tiny", model_dir=models[0], sync_dir=tmp_path / "sync",
                                sync_retry_s=0.2)
    sync = VllmSync(real_store, admin, settings, check_s=0.2)
    reloads: list[float] = []
    reload = admin.reload_weights

    async def timed_reload(folder: str) -> None:
        reloads.append(time.monotonic())
        await reload(folder)

    admin.reload_weights = timed_reload  # type: ignore[method-assign]
    try:
        await sync.start()
        assert sync.recorded_at is not None
        await publish_model_version(real_store, load_file(str(models[1] / "model.safetensors")), model="tiny")
        _, target = await sync._newest()
        assert target is not None and await sync.sync(*target)
        assert sync.state.model_version == "v1" and sync.state.ready, sync.state
        assert len(reloads) == 1 and reloads[0] - sync.recorded_at >= TRACKING_GRACE_S
    finally:
        await admin.close()
        await fake.stop()


async def test_no_call_mixes_two_versions_while_versions_load(real_store: RedisStore, models: list[Path],
                                                              tmp_path: Path) -> None:
    base = models[0]
    fake = FakeVllm(base)
    url = await fake.start()
    admin = VllmAdmin(url, 10.0)
    settings = VllmSyncSettings(vllm_url=url, model_name="tiny", model_dir=base, sync_dir=tmp_path / "sync",
                                sync_retry_s=0.2)
    sync = VllmSync(real_store, admin, settings, check_s=0.2)
    stop = asyncio.Event()
    syncing = asyncio.create_task(sync.run(stop))
    backend = VllmBackend([url])
    view = ReplicaView(real_store)
    await view.refresh()
    backend.follow_replicas(view)
    refreshing = asyncio.create_task(view.run())
    calls: list[Result] = []
    refused: list[ProxyError] = []
    publishing = True

    async def agent(n: int) -> None:
        i = 0
        while publishing:
            result = Result()
            try:
                await backend.complete(_call(f"r{n}-{i}"), result)
                calls.append(result)
            except ProxyError as e:  # counted: the one replica's reloads must not refuse calls
                refused.append(e)
                await asyncio.sleep(0.05)
            i += 1

    async def served(version: str) -> None:
        while not any((r.model_version or "base") == version for r in calls):
            await asyncio.sleep(0.05)

    agents = [asyncio.create_task(agent(n)) for n in range(3)]
    try:
        # each version is published once the one before has served a call: on a busy machine a load
        # can take longer than any fixed pause, and vllm-sync rightly skips a version a newer one replaced
        await asyncio.wait_for(served("base"), 30)
        for version, model in zip(["v1", "v2", "v3"], models[1:], strict=True):
            await publish_model_version(real_store, load_file(str(model / "model.safetensors")), model="tiny")
            await asyncio.wait_for(served(version), 30)
        await asyncio.sleep(0.5)  # calls that start after the last load
    finally:
        publishing = False
        await asyncio.gather(*agents)
        stop.set()
        await syncing
        refreshing.cancel()
        await backend.close()
        await admin.close()
        await fake.stop()
    expected = {}
    for version, model in zip(["base", "v1", "v2", "v3"], models, strict=True):
        engine = TorchEngine(model)
        expected[version] = (await engine.generate(PROMPT, SamplingParams(max_tokens=TOKENS, temperature=0))).token_ids
        await engine.close()
    assert len(set(map(tuple, expected.values()))) == 4  # the versions answer differently
    seen = {r.model_version for r in calls}
    assert {"v1", "v2", "v3"} <= seen, seen
    assert [(e.status, e.code, e.message) for e in refused] == []  # calls waited for each reload: no 503
    wrong = [(r.model_version, r.token_ids) for r in calls if r.token_ids != expected[r.model_version or "base"]]
    assert wrong == []  # every call's tokens are those of the version it is recorded with


async def test_a_replica_serving_an_adapter_gets_calls_under_the_adapters_name(real_store: RedisStore,
                                                                              models: list[Path]) -> None:
    """A replica whose vllm-sync loaded the version as a LoRA adapter is asked for that adapter by
    name, and the call is recorded with its version; a replica serving its own weights is asked for
    the model the agent named."""
    from safetensors.torch import save_file

    from fulmen.versions.lora import lora_description

    base = models[0]
    fake = FakeVllm(base)
    fake.lora_enabled = True
    url = await fake.start()
    folder = base.parent / "adapter-v4"
    folder.mkdir(exist_ok=True)
    weights = load_file(str(base / "model.safetensors"))
    out_f, in_f = weights["model.layers.0.self_attn.q_proj.weight"].shape
    g = torch.Generator().manual_seed(0)
    adapter = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(4, in_f, generator=g),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(out_f, 4, generator=g)}
    save_file(adapter, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text('{"r": 4, "lora_alpha": 8.0}')
    admin = VllmAdmin(url, 10.0)
    await admin.load_lora("v4", str(folder))
    backend = VllmBackend([url])
    view = ReplicaView(real_store)
    backend.follow_replicas(view)
    try:
        await real_store.registry.set_replica(ReplicaState(url, "v4", ready=True, served_model="v4"))
        await view.refresh()
        adapted = Result()
        await backend.complete(_call("r1"), adapted)
        await real_store.registry.set_replica(ReplicaState(url, "v3", ready=True))
        await view.refresh()
        plain = Result()
        await backend.complete(_call("r2"), plain)
    finally:
        await backend.close()
        await admin.close()
        await fake.stop()
    assert fake.requested_models == ["v4", "tiny"]
    assert (adapted.model_version, plain.model_version) == ("v4", "v3")
    engine = TorchEngine(base)
    await engine.load_weights(adapter, "v4", lora=lora_description(4, 8.0))
    want = (await engine.generate(PROMPT, SamplingParams(max_tokens=TOKENS, temperature=0))).token_ids
    await engine.close()
    assert adapted.token_ids == want != plain.token_ids
