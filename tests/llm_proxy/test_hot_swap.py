"""Model following: a version published while calls are in flight is loaded without failing any."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch
from proxy_helpers import RunningProxy

from fulmen.demo.tiny_model import build_tiny_model, load_tiny_model
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import EmbeddedRedis
from fulmen.versions.model_version import publish_model_version

MESSAGES = [{"role": "user", "content": "3*4="}]


@pytest.fixture
def swap_proxy(redis_server: EmbeddedRedis, experiment: str, tiny_model: Path) -> Iterator[RunningProxy]:
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=experiment, proxy_backend="torch", model_dir=tiny_model
    )
    yield proxy
    proxy.stop()


def forward_logprobs(model: torch.nn.Module, prompt_ids: list[int], token_ids: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + token_ids])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return [logprobs[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(token_ids)]


async def test_weight_update_with_32_calls_in_flight(
    swap_proxy: RunningProxy, real_store: RedisStore, tiny_model: Path, tmp_path: Path
) -> None:
    """32 calls in flight during a publish all succeed; later calls report v1 and follow its weights."""
    base_model, _ = load_tiny_model(tiny_model)
    new_model, _ = load_tiny_model(build_tiny_model(tmp_path / "other", seed=7))
    models = {"base": base_model, "v1": new_model}
    client = openai.AsyncOpenAI(base_url=swap_proxy.base(), api_key="unused", max_retries=0)

    async def call() -> openai.types.chat.ChatCompletion:
        return await client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=48, temperature=0
        )

    in_flight = [asyncio.create_task(call()) for _ in range(32)]
    await asyncio.sleep(0.05)  # let them reach the engine
    update = await publish_model_version(real_store, new_model.state_dict(), model="tiny")
    assert update.resources["llm"]["model_version"] == "v1"
    results = await asyncio.gather(*in_flight)  # none raises

    deadline = time.monotonic() + 20
    while (await client.models.list()).data[0].model_extra["model_version"] != "v1":
        assert time.monotonic() < deadline, "the proxy never loaded v1"
        await asyncio.sleep(0.05)
    later = [await call() for _ in range(3)]
    await client.close()

    for response in [*results, *later]:
        version = response.model_extra["model_version"]
        prompt_ids = response.model_extra["prompt_token_ids"]
        token_ids = response.choices[0].model_extra["token_ids"]
        logprobs = [c.logprob for c in response.choices[0].logprobs.content]
        # Each response follows the weights of the version it names, for every token.
        assert logprobs == pytest.approx(forward_logprobs(models[version], prompt_ids, token_ids), abs=1e-4)
    assert {r.model_extra["model_version"] for r in later} == {"v1"}
    # Greedy outputs of the two versions differ, so "follows the new weights" is a real check (against
    # a call the old weights answered: which of the 32 those were depends on the machine's speed).
    by_base = [r for r in results if r.model_extra["model_version"] == "base"]
    assert not by_base or later[0].choices[0].model_extra["token_ids"] != by_base[0].choices[0].model_extra["token_ids"]
    (endpoint,) = await real_store.registry.query_proxies()
    assert endpoint.model_version == "v1"


async def test_restarted_proxy_serves_the_latest_version(
    redis_server: EmbeddedRedis, real_store: RedisStore, experiment: str, tiny_model: Path, tmp_path: Path
) -> None:
    """A proxy that starts after a publish loads the latest version before long."""
    new_model, _ = load_tiny_model(build_tiny_model(tmp_path / "other", seed=7))
    await publish_model_version(real_store, new_model.state_dict(), model="tiny", model_version="trained-1")
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=experiment, proxy_backend="torch", model_dir=tiny_model
    )
    try:
        client = openai.OpenAI(base_url=proxy.base(), api_key="unused")
        deadline = time.monotonic() + 20
        while client.models.list().data[0].model_extra["model_version"] != "trained-1":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        response = client.chat.completions.with_raw_response.create(
            model="tiny", messages=MESSAGES, max_tokens=4
        )
        assert response.headers["x-fulmen-model-version"] == "trained-1"
    finally:
        proxy.stop()


@pytest.mark.parametrize("then", ["nothing", "validation resources"])
async def test_a_restarted_proxy_answers_its_first_call_with_the_latest_version(
    redis_server: EmbeddedRedis, real_store: RedisStore, experiment: str, tiny_model: Path, tmp_path: Path,
    then: str,
) -> None:
    """No call is served by the base weights once a version is published: the proxy loads it before it
    starts serving and registers (issue 20, item 2) — also when the newest resources entry names no
    version (the algorithm's validation resources, published after the policy's)."""
    new_model, _ = load_tiny_model(build_tiny_model(tmp_path / "other", seed=7))
    await publish_model_version(real_store, new_model.state_dict(), model="tiny", model_version="trained-2")
    if then == "validation resources":
        await real_store.resources.add_resources({"llm": {"kind": "llm", "model": "tiny", "sampling_parameters": {}}},
                                       resources_id="validation")
    proxy = RunningProxy(
        redis_url=redis_server.url, experiment=experiment, proxy_backend="torch", model_dir=tiny_model
    )
    try:
        (endpoint,) = await real_store.registry.query_proxies()  # registered once started: with that version
        assert endpoint.model_version == "trained-2"
        client = openai.OpenAI(base_url=proxy.base(), api_key="unused", max_retries=0)
        response = client.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=4)
        assert response.headers["x-fulmen-model-version"] == "trained-2"
    finally:
        proxy.stop()
