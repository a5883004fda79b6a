"""An agent whose proxy is unreachable fails for infrastructure, not on its merits: the rollout is run
again whatever its retry policy (a bounded number of times) and the error names the real cause
(issue 20, item 5)."""

from __future__ import annotations

from fulmen.records.status import AttemptStatus, RolloutStatus
from fulmen.store.redis.embedded import free_port
from fulmen_runner.execute import PROXY_RETRIES


async def test_an_unreachable_proxy_requeues_the_rollout_and_says_why(real_store, start_runner) -> None:
    """Default policy (one attempt): still PROXY_RETRIES attempts, each ended with 'proxy … unreachable'."""
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    r = await real_store.rollouts.enqueue_rollout({"q": 1})
    await start_runner("calls_llm", llm_base_url=f"{url}/v1")
    [done] = await real_store.finished.wait_for_rollouts([r.rollout_id], timeout_s=120)
    assert done.status is RolloutStatus.FAILED
    attempts = await real_store.rollouts.query_attempts(r.rollout_id)
    assert len(attempts) == PROXY_RETRIES
    assert all(a.status is AttemptStatus.FAILED for a in attempts)
    for a in attempts:
        message = a.error["message"]
        assert f"proxy {url} unreachable" in message and "APITimeoutError" not in message, message
