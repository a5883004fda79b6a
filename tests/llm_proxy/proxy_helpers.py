"""The proxy served by uvicorn in a thread, for tests (imported by the proxy tests' modules)."""

from __future__ import annotations

import threading
import time
from typing import Any

import uvicorn

from fulmen.settings import ProxySettings
from fulmen_llm_proxy.app import ProxyApp
from fulmen_llm_proxy.server import bind, build


class RunningProxy:
    """The proxy app under uvicorn on a free loopback port, in a thread."""

    def __init__(self, **settings: Any) -> None:
        settings.setdefault("log_level", "WARNING")
        self.settings = ProxySettings(**settings)
        sock = bind("127.0.0.1", 0)
        self.port = sock.getsockname()[1]
        self.app: ProxyApp
        self.app, config = build(self.settings, sock)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the proxy did not start")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def base(self, rollout_id: str | None = None, attempt_id: str | None = None) -> str:
        """The base URL an agent gets: attributed by path prefix when ids are given."""
        if rollout_id is None:
            return f"{self.url}/v1"
        return f"{self.url}/rollout/{rollout_id}/attempt/{attempt_id}/v1"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
