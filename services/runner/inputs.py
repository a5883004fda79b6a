"""What an attempt's agent receives: the resources snapshot its rollout names, and an `LLM` on a proxy.

The rollout names a resources id (or none: then the latest snapshot). The "llm" entry of the snapshot
gives the model and sampling parameters; the base URL is a live proxy from the store's registry,
picked by a stable hash of the rollout id, with the attempt's path prefix — or ``llm_base_url`` from
the settings when the user points agents at an endpoint of their own.

The runner's ``api_key`` goes with the proxies and ``llm_base_url`` (both the operator's choice),
never to an ``endpoint`` named inside a resource: whoever can write resources must not learn the key.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fulmen.errors import NotFound, RetryableError
from fulmen.records import AttemptedRollout, ResourcesUpdate
from fulmen.sdk.agent import AgentInputs
from fulmen.sdk.resources import LLM, llm_for_attempt, prompt_template_of
from fulmen.store import RedisStore
from fulmen.store.registry import pick_proxy

log = logging.getLogger(__name__)


class NoProxy(RetryableError):
    """The resources name an LLM but no proxy has registered (yet)."""


class InputResolver:
    def __init__(
        self,
        store: RedisStore,
        *,
        llm_base_url: str | None = None,
        api_key: str | None = None,
        proxy_wait_s: float = 30.0,
    ) -> None:
        self.store = store
        self.llm_base_url = llm_base_url
        self.api_key = api_key
        self.proxy_wait_s = proxy_wait_s
        self._snapshots: dict[str | None, tuple[float, ResourcesUpdate | None]] = {}
        self._proxies: tuple[float, list[Any]] = (0.0, [])

    async def snapshot(self, resources_id: str | None) -> ResourcesUpdate | None:
        """The rollout's resources (the latest version of the id it names, or the latest snapshot of
        all), re-read at most once a second: a new model version reaches new attempts within 1 s."""
        cached = self._snapshots.get(resources_id)
        if cached is not None and time.monotonic() - cached[0] < 1.0:
            return cached[1]
        if resources_id is None:
            update = await self.store.get_latest_resources()
        else:
            try:
                update = await self.store.get_resources(resources_id)
            except NotFound:
                raise NotFound(
                    f"the rollout names resources {resources_id!r}, which do not exist in the store"
                ) from None
        if len(self._snapshots) > 256:
            self._snapshots.clear()
        self._snapshots[resources_id] = (time.monotonic(), update)
        return update

    async def _live_proxies(self) -> list[Any]:
        fetched_at, proxies = self._proxies
        if not proxies or time.monotonic() - fetched_at > 2.0:
            proxies = await self.store.query_proxies()
            self._proxies = (time.monotonic(), proxies)
        return proxies

    async def llm(self, spec: dict[str, Any], rollout_id: str, attempt_id: str) -> LLM:
        if self.llm_base_url:
            return llm_for_attempt(
                spec, self.llm_base_url, rollout_id, attempt_id, attributed=False, api_key=self.api_key
            )
        if spec.get("endpoint"):  # a fixed endpoint in the resource itself (Agent Lightning style)
            return llm_for_attempt(spec, spec["endpoint"], rollout_id, attempt_id, attributed=False)
        deadline = time.monotonic() + self.proxy_wait_s
        while not (proxies := await self._live_proxies()):
            if time.monotonic() > deadline:
                raise NoProxy(
                    "the resources name an LLM but no proxy registered in the store; start "
                    "`fulmen llm-proxy` or set FULMEN_LLM_BASE_URL"
                )
            log.info("waiting for an LLM proxy to register (rollout %s)", rollout_id)
            await asyncio.sleep(1.0)
        proxy = pick_proxy(proxies, rollout_id)
        return llm_for_attempt(spec, proxy.base_url, rollout_id, attempt_id, api_key=self.api_key)

    async def resolve(self, claimed: AttemptedRollout) -> AgentInputs:
        rollout = claimed.rollout
        snapshot = await self.snapshot(rollout.resources_id)
        resources = dict(snapshot.resources) if snapshot else {}
        llm_spec = resources.get("llm")
        llm = None
        if isinstance(llm_spec, dict):
            llm = await self.llm(llm_spec, rollout.rollout_id, claimed.attempt.attempt_id)
        elif self.llm_base_url:
            llm = await self.llm({}, rollout.rollout_id, claimed.attempt.attempt_id)
        template = resources.get("prompt_template")
        return AgentInputs(
            task=rollout.input,
            llm=llm,
            prompt_template=prompt_template_of(template) if template is not None else None,
            rollout=rollout,
            resources=resources,
        )
