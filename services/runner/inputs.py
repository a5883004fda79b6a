"""What an attempt's agent receives: the resources snapshot its rollout names, and an `LLM` on a proxy.

The runner's ``api_key`` never goes to an ``endpoint`` named inside a resource. How the proxy is
picked: docs/design/runner.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fulmen.errors import NotFound, RetryableError
from fulmen.records import AttemptedRollout, ResourcesUpdate
from fulmen.sdk.agent import AgentInputs
from fulmen.sdk.resources import LLM, MissingLLM, llm_for_attempt, prompt_template_of
from fulmen.store import RedisStore
from fulmen.store.registry import pick_proxy

log = logging.getLogger(__name__)


PROXY_HINT_AFTER_S = 5.0  # waiting for a proxy this long, say what is awaited


class NoProxy(RetryableError):
    """The resources name an LLM but no proxy has registered (yet)."""


def served_model(root: str, api_key: str | None) -> str:
    """The first model ``GET {root}/v1/models`` lists; a clear error when it cannot be asked."""
    import httpx

    from fulmen.sdk.resources import NO_API_KEY

    try:
        reply = httpx.get(f"{root}/v1/models", headers={"Authorization": f"Bearer {api_key or NO_API_KEY}"},
                          timeout=10.0)
        reply.raise_for_status()
        return str(reply.json()["data"][0]["id"])
    except httpx.TransportError as e:  # the proxy is unreachable: fails the attempt as the agent's call would
        import openai

        raise openai.APIConnectionError(message=f"{type(e).__name__}: {e}", request=e.request) from e
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as e:
        raise RetryableError(
            f"no model name for the agent: the resources name none and {root}/v1/models did not say "
            f"({type(e).__name__}: {e}); publish one with `fulmen serve --model-name NAME`"
        ) from None


class InputResolver:
    def __init__(
        self,
        store: RedisStore,
        *,
        llm_base_url: str | None = None,
        api_key: str | None = None,
        proxy_wait_s: float = 30.0,
        model: str | None = None,
    ) -> None:
        self.store = store
        self.llm_base_url = llm_base_url
        self.model = model  # what llm_base_url serves, when the caller knows (over the resource's)
        self.api_key = api_key
        self.proxy_wait_s = proxy_wait_s
        self._snapshots: dict[str | None, tuple[float, ResourcesUpdate | None]] = {}
        self._proxies: tuple[float, list[Any]] = (0.0, [])
        self._models: dict[str, str] = {}

    async def snapshot(self, resources_id: str | None) -> ResourcesUpdate | None:
        """The rollout's resources (the latest version of the id it names, or the latest snapshot of
        all), re-read at most once a second: a new model version reaches new attempts within 1 s."""
        cached = self._snapshots.get(resources_id)
        if cached is not None and time.monotonic() - cached[0] < 1.0:
            return cached[1]
        if resources_id is None:
            update = await self.store.resources.get_latest_resources()
        else:
            try:
                update = await self.store.resources.get_resources(resources_id)
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
            proxies = await self.store.registry.query_proxies()
            self._proxies = (time.monotonic(), proxies)
        return proxies

    async def llm(self, spec: dict[str, Any], rollout_id: str, attempt_id: str) -> LLM:
        """The attempt's LLM: always on a proxy path that names the attempt, always with a model name."""
        if self.llm_base_url:
            model = self.model or spec.get("model") or await self._served_model(self.llm_base_url, self.api_key)
            return llm_for_attempt(spec, self.llm_base_url, rollout_id, attempt_id, model=model, api_key=self.api_key)
        if spec.get("endpoint"):  # a fixed endpoint in the resource itself (Agent Lightning style)
            model = spec.get("model") or await self._served_model(spec["endpoint"], None)
            return llm_for_attempt(spec, spec["endpoint"], rollout_id, attempt_id, model=model)
        deadline = time.monotonic() + self.proxy_wait_s
        waited_since = time.monotonic()
        while not (proxies := await self._live_proxies()):
            if time.monotonic() > deadline:
                raise NoProxy(
                    "the resources name an LLM but no proxy registered in the store; start "
                    "`fulmen llm-proxy --model-dir DIR` (or set FULMEN_LLM_BASE_URL to a proxy's URL)"
                )
            if time.monotonic() - waited_since > PROXY_HINT_AFTER_S:
                log.warning("rollout %s waits for an LLM proxy to register (%.0f s so far): is "
                            "`fulmen llm-proxy` running on this Redis and experiment?", rollout_id,
                            time.monotonic() - waited_since)
                waited_since = time.monotonic()
            await asyncio.sleep(1.0)
        proxy = pick_proxy(proxies, rollout_id)
        return llm_for_attempt(spec, proxy.base_url, rollout_id, attempt_id, model=proxy.model, api_key=self.api_key)

    async def registered_proxy(self, rollout_id: str) -> str | None:
        """The base URL of the registered proxy a new attempt of the rollout would get (None: the
        runner's llm_base_url decides, or no proxy is registered)."""
        if self.llm_base_url:
            return None
        proxies = await self._live_proxies()
        return pick_proxy(proxies, rollout_id).base_url.rstrip("/") if proxies else None

    async def _served_model(self, base_url: str, api_key: str | None) -> str:
        """The model a proxy (or any OpenAI-compatible server) serves, from its ``/v1/models``, asked once."""
        root = base_url.rstrip("/")
        root = root[: -len("/v1")] if root.endswith("/v1") else root
        if root not in self._models:
            self._models[root] = await asyncio.to_thread(served_model, root, api_key)
        return self._models[root]

    async def _default_llm(self, rollout_id: str, attempt_id: str) -> LLM | MissingLLM:
        """No "llm" resource: the LLM of a running proxy (the model it serves), or a `MissingLLM`
        that says what to start when the agent uses it."""
        if self.llm_base_url or await self._live_proxies():
            return await self.llm({}, rollout_id, attempt_id)
        return MissingLLM(
            "no LLM proxy is registered on this Redis and experiment, and no \"llm\" resource names one. "
            "Start one (`fulmen llm-proxy --model-dir DIR`, or `fulmen run-once` serves one itself), "
            "or pass --llm-base-url URL of a running proxy"
        )

    async def resolve(self, claimed: AttemptedRollout, *, wants_llm: bool = True) -> AgentInputs:
        """The attempt's inputs; without ``wants_llm`` (an agent that takes no ``llm``) no LLM is
        looked for."""
        rollout = claimed.rollout
        snapshot = await self.snapshot(rollout.resources_id)
        resources = dict(snapshot.resources) if snapshot else {}
        llm_spec = resources.get("llm")
        llm: LLM | MissingLLM | None = None
        if wants_llm and isinstance(llm_spec, dict):
            llm = await self.llm(llm_spec, rollout.rollout_id, claimed.attempt.attempt_id)
        elif wants_llm:
            llm = await self._default_llm(rollout.rollout_id, claimed.attempt.attempt_id)
        template = resources.get("prompt_template")
        return AgentInputs(
            task=rollout.input,
            llm=llm,
            prompt_template=prompt_template_of(template) if template is not None else None,
            rollout=rollout,
            resources=resources,
        )
