"""The proxy's vllm backend with vllm-sync: calls go only to ready replicas, each recorded call carries
the version that served it, and no call's tokens come from two versions (a fake vLLM server swaps
weights between decoding steps, so a call that straddles a load would mix them)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from fulmen.model_versions import publish_model_version
from fulmen.records import ReplicaState
from fulmen.store import RedisStore
from fulmen.tiny_model import build_tiny_model
from fulmen_llm_proxy.backend_base import Call, Result
from fulmen_llm_proxy.backend_vllm import VllmBackend
from fulmen_llm_proxy.engine_request import SamplingParams
from fulmen_llm_proxy.errors import ProxyError
from fulmen_llm_proxy.replicas import ReplicaView
from fulmen_llm_proxy.torch_engine import TorchEngine
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
    await real_store.set_replica(ReplicaState("http://127.0.0.1:1/v1", "v3", ready=False, reason="loading v3"))
    await view.refresh()
    assert [p.base_url for p in backend.upstreams.order("r1")] == ["http://127.0.0.1:2"]  # untracked: routable
    await real_store.set_replica(ReplicaState("http://127.0.0.1:2", "v2", ready=False, reason="loading failed"))
    await view.refresh()
    with pytest.raises(ProxyError) as caught:
        backend.upstreams.order("r1")
    assert caught.value.status == 503 and "loading" in str(caught.value)
    await backend.close()


async def test_no_call_mixes_two_versions_while_versions_load(real_store: RedisStore, models: list[Path],
                                                              tmp_path: Path) -> None:
    base = models[0]
    fake = FakeVllm(base)
    url = await fake.start()
    admin = VllmAdmin(url, 10.0)
    sync = VllmSync(real_store, admin, url=url, model="tiny", model_dir=base, sync_dir=tmp_path / "sync",
                    retry_s=0.2, check_s=0.2)
    stop = asyncio.Event()
    syncing = asyncio.create_task(sync.run(stop))
    backend = VllmBackend([url])
    view = ReplicaView(real_store)
    await view.refresh()
    backend.follow_replicas(view)
    refreshing = asyncio.create_task(view.run())
    calls: list[Result] = []
    publishing = True

    async def agent(n: int) -> None:
        i = 0
        while publishing:
            result = Result()
            try:
                await backend.complete(_call(f"r{n}-{i}"), result)
                calls.append(result)
            except ProxyError as e:
                assert e.status == 503  # no ready replica while a version loads: the runner retries
                await asyncio.sleep(0.05)
            i += 1

    agents = [asyncio.create_task(agent(n)) for n in range(3)]
    try:
        for model in models[1:]:
            await asyncio.sleep(1.0)
            await publish_model_version(real_store, load_file(str(model / "model.safetensors")), model="tiny")
        await asyncio.sleep(2.0)
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
    wrong = [(r.model_version, r.token_ids) for r in calls if r.token_ids != expected[r.model_version or "base"]]
    assert wrong == []  # every call's tokens are those of the version it is recorded with
