"""An A/B test (`fulmen ab`) on vLLM: vllm-sync loads B as a LoRA adapter beside A and says so in the
replica state (``b_version``, ``b_split``); the proxy's vllm backend sends the rollouts `arm_of` gives
B to that adapter, and records each call with the version it got; the test's end unloads B."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.serving.ab import arm_of, start_ab, stop_ab
from fulmen.settings import VllmSyncSettings
from fulmen.store import RedisStore
from fulmen.versions.lora import lora_description
from fulmen.versions.model_version import publish_model_version
from fulmen_llm_proxy.backends.base import Call, Result
from fulmen_llm_proxy.backends.upstream.replicas import ReplicaView
from fulmen_llm_proxy.backends.upstream.vllm import VllmBackend
from fulmen_vllm_sync.admin import VllmAdmin
from fulmen_vllm_sync.sync import VllmSync

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from fakes.fake_vllm import FakeVllm
from polling import until
from vllm_sync_helpers import random_adapter

SPLIT = 0.5
PROMPT = [1, 5, 9, 12, 7]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "base", seed=0)


def _rollouts() -> dict[str, str]:
    """A rollout id of each arm."""
    ids: dict[str, str] = {}
    for i in range(100):
        ids.setdefault(arm_of(f"r{i}", SPLIT), f"r{i}")
    return ids


async def _call(backend: VllmBackend, rollout_id: str) -> Result:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    result = Result()
    await backend.complete(Call("text_completion", body, "tiny", False, 4, 0.0, 1.0, None, [],
                                rollout_id=rollout_id), result)
    return result


async def test_b_is_an_adapter_beside_a_and_each_call_names_the_version_it_got(real_store: RedisStore, base,
                                                                                tmp_path) -> None:  # type: ignore[no-untyped-def]
    fake = FakeVllm(base)
    fake.lora_enabled = True
    await fake.start()
    settings = VllmSyncSettings(vllm_url=fake.url, model_name="tiny", model_dir=base, sync_dir=tmp_path / "sync",
                                sync_retry_s=0.2)
    sync = VllmSync(real_store, VllmAdmin(fake.url, 10.0), settings, check_s=0.2)
    stop = asyncio.Event()
    task = asyncio.create_task(sync.run(stop))
    backend = VllmBackend([fake.url])
    view = ReplicaView(real_store)

    async def state():  # type: ignore[no-untyped-def]
        return (await real_store.registry.query_replicas()).get(fake.url)

    try:
        lora = {"format": "lora", "lora": lora_description(4, 8.0)}
        for n in (1, 2, 3):
            await publish_model_version(real_store, random_adapter(base, seed=n), model="tiny", weights_format=lora)
        await until(lambda: _is(state, model_version="v3", ready=True))
        assert "v3" in fake.adapters and "v1" not in fake.adapters

        await start_ab(real_store, "v3", "v1", SPLIT)
        await until(lambda: _is(state, b_version="v1", b_split=SPLIT))
        assert {"v1", "v3"} <= set(fake.adapters)
        await backend.start()
        await view.refresh()
        backend.follow_replicas(view)
        arms = _rollouts()
        got = {arm: await _call(backend, rollout) for arm, rollout in arms.items()}
        assert fake.requested_models[-2:] == ["v3", "v1"] or fake.requested_models[-2:] == ["v1", "v3"]
        assert {arm: r.model_version for arm, r in got.items()} == {"a": "v3", "b": "v1"}
        assert all(r.fidelity == "exact" and r.token_ids for r in got.values())

        await stop_ab(real_store)
        await until(lambda: _is(state, b_version=""))
        await until(lambda: _gone(fake, "v1"))
        await view.refresh()
        assert (await _call(backend, arms["b"])).model_version == "v3"  # the test is over: A for every rollout
    finally:
        stop.set()
        await task
        await sync.admin.close()
        await backend.close()
        await fake.stop()


async def _is(state, **fields) -> bool:  # type: ignore[no-untyped-def]
    now = await state()
    return now is not None and all(getattr(now, k) == v for k, v in fields.items())


async def _gone(fake: FakeVllm, name: str) -> bool:
    return name not in fake.adapters
