"""The dashboard's pages: experiments, a run, its rollouts (filtered, paged), one rollout with its
attempts and span tree, the live pipeline, the curves, the dead letters.

Read-only unless `DashboardSettings.dashboard_admin` enables the two POST routes. More:
docs/design/telemetry.md.
"""

from __future__ import annotations

import logging
import re
import time
from importlib import resources
from typing import Any
from urllib.parse import urlencode

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from fulmen import keys as k
from fulmen.errors import FulmenError, InvalidInput, InvalidTransition, NotFound
from fulmen.settings import DashboardSettings
from fulmen.store import RedisStore
from fulmen.store.browse import browse_rollouts
from fulmen.store.experiments import list_experiments
from fulmen.store.redis.connection import async_client
from fulmen.telemetry.pipeline import (
    COUNTERS,
    Frame,
    aread_frame,
    live_proxies,
    live_workers,
    rate,
    replica_liveness,
    service_rows,
)
from fulmen.telemetry.steps import MAX_STEPS
from fulmen_dashboard import params, queries
from fulmen_dashboard.http import (
    Auth,
    HttpError,
    Receive,
    Request,
    Response,
    Routes,
    Scope,
    Send,
    read_body,
    same_origin,
)
from fulmen_dashboard.render import render

log = logging.getLogger(__name__)

STATIC_TYPES = {".js": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8", ".LICENSE": "text/plain",
                ".svg": "image/svg+xml"}
DEAD_LETTERS_PAGE = 100
MAX_EXPERIMENTS = 200  # listed on the first page


def _static_files() -> dict[str, tuple[bytes, str]]:
    """Every static file, read once at start: the charting library ships in the package."""
    folder = resources.files("fulmen_dashboard") / "static"
    out = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if suffix in STATIC_TYPES:
            out[entry.name] = (entry.read_bytes(), STATIC_TYPES[suffix])
    return out


class DashboardApp:
    """ASGI callable. The Redis client is made at startup (lifespan) and closed at shutdown."""

    def __init__(self, settings: DashboardSettings, client: aioredis.Redis | None = None) -> None:
        self.settings = settings
        self.admin = settings.dashboard_admin
        token = settings.dashboard_token
        self.auth = Auth(token.get_secret_value() if token is not None else None)
        self.client = client
        self._own_client = client is None
        self.static = _static_files()
        self._frames: dict[str, Frame] = {}  # the previous live frame per experiment, for rates
        self.routes = Routes()
        r = self.routes
        r.add("GET", "/healthz", self.healthz)
        r.add("GET", "/readyz", self.readyz)
        r.add("GET", "/static/{name}", self.static_file)
        r.add("GET", "/favicon.ico", self.favicon)
        r.add("GET", "/", self.experiments)
        r.add("GET", "/e/{experiment}", self.run)
        r.add("GET", "/e/{experiment}/rollouts", self.rollouts)
        r.add("GET", "/e/{experiment}/rollouts/{rollout_id}", self.rollout)
        r.add("POST", "/e/{experiment}/rollouts/{rollout_id}/cancel", self.cancel)
        r.add("GET", "/e/{experiment}/live", self.live)
        r.add("GET", "/e/{experiment}/curves", self.curves)
        r.add("GET", "/e/{experiment}/curves.json", self.curves_json)
        r.add("GET", "/e/{experiment}/dead-letters", self.dead_letters)
        r.add("POST", "/e/{experiment}/dead-letters/{dead_letter_id}/requeue", self.requeue)

    # --- ASGI ---------------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            response = await self.handle(scope, receive)
            if scope.get("method") == "HEAD":
                response.body = b""
            await response.send(send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if self.client is None:
                    self.client = async_client(self.settings.redis_url_value(), socket_timeout=10)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._own_client and self.client is not None:
                    await self.client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def handle(self, scope: Scope, receive: Receive) -> Response:
        started = time.perf_counter()
        try:
            request = Request.from_scope(scope)
            handler, request.params = self.routes.find(request.method, request.path)
            if request.path not in ("/healthz", "/readyz", "/favicon.ico"):  # probes send no secret
                self.auth.check(request)
            if request.method == "POST":
                same_origin(request)
                await read_body(receive)
            response = await handler(request)
        except HttpError as e:
            response = self._error(e.status, e.message, e.headers)
        except NotFound as e:
            response = self._error(404, str(e))
        except (InvalidInput, InvalidTransition) as e:
            response = self._error(400, str(e))
        except (RedisError, OSError) as e:
            log.warning("dashboard: Redis unreachable: %s", type(e).__name__)  # the message may hold the URL
            response = self._error(503, f"Redis unreachable ({type(e).__name__})")
        except FulmenError as e:
            response = self._error(500, f"{type(e).__name__}: {e}")
        response.headers.setdefault("server-timing", f"app;dur={(time.perf_counter() - started) * 1000:.1f}")
        return response

    def _error(self, status: int, message: str, headers: dict[str, str] | None = None) -> Response:
        body = render("error.html", status=status, message=message, title=f"{status}")
        return Response(body, status, headers=dict(headers or {}))

    def _store(self, experiment: str) -> RedisStore:
        assert self.client is not None
        return RedisStore(self.client, experiment)

    async def _existing(self, request: Request) -> RedisStore:
        store = self._store(params.experiment(request))
        await queries.must_exist(store)
        return store

    def _page(self, template: str, **context: Any) -> Response:
        return Response(render(template, admin=self.admin, **context))

    # --- pages --------------------------------------------------------------------------------------

    async def healthz(self, request: Request) -> Response:
        return Response.json({"ok": True})

    async def readyz(self, request: Request) -> Response:
        """200 when Redis answers; 503 with the reason otherwise (the handler turns errors into 503)."""
        assert self.client is not None
        await self.client.ping()
        return Response.json({"ready": True})

    async def static_file(self, request: Request) -> Response:
        found = self.static.get(request.params["name"])
        if found is None:
            raise HttpError(404, "no such file")
        return Response(found[0], content_type=found[1], headers={"cache-control": "max-age=3600"})

    async def favicon(self, request: Request) -> Response:
        body, kind = self.static["favicon.svg"]
        return Response(body, content_type=kind, headers={"cache-control": "max-age=86400"})

    async def experiments(self, request: Request) -> Response:
        assert self.client is not None
        names = (await list_experiments(self.client))[:MAX_EXPERIMENTS]
        rows = []
        for name in names:
            try:
                keys = k.Keys(name)
            except InvalidInput:
                continue  # a name some other tool wrote: not ours to show
            frame = await aread_frame(self.client, keys, steps=1)
            rows.append({"name": name, "frame": frame})
        return self._page("experiments.html", title="experiments", rows=rows)

    async def run(self, request: Request) -> Response:
        store = await self._existing(request)
        frame = await aread_frame(store.redis, store.keys, steps=1)
        passes = await queries.validations(store)
        return self._page("run.html", title=f"run {store.experiment}", experiment=store.experiment, frame=frame,
                          validations=passes[-20:], scores=queries.score_columns(passes[-20:]), counters=COUNTERS,
                          run_config=await queries.run_config(store))

    async def rollouts(self, request: Request) -> Response:
        store = await self._existing(request)
        where, limit, cursor = params.rollout_filter(request)
        page = await browse_rollouts(store.redis, store.keys, where, limit=limit, cursor=cursor)
        query = {name: value for name, value in request.query.items() if name != "cursor"}
        next_url = None
        if page.next_cursor is not None:
            next_url = f"?{urlencode({**query, 'cursor': page.next_cursor.encode()})}"
        return self._page("rollouts.html", title=f"rollouts of {store.experiment}", experiment=store.experiment,
                          page=page, query=request.query, next_url=next_url, first_url=f"?{urlencode(query)}")

    async def rollout(self, request: Request) -> Response:
        store = await self._existing(request)
        rollout_id = params.identifier(request, "rollout_id", "rollout id")
        view = await queries.rollout_view(store, rollout_id)
        return self._page("rollout.html", title=f"rollout {rollout_id}", experiment=store.experiment, view=view)

    async def live(self, request: Request) -> Response:
        store = await self._existing(request)
        frame = await aread_frame(store.redis, store.keys)
        before = self._frames.get(store.experiment)
        self._frames[store.experiment] = frame
        counters = [(label, int(value(frame)), rate(frame, before, value)) for label, value in COUNTERS]
        context = {
            "experiment": store.experiment, "frame": frame, "counters": counters, "services": service_rows(frame),
            "workers": live_workers(frame), "proxies": live_proxies(frame), "replicas": replica_liveness(frame),
            "letters": await queries.dead_letters(store, 10), "finished": await queries.recent_finished(store),
        }
        if request.query.get("fragment") == "1":
            return Response(render("live_body.html", **context))
        return self._page("live.html", title=f"live {store.experiment}", **context)

    async def curves(self, request: Request) -> Response:
        store = await self._existing(request)
        return self._page("curves.html", title=f"curves of {store.experiment}", experiment=store.experiment,
                          labels=[label for label, _ in queries.CURVES])

    async def curves_json(self, request: Request) -> Response:
        store = await self._existing(request)
        last = params.integer(request, "steps", queries.CURVE_STEPS, 1, MAX_STEPS)
        return Response.json(await queries.curves(store, last))

    async def dead_letters(self, request: Request) -> Response:
        store = await self._existing(request)
        limit = params.integer(request, "limit", DEAD_LETTERS_PAGE, 1, 1000)
        letters = await queries.dead_letters(store, limit)
        return self._page("dead_letters.html", title=f"dead letters of {store.experiment}",
                          experiment=store.experiment, letters=letters)

    # --- admin actions (off unless enabled) ------------------------------------------------------------

    def _require_admin(self) -> None:
        if not self.admin:
            raise HttpError(403, "admin actions are disabled (set FULMEN_DASHBOARD_ADMIN=true to enable them)")

    async def cancel(self, request: Request) -> Response:
        self._require_admin()
        store = await self._existing(request)
        rollout_id = params.identifier(request, "rollout_id", "rollout id")
        await store.rollouts.get_rollout(rollout_id)  # 404 for an unknown one
        done = await store.rollouts.cancel_rollout(rollout_id, reason="cancelled from the dashboard")
        log.info("dashboard: rollout %s of %s %s", rollout_id, store.experiment,
                 "cancelled" if done else "had already finished")
        return Response(b"", 303, headers={"location": f"/e/{store.experiment}/rollouts/{rollout_id}"})

    async def requeue(self, request: Request) -> Response:
        self._require_admin()
        store = await self._existing(request)
        letter_id = request.params["dead_letter_id"]
        if not re.fullmatch(r"\d{1,20}-\d{1,20}", letter_id):
            raise HttpError(400, f"dead letter id {letter_id!r} is malformed")
        new_id = await store.dead_letters.requeue_dead_letter(letter_id)
        log.info("dashboard: dead letter %s of %s requeued as %s", letter_id, store.experiment, new_id)
        return Response(b"", 303, headers={"location": f"/e/{store.experiment}/dead-letters"})
