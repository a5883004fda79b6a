"""`fulmen vllm-sync` against a fake vLLM server built on the torch engine: versions loaded and
verified, and every fault — a hang, a 500 half-way through a load, a load that silently does nothing,
a restart — leaves the replica out of routing until a later sync succeeds."""

from __future__ import annotations

import asyncio
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.settings import VllmSyncSettings
from fulmen.store import RedisStore
from fulmen.versions.model_version import llm_resource, publish_model_version
from fulmen_llm_proxy.backends.torch.engine import TorchEngine
from fulmen_llm_proxy.backends.torch.request import SamplingParams
from fulmen_vllm_sync.admin import AdminError, VllmAdmin
from fulmen_vllm_sync.sync import VllmSync

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fakes.fake_vllm import FakeVllm
from polling import until
from vllm_sync_helpers import random_adapter

PROMPT = [1, 5, 9, 12, 7]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("m")
    return build_tiny_model(root / "base", seed=0), build_tiny_model(root / "trained", seed=1)


async def _greedy_with(model_dir: Path, weights: dict[str, torch.Tensor] | None = None) -> list[int]:
    engine = TorchEngine(model_dir)
    if weights is not None:
        await engine.load_weights(weights, "x")
    ids = (await engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))).token_ids
    await engine.close()
    return ids


async def _served_ids(fake: FakeVllm) -> list[int]:
    return (await fake.engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))).token_ids


async def _run(store: RedisStore, fake: FakeVllm, base: Path, tmp: Path, **knobs):  # type: ignore[no-untyped-def]
    admin = VllmAdmin(fake.url, knobs.pop("timeout_s", 10.0))
    settings = VllmSyncSettings(vllm_url=fake.url, model_name="tiny", model_dir=base, sync_dir=tmp / "sync",
                                sync_retry_s=knobs.pop("retry_s", 0.2), **knobs)
    sync = VllmSync(store, admin, settings, check_s=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(sync.run(stop))
    return sync, stop, task, admin


async def _replica(store: RedisStore, url: str):  # type: ignore[no-untyped-def]
    return (await store.registry.query_replicas()).get(url)


async def test_a_published_version_is_loaded_verified_and_marked_ready(real_store: RedisStore, models, tmp_path):
    base, trained = models
    fake = FakeVllm(base)
    await fake.start()
    _, stop, task, admin = await _run(real_store, fake, base, tmp_path)
    try:
        await until(lambda: _ready(real_store, fake.url, "base"))
        await publish_model_version(real_store, load_file(str(trained / "model.safetensors")), model="tiny")
        await until(lambda: _ready(real_store, fake.url, "v1"))
        assert await _served_ids(fake) == await _greedy_with(trained)  # the trained weights, really
        assert fake.calls == ["pause:wait", "reload_weights", "version:v1", "reset_prefix_cache", "resume"]
        state = await _replica(real_store, fake.url)
        assert state.generation == 1 and state.reason == ""
    finally:
        stop.set()
        await task
        await admin.close()
        await fake.stop()


async def test_a_version_that_cannot_be_read_leaves_the_server_serving_its_weights(real_store: RedisStore, models,
                                                                                  tmp_path, caplog):
    """Weights deleted (not a stored version) or corrupt: the server is not touched, stays ready on what
    it served, and the next version is loaded."""
    base, trained = models
    fake = FakeVllm(base)
    await fake.start()
    sync, stop, task, admin = await _run(real_store, fake, base, tmp_path)
    try:
        await until(lambda: _ready(real_store, fake.url, "base"))
        update = await publish_model_version(real_store, load_file(str(trained / "model.safetensors")), model="tiny")
        await real_store.redis.delete(llm_resource(update)["weights"]["stream"])  # type: ignore[index]
        await real_store.redis.zrem(real_store.keys.stored_versions, "v1")  # as retention deletes one
        await until(lambda: _said(caplog, "v1 cannot be read"))
        assert fake.calls == [] and await _ready(real_store, fake.url, "base")
        await publish_model_version(real_store, load_file(str(trained / "model.safetensors")), model="tiny")
        await until(lambda: _ready(real_store, fake.url, "v2"))
        assert sync.syncs["failed"] >= 1
    finally:
        stop.set()
        await task
        await admin.close()
        await fake.stop()


async def test_a_version_redis_lost_takes_the_replica_out_of_routing_and_is_asked_for(
        real_store: RedisStore, models, tmp_path):
    """Weights a restarted Redis lost (still a stored version): not ready, naming it, one rebuild asked; the rebuilt one loads."""
    from fulmen.records import VersionRebuild
    from fulmen.versions.rebuild_asks import announce_rebuilt

    base, trained = models
    fake = FakeVllm(base)
    await fake.start()
    _, stop, task, admin = await _run(real_store, fake, base, tmp_path)
    try:
        await until(lambda: _ready(real_store, fake.url, "base"))
        published = load_file(str(trained / "model.safetensors"))
        update = await publish_model_version(real_store, published, model="tiny")
        chunks = await real_store.redis.xrange(llm_resource(update)["weights"]["stream"])  # type: ignore[index]
        await real_store.redis.delete(llm_resource(update)["weights"]["stream"])  # type: ignore[index]
        await until(lambda: _not_ready(real_store, fake.url, "waiting for model version v1"))
        await asyncio.sleep(0.5)  # a few retries
        asks = [VersionRebuild.from_wire(f[b"m"]) for _, f in await real_store.redis.xrange(real_store.keys.version_rebuilds)]
        assert [(a.action.value, a.model_version, a.by) for a in asks] == [("ask", "v1", f"vllm-sync {fake.url}")]
        assert fake.calls == []
        for entry_id, fields in chunks:  # rebuilt: the same chunks under the same name
            await real_store.redis.xadd(llm_resource(update)["weights"]["stream"], fields, id=entry_id)  # type: ignore[index]
        await announce_rebuilt(real_store, "v1", "trainer-0")
        await until(lambda: _ready(real_store, fake.url, "v1"))
    finally:
        stop.set()
        await task
        await admin.close()
        await fake.stop()


async def _said(caplog: pytest.LogCaptureFixture, text: str) -> bool:
    return any(text in r.getMessage() for r in caplog.records)


async def _ready(store: RedisStore, url: str, version: str) -> bool:
    state = await _replica(store, url)
    return state is not None and state.ready and state.model_version == version


async def _not_ready(store: RedisStore, url: str, reason: str) -> bool:
    state = await _replica(store, url)
    return state is not None and not state.ready and reason in state.reason


@pytest.mark.parametrize(("fault", "reason"), [
    ("hang", "did not answer"),
    ("500", "answered 500"),
    ("applied-500", "answered 500"),  # the retry compares with the weights verified last, not the applied ones
    ("noop", "the weights were not applied"),
])
async def test_a_failed_load_keeps_the_replica_out_of_routing_until_a_retry_succeeds(
    real_store: RedisStore, models, tmp_path, fault: str, reason: str
) -> None:
    base, trained = models
    fake = FakeVllm(base)
    await fake.start()
    sync, stop, task, admin = await _run(real_store, fake, base, tmp_path, timeout_s=1.0, retry_s=1.5)
    try:
        await until(lambda: _ready(real_store, fake.url, "base"))
        fake.fault = fault
        await publish_model_version(real_store, load_file(str(trained / "model.safetensors")), model="tiny")
        await until(lambda: _not_ready(real_store, fake.url, reason))  # out of routing, with the reason
        await until(lambda: _ready(real_store, fake.url, "v1"))  # the retry (the fault was one-off)
        assert await _served_ids(fake) == await _greedy_with(trained)
        assert sync.syncs == {"ok": 1, "failed": 1}
    finally:
        stop.set()
        await task
        await admin.close()
        await fake.stop()


async def test_a_restarted_server_leaves_routing_and_gets_its_version_back(real_store: RedisStore, models, tmp_path):
    base, trained = models
    fake = FakeVllm(base)
    await fake.start()
    _, stop, task, admin = await _run(real_store, fake, base, tmp_path)
    try:
        await publish_model_version(real_store, load_file(str(trained / "model.safetensors")), model="tiny")
        await until(lambda: _ready(real_store, fake.url, "v1"))
        generation = (await _replica(real_store, fake.url)).generation
        await fake.restart()  # base weights, no version

        async def loaded_again() -> bool:
            state = await _replica(real_store, fake.url)
            return state.ready and state.model_version == "v1" and state.generation == generation + 1

        await until(loaded_again)
        assert await _served_ids(fake) == await _greedy_with(trained)
    finally:
        stop.set()
        await task
        await admin.close()
        await fake.stop()


async def test_a_lora_version_is_served_merged_onto_the_base(real_store: RedisStore, models, tmp_path):
    from fulmen.versions.lora import lora_description

    base, _ = models
    weights = load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(3)
    adapter = {}
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        out_f, in_f = weights[name + ".weight"].shape
        adapter[f"base_model.model.{name}.lora_A.weight"] = torch.randn(4, in_f, generator=g)
        adapter[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_f, 4, generator=g)
    lora = lora_description(4, 8.0)
    fake = FakeVllm(base)
    await fake.start()
    _, stop, task, admin = await _run(real_store, fake, base, tmp_path)
    try:
        await publish_model_version(real_store, adapter, model="tiny", weights_format={"format": "lora", "lora": lora})
        await until(lambda: _ready(real_store, fake.url, "v1"))
        engine = TorchEngine(base)
        await engine.load_weights(adapter, "v1", lora=lora)  # the proxy's own merge, for comparison
        want = (await engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))).token_ids
        await engine.close()
        assert await _served_ids(fake) == want
    finally:
        stop.set()
        await task
        await admin.close()
        await fake.stop()


async def test_delta_versions_are_applied_onto_the_last_folder_or_rebuilt_from_the_chain(
        real_store: RedisStore, models, tmp_path):
    from fulmen.versions.delta import encode_delta
    from fulmen.versions.manifest import DELTA, Manifest, describe_all

    base, trained = models
    states = [load_file(str(trained / "model.safetensors"))]
    g = torch.Generator().manual_seed(5)
    for _ in range(2):
        states.append({n: t + 0.05 * torch.randn(t.shape, generator=g) if n.endswith("proj.weight") else t
                       for n, t in states[-1].items()})
    fake = FakeVllm(base)
    await fake.start()
    _, stop, task, admin = await _run(real_store, fake, base, tmp_path)
    try:
        await publish_model_version(real_store, states[0], model="tiny", model_version="v1")
        await until(lambda: _ready(real_store, fake.url, "v1"))
        for i in (1, 2):
            if i == 2:  # the folder of v2 is gone (a new pod): v3 is rebuilt from v1 + v2 + v3
                shutil.rmtree(tmp_path / "sync" / "v2")
            delta = encode_delta(states[i - 1], states[i])
            await publish_model_version(real_store, delta, model="tiny", model_version=f"v{i + 1}",
                                        manifest=Manifest(DELTA, f"v{i}", describe_all(states[i])),
                                        weights_format={"format": DELTA, "base_version": f"v{i}"})
            await until(lambda i=i: _ready(real_store, fake.url, f"v{i + 1}"))
            assert await _served_ids(fake) == await _greedy_with(base, states[i])
    finally:
        stop.set()
        await task
        await admin.close()
        await fake.stop()


async def _adapter_ids(fake: FakeVllm, name: str) -> list[int]:
    return (await fake.adapters[name].generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))).token_ids


async def test_lora_versions_load_as_adapters_without_a_pause(real_store: RedisStore, models, tmp_path, caplog):
    """With a server that loads adapters at run time, each LoRA version is loaded under its own name
    with no pause and no reload; the replica serves it under that name (``served_model``) with the
    proxy's own greedy ids, and /weight_info names it; the previous adapter stays loaded for calls that still name it, older ones
    are unloaded; a restarted server that lost its adapter leaves routing and gets it back."""
    from fulmen.versions.lora import lora_description

    base, _ = models
    lora = lora_description(4, 8.0)
    fake = FakeVllm(base)
    fake.lora_enabled = True
    await fake.start()
    _, stop, task, admin = await _run(real_store, fake, base, tmp_path)
    try:
        adapters = {}
        for n in (1, 2, 3):
            adapters[n] = random_adapter(base, seed=n)
            await publish_model_version(real_store, adapters[n], model="tiny",
                                        weights_format={"format": "lora", "lora": lora})
            await until(lambda n=n: _ready(real_store, fake.url, f"v{n}"))
            state = await _replica(real_store, fake.url)
            assert state.served_model == f"v{n}"
            # what a person reads from the server itself names the adapter's version too
            assert fake.version == f"v{n} (LoRA adapter)" and await admin.served_version() is None
        assert not [c for c in fake.calls if c.startswith(("pause", "reload_weights"))], fake.calls
        assert sorted(fake.adapters) == ["v2", "v3"] and "unload_lora:v1" in fake.calls
        engine = TorchEngine(base)
        await engine.load_weights(adapters[3], "v3", lora=lora)
        want = (await engine.generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))).token_ids
        await engine.close()
        assert await _adapter_ids(fake, "v3") == want
        assert await _served_ids(fake) == await _greedy_with(base)  # the server's own weights: still the base

        await fake.restart()  # adapters gone: out of routing (briefly) and loaded again

        async def loaded_again() -> bool:
            return fake.calls.count("load_lora:v3") == 2

        await until(loaded_again)
        await until(lambda: _ready(real_store, fake.url, "v3"))
        assert "v3" in fake.adapters and "lost the adapter v3" in caplog.text
    finally:
        stop.set()
        await task
        await admin.close()
        await fake.stop()


async def test_dynamic_lora_on_a_server_without_it_says_what_to_do(real_store: RedisStore, models, tmp_path, caplog):
    """``lora_loading`` dynamic against a server that cannot load adapters: the replica stays out of
    routing and the log names the flags; auto merges the adapter instead (the merge test above)."""
    from fulmen.versions.lora import lora_description

    base, _ = models
    fake = FakeVllm(base)  # lora_enabled False: /v1/load_lora_adapter is a 404
    await fake.start()
    _, stop, task, admin = await _run(real_store, fake, base, tmp_path, lora_loading="dynamic", retry_s=5.0)
    try:
        await publish_model_version(real_store, random_adapter(base, seed=1), model="tiny",
                                    weights_format={"format": "lora", "lora": lora_description(4, 8.0)})
        await until(lambda: _reason_says(real_store, fake.url, "--enable-lora"))
        state = await _replica(real_store, fake.url)
        assert not state.ready and state.model_version == "base"
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in caplog.text
        assert "reload_weights" not in fake.calls
    finally:
        stop.set()
        await task
        await admin.close()
        await fake.stop()


async def _reason_says(store: RedisStore, url: str, text: str) -> bool:
    state = await _replica(store, url)
    return state is not None and text in state.reason


async def test_two_replicas_take_turns_to_load_so_one_always_serves(real_store: RedisStore, models, tmp_path):
    """Reloads are staggered: with two replicas each version is loaded by one at a time, so at every
    moment at least one is ready; both end on the newest version."""
    base, trained = models
    fakes = [FakeVllm(base), FakeVllm(base)]
    for fake in fakes:
        await fake.start()
    runs = [await _run(real_store, fake, base, tmp_path / f"r{i}") for i, fake in enumerate(fakes)]
    both_down: list[dict] = []
    watching = True

    async def watch() -> None:
        while watching:
            states = await real_store.registry.query_replicas()
            if len(states) == 2 and not any(s.ready for s in states.values()):
                both_down.append({url: s.reason for url, s in states.items()})
            await asyncio.sleep(0.005)

    try:
        await until(lambda: _all_ready(real_store, [f.url for f in fakes], "base"))
        watcher = asyncio.create_task(watch())
        weights = load_file(str(trained / "model.safetensors"))
        for version in ("v1", "v2", "v3"):
            await publish_model_version(real_store, weights, model="tiny")
            await until(lambda version=version: _all_ready(real_store, [f.url for f in fakes], version))
        watching = False
        await watcher
        assert both_down == []
        assert await real_store.redis.get(real_store.keys.replica_loading) is None  # the last turn was given back
    finally:
        for _, stop, task, admin in runs:
            stop.set()
            await task
            await admin.close()
        for fake in fakes:
            await fake.stop()


async def test_a_load_turn_is_held_by_one_replica_and_ends_by_itself(real_store: RedisStore) -> None:
    registry = real_store.registry
    assert await registry.take_replica_load("http://a", 0.3)
    assert await registry.take_replica_load("http://a", 0.3)  # its own turn, again
    assert not await registry.take_replica_load("http://b", 0.3)
    await registry.end_replica_load("http://b")  # not b's to end
    assert not await registry.take_replica_load("http://b", 0.3)
    await registry.end_replica_load("http://a")
    assert await registry.take_replica_load("http://b", 0.3)
    await asyncio.sleep(0.4)  # b's vllm-sync died mid-load: the turn ends with its TTL
    assert await registry.take_replica_load("http://a", 0.3)
    await registry.end_replica_load("http://a")


async def _all_ready(store: RedisStore, urls: list[str], version: str) -> bool:
    states = await store.registry.query_replicas()
    return all(url in states and states[url].ready and states[url].model_version == version for url in urls)


async def test_a_route_that_times_out_names_the_timeout_it_was_given() -> None:
    """A worker call's own timeout (the weight group's), not the client's default, is the one said."""
    import httpx

    def timing_out(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no answer", request=request)

    admin = VllmAdmin("http://vllm.invalid", 30.0)
    admin.client = httpx.AsyncClient(base_url=admin.url, transport=httpx.MockTransport(timing_out), timeout=30.0)
    try:
        with pytest.raises(AdminError, match=r"collective_rpc did not answer within 310\.0 s"):
            await admin.receive_group(300.0)
        with pytest.raises(AdminError, match=r"/pause did not answer within 30\.0 s"):
            await admin.pause("wait")
    finally:
        await admin.close()
