"""The dashboard's model version is what is served when the resources name none: "base" where the
proxy says base, a vLLM replica's LoRA adapter version (marked as one), never "-" while a model serves."""

from __future__ import annotations

import httpx
from seed import seed

from fulmen.records import ProxyEndpoint, ReplicaState
from fulmen.store import RedisStore


def _card(page: str) -> str:
    """The value of the "model version" card."""
    return page.split("</b><span>model version</span>")[0].rsplit("<b>", 1)[1]


async def test_model_version_reads_base_where_the_proxy_says_base(real_store: RedisStore, client: httpx.AsyncClient) -> None:
    """Resources whose llm names no version and a proxy serving base: every view says "base", not "-"."""
    await seed(real_store, succeeded=1, queued=0)
    e = real_store.experiment
    await real_store.resources.add_resources({"llm": {"kind": "llm", "model": "tiny"}})
    assert _card((await client.get(f"/e/{e}/live?fragment=1")).text) == "base"  # no proxy up yet: what it will serve
    await real_store.registry.register_proxy(ProxyEndpoint("p1", "http://proxy:8000", "tiny", model_version="base"))
    assert _card((await client.get(f"/e/{e}/live?fragment=1")).text) == "base"
    assert _card((await client.get(f"/e/{e}")).text) == "base"
    row = next(r for r in (await client.get("/")).text.split("<tr") if f"/e/{e}\"" in r)
    assert "<td>base</td>" in row


async def test_a_replica_serving_a_lora_version_shows_it(real_store: RedisStore, client: httpx.AsyncClient) -> None:
    """A replica serving v3 as a LoRA adapter: its row says "v3 (LoRA adapter)" and the card says v3."""
    await seed(real_store, succeeded=1, queued=0)
    e = real_store.experiment
    await real_store.resources.add_resources({"llm": {"kind": "llm", "model": "tiny", "sampling_parameters": {}}})
    await real_store.registry.set_replica(ReplicaState("http://vllm:8100", "v3", ready=True, served_model="v3"))
    page = (await client.get(f"/e/{e}/live?fragment=1")).text
    assert _card(page) == "v3"
    row = next(r for r in page.split("<tr") if "vllm:8100" in r)
    assert "v3 (LoRA adapter)" in row
