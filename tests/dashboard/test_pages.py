"""The dashboard's pages over a real Redis: what each shows, bad input as 4xx pages, the auth, and
that it writes nothing unless admin actions are enabled."""

from __future__ import annotations

import base64
import logging
import re

import httpx
import pytest
from seed import ANSWER, QUESTION, Client, seed

from fulmen.store import RedisStore


async def test_every_page_shows_the_experiment(real_store: RedisStore, client: httpx.AsyncClient) -> None:
    """Experiments, run, rollouts, one rollout, live, curves and dead letters render what is stored."""
    ids = await seed(real_store)
    e = real_store.experiment
    home = await client.get("/")
    assert home.status_code == 200 and f"/e/{e}" in home.text
    run = await client.get(f"/e/{e}")
    assert run.status_code == 200 and "v5" in run.text and "0.700" in run.text
    listing = await client.get(f"/e/{e}/rollouts")
    assert listing.status_code == 200
    assert all(rid in listing.text for rid in [*ids, "wait-0", "wait-1"])
    detail = await client.get(f"/e/{e}/rollouts/{ids[0]}")
    assert detail.status_code == 200
    for shown in (QUESTION, ANSWER, "5 prompt + 2 response", "v3", "12.5", "calc", "-0.250", "reward 1.000"):
        assert shown in detail.text, shown
    assert 'class="span-tree"' in detail.text
    live = await client.get(f"/e/{e}/live")
    assert live.status_code == 200 and "queue depth" in live.text and ids[-1] in live.text
    fragment = await client.get(f"/e/{e}/live?fragment=1")
    assert fragment.status_code == 200 and "<nav>" not in fragment.text
    curves = (await client.get(f"/e/{e}/curves.json")).json()
    assert curves["steps"] == [1, 2, 3, 4, 5]
    assert curves["series"]["train reward"][-1] == pytest.approx(0.5)
    assert curves["series"]["KL"][0] == pytest.approx(0.01)
    assert curves["validation"] == {"version": [0, 5], "accuracy": [0.45, 0.7]}
    assert (await client.get(f"/e/{e}/curves")).status_code == 200
    letters = await client.get(f"/e/{e}/dead-letters")
    assert letters.status_code == 200 and "sample record unreadable" in letters.text
    assert "<script>alert(1)</script>" not in letters.text  # escaped, never run
    assert (await client.get("/static/uPlot.iife.min.js")).status_code == 200


async def test_filters_and_paging(real_store: RedisStore, client: httpx.AsyncClient) -> None:
    """Status, mode, reward and version filters pick the right rows; the cursor pages on without repeats."""
    await seed(real_store, succeeded=3, queued=4)
    e = real_store.experiment

    def shown(page: httpx.Response) -> list[str]:
        return re.findall(r'class="rollout-link mono" href="[^"]+">([^<]+)<', page.text)

    assert sorted(shown(await client.get(f"/e/{e}/rollouts?status=succeeded"))) == ["ok-0", "ok-1", "ok-2"]
    assert sorted(shown(await client.get(f"/e/{e}/rollouts?mode=val"))) == [f"wait-{i}" for i in range(4)]
    assert len(shown(await client.get(f"/e/{e}/rollouts?min_reward=0.5"))) == 3
    assert shown(await client.get(f"/e/{e}/rollouts?max_reward=0.5")) == []
    assert shown(await client.get(f"/e/{e}/rollouts?status=queuing,failed&mode=train")) == []
    seen: list[str] = []
    url = f"/e/{e}/rollouts?limit=3"
    while url:
        page = await client.get(url if url.startswith("/") else f"/e/{e}/rollouts{url}")
        assert page.status_code == 200
        seen += shown(page)
        found = re.search(r'id="next-page" href="([^"]+)"', page.text)
        url = found.group(1).replace("&amp;", "&") if found else ""
    assert sorted(seen) == sorted([f"ok-{i}" for i in range(3)] + [f"wait-{i}" for i in range(4)])


@pytest.mark.parametrize(("path", "status"), [
    ("/e/no-such-experiment", 404),
    ("/e/bad%20name!", 400),
    ("/e/{e}/rollouts/no-such-rollout", 404),
    ("/e/{e}/rollouts/bad%20id", 400),
    ("/e/{e}/rollouts?status=exploded", 400),
    ("/e/{e}/rollouts?mode=sideways", 400),
    ("/e/{e}/rollouts?min_reward=abc", 400),
    ("/e/{e}/rollouts?min_reward=nan", 400),
    ("/e/{e}/rollouts?since=yesterday", 400),
    ("/e/{e}/rollouts?limit=1000000", 400),
    ("/e/{e}/rollouts?limit=-1", 400),
    ("/e/{e}/rollouts?cursor=zzz", 400),
    ("/e/{e}/rollouts?version=a%20b", 400),
    ("/e/{e}/rollouts?colour=red", 400),
    ("/e/{e}/rollouts?status=failed&status=succeeded", 400),
    ("/e/{e}/rollouts?" + "x" * 5000, 414),
    ("/e/{e}/dead-letters?limit=99999999", 400),
    ("/e/{e}/nowhere", 404),
    ("/static/../../etc/passwd", 404),
])
async def test_bad_input_gets_a_4xx_page(real_store: RedisStore, client: httpx.AsyncClient, path: str, status: int) -> None:
    """Unknown ids, malformed filters and huge page sizes are answered with an error page, not a crash."""
    await seed(real_store, succeeded=1, queued=0)
    response = await client.get(path.replace("{e}", real_store.experiment))
    assert response.status_code == status, response.text[:500]
    assert 'id="error-message"' in response.text


async def test_admin_actions_are_refused_unless_enabled(real_store: RedisStore, client: httpx.AsyncClient) -> None:
    """Read-only by default: POSTs get 403 and change nothing; a GET on a POST route is 405."""
    await seed(real_store, succeeded=1, queued=1)
    e = real_store.experiment
    assert (await client.post(f"/e/{e}/rollouts/wait-0/cancel")).status_code == 403
    letter = (await real_store.dead_letters.query_dead_letters())[0].dead_letter_id
    assert (await client.post(f"/e/{e}/dead-letters/{letter}/requeue")).status_code == 403
    assert (await client.get(f"/e/{e}/rollouts/wait-0/cancel")).status_code == 405
    assert (await real_store.rollouts.get_rollout("wait-0")).status.value == "queuing"
    assert len(await real_store.dead_letters.query_dead_letters()) == 1


async def test_admin_actions_when_enabled(real_store: RedisStore, dashboard: Client) -> None:
    """With admin on: cancel a rollout, requeue a dead letter onto its stream; cross-site POSTs refused."""
    await seed(real_store, succeeded=1, queued=1)
    e = real_store.experiment
    async with dashboard(admin=True) as client:
        refused = await client.post(f"/e/{e}/rollouts/wait-0/cancel", headers={"origin": "http://evil.example"})
        assert refused.status_code == 403
        done = await client.post(f"/e/{e}/rollouts/wait-0/cancel", headers={"origin": "http://dash.test"})
        assert done.status_code == 303
        assert (await real_store.rollouts.get_rollout("wait-0")).status.value == "cancelled"
        assert (await client.post(f"/e/{e}/rollouts/nobody/cancel")).status_code == 404
        letter = (await real_store.dead_letters.query_dead_letters())[0].dead_letter_id
        assert (await client.post(f"/e/{e}/dead-letters/{letter}/requeue")).status_code == 303
        assert await real_store.dead_letters.query_dead_letters() == []
        entries = await real_store.redis.xrange(real_store.keys.samples)
        assert entries[-1][1] == {b"m": b"\x00garbage"}
        assert (await client.post(f"/e/{e}/dead-letters/1-0/requeue")).status_code == 404
        assert (await client.post(f"/e/{e}/dead-letters/junk/requeue")).status_code == 400


async def test_auth_from_the_environment(real_store: RedisStore, dashboard: Client, caplog: pytest.LogCaptureFixture) -> None:
    """With a token: 401 without it, bearer and basic auth both work, /healthz stays open, never logged."""
    secret = "s3cret-token-value"
    caplog.set_level(logging.DEBUG)
    await seed(real_store, succeeded=1, queued=0)
    async with dashboard(token=secret) as client:
        refused = await client.get("/")
        assert refused.status_code == 401 and "basic" in refused.headers["www-authenticate"].lower()
        assert (await client.get("/", headers={"authorization": "Bearer wrong"})).status_code == 401
        assert (await client.get("/", headers={"authorization": f"Bearer {secret}"})).status_code == 200
        basic = base64.b64encode(f"anyone:{secret}".encode()).decode()
        assert (await client.get("/", headers={"authorization": f"Basic {basic}"})).status_code == 200
        assert (await client.get("/", headers={"authorization": "Basic !!!"})).status_code == 401
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/readyz")).json() == {"ready": True}  # probes send no secret
    assert secret not in caplog.text
