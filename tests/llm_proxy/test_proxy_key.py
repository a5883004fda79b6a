"""A proxy that requires a key (FULMEN_PROXY_API_KEYS): the runner's agents send one it accepts."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fakes.fake_openai import FakeOpenAI
from proxy_helpers import RunningProxy

import fulmen
from fulmen.records.status import AttemptStatus, RolloutStatus
from fulmen.sdk.resources import LLM
from fulmen.settings import RunnerSettings
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.telemetry.tracing import setup_tracing
from fulmen_runner.runner import Runner

KEYS = "key-one,key-two"


@fulmen.rollout
async def calls_the_llm(task: Any, llm: Any) -> float:
    reply = await llm.async_client.chat.completions.create(
        model=llm.model, messages=[{"role": "user", "content": "hi"}]
    )
    return 1.0 if reply.choices[0].message.content else 0.0


@pytest.fixture
def keyed_proxy(redis_server: EmbeddedRedis, experiment: str) -> Iterator[RunningProxy]:
    """A proxy that accepts only KEYS, registered in the test's experiment, before a fake upstream."""
    fake = FakeOpenAI()
    fake.start_in_thread()
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=experiment, proxy_backend="openai",
        upstream_urls=fake.base_url, proxy_api_keys=KEYS,
    )  # fmt: skip
    yield proxy
    proxy.stop()
    fake.stop()


async def _run_one(store: RedisStore, key: str | None) -> tuple[RolloutStatus, Any]:
    await store.resources.add_resources({"llm": {"kind": "llm", "model": "fake"}})
    r = await store.rollouts.enqueue_rollout("x")
    _, buffer = setup_tracing("test-runner", set_global=False)
    runner = Runner(store, calls_the_llm, buffer, RunnerSettings(proxy_api_key=key))
    await runner.run(max_rollouts=1)
    (attempt,) = await store.rollouts.query_attempts(r.rollout_id)
    return (await store.rollouts.get_rollout(r.rollout_id)).status, attempt


@pytest.mark.parametrize(
    "env",
    [{"proxy_api_keys": KEYS}, {"proxy_api_key": "key-two"}, {"proxy_api_key": "key-two", "proxy_api_keys": "other"}],
)
async def test_runner_passes_the_configured_key_to_a_keyed_proxy(real_store, keyed_proxy, env) -> None:
    """With the shared FULMEN_PROXY_API_KEYS or its own FULMEN_PROXY_API_KEY the runner's rollouts succeed."""
    settings = RunnerSettings(**env)
    status, attempt = await _run_one(real_store, settings.proxy_key())
    assert attempt.status is AttemptStatus.SUCCEEDED, attempt.error
    assert status is RolloutStatus.SUCCEEDED


async def test_without_a_key_a_keyed_proxy_refuses_the_calls(real_store, keyed_proxy) -> None:
    """The check the test above depends on: a runner without a key gets 401 from this proxy."""
    _, attempt = await _run_one(real_store, RunnerSettings().proxy_key())
    assert attempt.status is AttemptStatus.FAILED
    assert "401" in attempt.error["message"] or "invalid_api_key" in attempt.error["message"]


def test_the_key_is_never_in_a_repr() -> None:
    """Neither the runner's settings nor the agent's LLM show the key."""
    settings = RunnerSettings(proxy_api_key="secret-1", proxy_api_keys="secret-2")
    llm = LLM(base_url="http://proxy/v1", model="m", api_key="secret-1")
    for text in (repr(settings), str(settings), repr(llm)):
        assert "secret-" not in text
