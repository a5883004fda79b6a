"""The dashboard app over a real Redis, called in-process through httpx's ASGI transport."""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import httpx
import pytest

from fulmen.settings import DashboardSettings
from fulmen.store import RedisStore
from fulmen_dashboard.app import DashboardApp

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def dashboard(real_store: RedisStore) -> Callable[..., httpx.AsyncClient]:
    """``dashboard(admin=False, token=None)``: an httpx client on a dashboard app for the test's Redis."""

    def make(admin: bool = False, token: str | None = None) -> httpx.AsyncClient:
        settings = DashboardSettings(experiment=real_store.experiment, dashboard_admin=admin, dashboard_token=token)
        app = DashboardApp(settings, client=real_store.redis)
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://dash.test")

    return make


@pytest.fixture
async def client(dashboard: Callable[..., httpx.AsyncClient]) -> AsyncIterator[httpx.AsyncClient]:
    async with dashboard() as c:
        yield c
