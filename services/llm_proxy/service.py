"""Everything one proxy process owns, started and stopped together (by the ASGI lifespan).

The start and close sequences: docs/design/proxy.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import redis.asyncio as aioredis

from fulmen.settings import ProxySettings
from fulmen.store import RedisStore
from fulmen.store.redis.connection import connect, connect_weights
from fulmen.store.redis.hot_connection import HotConnection
from fulmen_llm_proxy.backends.base import Backend
from fulmen_llm_proxy.backends.registry import make_backend
from fulmen_llm_proxy.backends.upstream.replicas import ReplicaView
from fulmen_llm_proxy.control import ControlFollower
from fulmen_llm_proxy.following import ModelFollower
from fulmen_llm_proxy.gate import Gate
from fulmen_llm_proxy.metrics import ProxyMetrics
from fulmen_llm_proxy.recording import OtlpExport
from fulmen_llm_proxy.registry import Registration, default_proxy_id

log = logging.getLogger(__name__)

# /readyz answers within a load balancer's probe timeout even when Redis hangs.
READY_PING_TIMEOUT_S = 2.0
# A background task (registry heartbeat, control reader, model follower) that fails is started again
# after this long, doubling up to the cap; meanwhile the proxy is not ready.
RESTART_FIRST_DELAY_S = 0.5
RESTART_MAX_DELAY_S = 10.0


class ProxyService:
    def __init__(self, settings: ProxySettings, base_url: str, backend: Backend | None = None,
                 stopping: asyncio.Event | None = None) -> None:
        """``stopping``: set (SIGTERM) while `start` loads, the proxy announces nothing (`start`)."""
        self.settings = settings
        self.stopping = stopping or asyncio.Event()
        self.base_url = base_url
        self.proxy_id = default_proxy_id(base_url)
        self.backend = backend or make_backend(settings)
        self.metrics = ProxyMetrics()
        self.gate = Gate()
        self.otlp = OtlpExport.from_env()  # None unless OTEL_EXPORTER_OTLP_ENDPOINT is set
        self.api_keys = [
            key.strip().encode()
            for key in (settings.proxy_api_keys.get_secret_value() if settings.proxy_api_keys else "").split(
                ","
            )
            if key.strip()
        ]
        self.redis: aioredis.Redis | None = None
        self.hot: HotConnection | None = None  # the connection of every call's Redis commands
        self.store: RedisStore | None = None
        self.control: ControlFollower | None = None
        self.follower: ModelFollower | None = None
        self.registration: Registration | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._down: set[str] = set()  # background tasks failed and waiting to be started again

    @property
    def default_model(self) -> str | None:
        names = self.backend.model_names
        return names[0] if names else None

    async def start(self) -> None:
        self.redis = await connect(self.settings)
        if isinstance(self.redis, aioredis.Redis):  # a cluster client routes each command itself
            self.hot = HotConnection.install(self.redis)
        self.store = RedisStore(
            self.redis, self.settings.experiment, max_record_bytes=self.settings.max_record_bytes,
            weights_redis=await connect_weights(self.settings),
        )
        await self.backend.start()
        self.metrics.set_model_version(self.backend.model_version)
        self.registration = Registration(self.store, self.proxy_id, self.base_url, self._describe)
        self.control = ControlFollower(self.store, self.gate, self.proxy_id, self.registration.refresh)
        if self.backend.system == "torch":  # upstream servers load their weights themselves
            follower = ModelFollower(self.store, self.backend, self._loaded, self.settings.weights_dir,
                                     gate=self.gate, who=f"llm-proxy {self.proxy_id}",
                                     checkpoint_dir=self.settings.checkpoint_dir)
            self.follower = follower  # not ready while it waits for a lost version (`waiting`)
            await follower.catch_up()  # before registering or serving: never answer with stale weights
            self._spawn(follower.run, "model versions")
        follow_replicas = getattr(self.backend, "follow_replicas", None)
        if follow_replicas is not None:  # vllm: vllm-sync records what each replica serves
            replicas = ReplicaView(self.store)
            await replicas.refresh()
            follow_replicas(replicas)
            self._spawn(replicas.run, "replica states")
        if self.stopping.is_set():  # SIGTERM while loading: register and announce nothing, serve nothing
            log.info("llm-proxy %s stopped while starting: not registered", self.proxy_id)
            await self.close()
            return
        await self.registration.register()
        self._spawn(self.registration.run, "registry")
        self._spawn(self.control.run, "control")
        log.info(
            "llm-proxy %s serving %s (%s backend, version %s) at %s",
            self.proxy_id, self.default_model or "upstream models", self.backend.system,
            self.backend.model_version, self.base_url,
        )  # fmt: skip

    def _spawn(self, work: Callable[[], Awaitable[Any]], name: str) -> None:
        self._tasks.append(asyncio.create_task(self._supervise(work, name), name=name))

    async def _supervise(self, work: Callable[[], Awaitable[Any]], name: str) -> None:
        """Run ``work`` again whenever it fails, with backoff; the proxy is not ready while it is down."""
        delay = RESTART_FIRST_DELAY_S
        while True:
            try:
                await work()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                self._down.add(name)
                log.exception("background task %r failed: starting it again in %.1f s", name, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, RESTART_MAX_DELAY_S)
                self._down.discard(name)

    def _loaded(self, version: str, outcome: str) -> None:
        self.metrics.weight_loads.labels(outcome).inc()
        if outcome == "loaded":
            self.metrics.set_model_version(version)
            if self.registration is not None:
                self.registration.refresh()

    def _describe(self) -> dict[str, Any]:
        return {
            "model": self.default_model or "",
            "model_version": self.backend.model_version,
            "metadata": {
                "backend": self.backend.system,
                "state": self.control.state if self.control else self.gate.state,
                "control_id": self.control.control_id if self.control else "",
                "in_flight": self.gate.in_flight,
                "pid": os.getpid(),
            },
        }

    @property
    def waiting(self) -> str | None:
        """Why the proxy is not ready although it runs: the model version it must serve first."""
        return self.follower.waiting if self.follower is not None else None

    async def ready(self) -> bool:
        if self.redis is None or not self.backend.ready() or self._down or self.waiting is not None:
            return False
        try:
            return bool(await asyncio.wait_for(self.redis.ping(), READY_PING_TIMEOUT_S))
        except Exception:
            return False

    async def close(self) -> None:
        self.gate.set_state("closing")
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.control is not None:
            self.control.close()
        if self.registration is not None:
            await self.registration.unregister()
        await self.backend.close()
        if self.otlp is not None:  # after the last call: its span is queued, flush it
            await asyncio.to_thread(self.otlp.close)
        if self.hot is not None:
            await self.hot.close()
        if self.store is not None:
            await self.store.aclose()  # its auto-pipeline's wire, then the client
        elif self.redis is not None:
            await self.redis.aclose()
