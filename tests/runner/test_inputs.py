"""What the runner hands an agent: an agent that takes no ``llm`` costs no look for one (no read of
the proxy registry per rollout); one that does gets the registered proxy's, or a MissingLLM."""

from __future__ import annotations

from typing import Any

from fulmen.records import AttemptedRollout, ProxyEndpoint
from fulmen.sdk.resources import LLM, MissingLLM
from fulmen.store import RedisStore
from fulmen_runner.inputs import InputResolver


async def _claimed(store: RedisStore) -> AttemptedRollout:
    return await store.rollouts.start_rollout({"q": 1}, "w1")


async def test_an_agent_without_llm_is_given_none_and_the_registry_is_not_read(real_store: RedisStore,
                                                                                 monkeypatch: Any) -> None:
    reads: list[str] = []
    query = real_store.registry.query_proxies

    async def counted(*args: Any, **kwargs: Any) -> list[ProxyEndpoint]:
        reads.append("query_proxies")
        return await query(*args, **kwargs)

    monkeypatch.setattr(real_store.registry, "query_proxies", counted)
    resolver = InputResolver(real_store)
    claimed = await _claimed(real_store)
    for _ in range(3):
        assert (await resolver.resolve(claimed, wants_llm=False)).llm is None
    assert reads == []
    assert isinstance((await resolver.resolve(claimed)).llm, MissingLLM)  # no proxy registered
    assert reads == ["query_proxies"]
    await real_store.registry.register_proxy(ProxyEndpoint("p1", "http://127.0.0.1:9", model="tiny"))
    resolver = InputResolver(real_store)
    llm = (await resolver.resolve(claimed)).llm
    assert isinstance(llm, LLM) and llm.base_url.startswith("http://127.0.0.1:9/rollout/")
