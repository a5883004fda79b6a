"""Model following: load each model version the store's resources announce.

A version that fails to load is logged and counted; the proxy keeps the one it has. A version whose
weights Redis lost is never skipped: the proxy asks for its rebuild and is not ready (new calls wait)
until it serves it or a newer one (`fulmen.versions.rebuild_asks`). Deltas and reading the next
version ahead: docs/design/proxy.md; lost weights: docs/design/model-versions.md.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fulmen.errors import NotFound, RecordError
from fulmen.records import ResourcesUpdate
from fulmen.store import RedisStore
from fulmen.versions.transport.file_follow import FileReadAhead
from fulmen_llm_proxy.backends.base import Backend
from fulmen_llm_proxy.blob_buffer import ReusedBuffer
from fulmen_llm_proxy.gate import Gate

log = logging.getLogger(__name__)

PREFETCH_FOLLOW_S = 30.0  # the next chunk of a version being written comes within this, or it stopped
ASK_AGAIN_S = 30.0  # a lost version with no answer to its rebuild ask is asked for (and read) again


class ModelFollower:
    def __init__(self, store: RedisStore, backend: Backend, on_loaded: Callable[[str, str], Any],
                 shared_dir: Path | None = None, *, gate: Gate | None = None, who: str = "llm-proxy",
                 checkpoint_dir: Path | None = None) -> None:
        self.store = store
        self.checkpoint_dir = checkpoint_dir  # the trainer's checkpoints, if this host can read them
        self.gate = gate  # held while a lost version is waited for
        self.who = who  # who asks for a rebuild, in the ask
        self.waiting: str | None = None  # why the proxy is not ready: the lost version it waits for
        self._recovery: tuple[str, asyncio.Task[None]] | None = None  # (version, the wait for its rebuild)
        self._loading = asyncio.Lock()  # one load at a time: the follower's and the recovery's
        self.backend = backend
        self.on_loaded = on_loaded  # (model_version, outcome: loaded | failed)
        self.warned_ab = False
        self.shared_dir = shared_dir  # where versions' files are written, if they are
        self._prefetch: tuple[str, asyncio.Task[Any]] | None = None  # (version, its read as it is written)
        self._file_ahead: FileReadAhead | None = None  # the same for a file in the shared folder
        self.buffers = ReusedBuffer()  # the last version's blob buffer, to read the next one into
        self.prefetched: list[str] = []  # versions loaded from a prefetch (for tests and logs)

    async def catch_up(self) -> int | None:
        """Load the newest model version the resources name (before the proxy serves: a restarted
        proxy must not answer with the base weights); the latest resources version, None if none.

        The newest entry may name no version (the algorithm's validation resources, published after
        the policy's): then the newest one that does counts."""
        latest = await self.store.resources.get_latest_resources()
        if latest is None:
            return None
        named = latest if _model_version(latest) else next(
            (u for u in await self.store.resources.query_resources(descending=True) if _model_version(u)), None
        )
        if named is not None:
            await self.consider(named)
        return latest.version

    async def run(self) -> None:
        """Catch up, then load every version announced after that, forever."""
        try:
            after = await self.catch_up()
            self._prefetch_next()
            async for update in self.store.resources.subscribe_resources(after_version=after):
                await self.consider(update)
        finally:
            self.close()

    def close(self) -> None:
        """Stop reading ahead and waiting for a rebuild."""
        self._drop_prefetch()
        if self._recovery is not None:
            self._recovery[1].cancel()
            self._recovery = None

    def _prefetch_next(self, newest: str | None = None) -> None:
        """Start reading the version the trainer will publish after the one served (``v<n+1>``), or
        after ``newest`` (a rollback serves an older version than the newest published)."""
        from fulmen.versions.transport.stream import read_stream

        following = next_name(newest or self.backend.model_version)
        if self._prefetch is not None and self._prefetch[0] == following:
            return
        self._drop_prefetch()
        task = asyncio.ensure_future(read_stream(self.store, following, self.buffers.allocate, follow_s=PREFETCH_FOLLOW_S))
        task.add_done_callback(_quiet)
        self._prefetch = (following, task)
        if self.shared_dir is not None:
            self._file_ahead = FileReadAhead(self.shared_dir, following, PREFETCH_FOLLOW_S)

    def _drop_prefetch(self) -> None:
        if self._prefetch is not None:
            self._prefetch[1].cancel()
            self._prefetch = None
        if self._file_ahead is not None:
            self._file_ahead.close()
            self._file_ahead = None

    async def _take_prefetch(self, version: str, llm: dict[str, Any]) -> tuple[Any, str, str | None] | None:
        """What the prefetch read of ``version``, if it read the blob (stream or file) ``llm`` names;
        else None (it was reading another version or transport, it failed or stalled)."""
        from fulmen.versions.model_version import names_blob

        prefetch, self._prefetch = self._prefetch, None
        ahead, self._file_ahead = self._file_ahead, None
        weights = llm.get("weights")
        if ahead is not None:
            if ahead.version == version and isinstance(weights, dict) and "path" in weights:
                found_file = await ahead.take(weights)
                if prefetch is not None:
                    prefetch[1].cancel()
                return found_file
            ahead.close()
        if prefetch is None:
            return None
        name, task = prefetch
        if name != version or not isinstance(weights, dict) or "stream" not in weights:
            task.cancel()
            return None
        # The entry is written after the last chunk: the read has only what is left to go. A bound
        # anyway, for a stream deleted before the read began (it would wait for a first chunk).
        try:
            found = await asyncio.wait_for(task, PREFETCH_FOLLOW_S)
        except asyncio.CancelledError:
            if task.cancelled():
                return None
            raise
        except Exception as e:  # read again the usual way, which says what is wrong if anything is
            log.warning("reading model version %s while it was written failed (%r): reading it again", version, e)
            return None
        if found is None or not names_blob(llm, found[1]):
            return None
        self.buffers.keep(found[0])  # reused for the next version once the backend has copied it
        return found

    async def consider(self, update: ResourcesUpdate) -> None:
        from fulmen.versions.model_version import llm_resource

        llm = llm_resource(update)
        if not llm:
            return
        version = _model_version(update)
        if version and version != self.backend.model_version:
            await self._load(version, llm, update)
        await self._follow_b(llm)

    async def _load(self, version: str, llm: dict[str, Any], update: ResourcesUpdate) -> None:
        path = (llm.get("weights") or {}).get("path") if isinstance(llm.get("weights"), dict) else None
        if isinstance(path, str):  # the trainer's folder: the next version will likely be there too
            self.shared_dir = Path(path).parent.parent
        try:
            await self._load_version(version, llm, update)
        finally:
            newest = llm.get("newest_version")  # after a rollback, names go on from the newest ever published
            self._prefetch_next(newest if isinstance(newest, str) else None)

    async def _load_version(self, version: str, llm: dict[str, Any], update: ResourcesUpdate) -> None:
        try:
            async with self._loading:
                state_dict, weights = await self._weights(version, llm, await self._take_prefetch(version, llm))
                loaded = await self.backend.load_weights(state_dict, version, weights)
        except NotFound:
            from fulmen.versions.rebuild import weights_lost

            if await weights_lost(self.store, version) is not None:  # lost by Redis, not deleted
                self._wait_for_rebuild(version, llm, update)
                return
            # its weights are deleted once newer versions exist (fulmen.versions.retention): a newer
            # announcement follows, or catch-up already named it
            log.info("model version %s is no longer stored (a newer one replaced it): skipped", version)
            return
        except Exception:  # a bad version must not take the proxy down: keep serving the old one
            log.exception("could not load model version %s", version)
            self.on_loaded(version, "failed")
            return
        if loaded:
            self._serving(version, update)

    def _serving(self, version: str, update: ResourcesUpdate) -> None:
        """``version`` is loaded: a wait for a lost version ends (this one or a newer one is served)."""
        if self._recovery is not None and self._recovery[1] is not asyncio.current_task():
            self._recovery[1].cancel()
        self._recovery = None
        if self.waiting is not None:
            self.waiting = None
            if self.gate is not None:
                self.gate.release()
        log.info("now serving model version %s (resources %s v%d)", version, update.resources_id, update.version)
        self.on_loaded(version, "loaded")

    def _wait_for_rebuild(self, version: str, llm: dict[str, Any], update: ResourcesUpdate) -> None:
        """Not ready, new calls held, until ``version`` (lost by Redis) is stored again and loaded."""
        self.waiting = (f"waiting for model version {version}: its weights are gone from Redis (it restarted); "
                        "rebuilding it from the trainer's checkpoint, here if this host reads them, else asked "
                        f"for (a running trainer answers; with it stopped elsewhere, run `fulmen rollback {version}` "
                        "where the checkpoints are)")
        log.warning("%s", self.waiting)
        if self.gate is not None:
            self.gate.hold(self.waiting)
        if self._recovery is not None and self._recovery[0] == version:
            return
        if self._recovery is not None:
            self._recovery[1].cancel()
        self._recovery = (version, asyncio.create_task(self._recover(version, llm, update)))

    async def _recover(self, version: str, llm: dict[str, Any], update: ResourcesUpdate) -> None:
        """Ask for ``version``'s rebuild and load it once it is stored again (asking again every
        `ASK_AGAIN_S` without an answer); a refusal is logged and the wait goes on: the trainer
        then publishes its weights as a newer version, which ends it."""
        from fulmen.records import RebuildAction
        from fulmen.versions.rebuild_asks import ask_rebuild, wait_for_answer

        refused = False
        after = "0-0"
        from fulmen.versions.rebuild import rebuild_here

        await rebuild_here(self.store, version, self.checkpoint_dir, by=self.who)  # where checkpoints are read
        while True:
            if not refused:  # once refused, asking again would be refused again: wait for news instead
                after = await ask_rebuild(self.store, version, self.who)
            found = await wait_for_answer(self.store, version, after, ASK_AGAIN_S)
            if found is not None and found[1].action == RebuildAction.REFUSED:
                (after, answer), refused = found, True
                self.waiting = (f"waiting for model version {version}: its weights are gone from Redis and "
                                f"{answer.by} cannot rebuild them ({answer.reason})")
                log.error("%s", self.waiting)
                continue
            try:
                async with self._loading:
                    state_dict, weights = await self._weights(version, llm)
                    loaded = await self.backend.load_weights(state_dict, version, weights)
            except NotFound:
                continue
            except Exception:  # rebuilt but unusable: say so, and wait for what comes next
                log.exception("could not load the rebuilt model version %s", version)
                self.on_loaded(version, "failed")
                continue
            if loaded or self.backend.model_version == version:
                self._serving(version, update)
                return

    async def _follow_b(self, llm: dict[str, Any]) -> None:
        """An A/B test's B version (`fulmen.serving.ab`) on a backend that serves two; ended when not named."""
        from fulmen.serving.ab import ab_of
        from fulmen.versions.manifest import DELTA
        from fulmen.versions.model_version import fetch_full_version

        arm = ab_of(llm)
        serve_b = getattr(self.backend, "serve_b", None)
        if serve_b is None:
            if arm is not None and not self.warned_ab:
                log.warning("A/B test of %s: this backend serves one version (A); use torch proxies for A/B",
                            arm[0])
                self.warned_ab = True
            return
        if arm is None:
            if self.backend.b_version:
                await serve_b(None, "", None, 0.0)
                log.info("A/B test over: serving %s alone", self.backend.model_version)
            return
        version, weights, split = arm
        if version == self.backend.b_version:
            self.backend.split = split
            return
        try:
            found = await fetch_full_version(self.store, version, resource={"weights": weights})
            fmt = {**weights, "format": "full"} if weights.get("format") == DELTA else weights
            await serve_b(found.state, version, fmt, split)
        except Exception:  # the test goes on without B rather than the proxy going down
            log.exception("could not load model version %s for the A/B test", version)
            return
        log.info("A/B test: %s for %.0f%% of rollouts, %s for the rest", version, 100 * split,
                 self.backend.model_version)

    async def _weights(
        self, version: str, llm: dict[str, Any], prefetched: tuple[Any, str, str | None] | None = None
    ) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """The tensors to load and how: as published, or for a delta the tensors it changes (applied
        onto the served weights) or the whole version rebuilt from its chain. ``prefetched``: the
        version's stream as read while it was written (`fetch_version` checks it is the one named)."""
        import asyncio

        from fulmen.versions.delta import apply_delta
        from fulmen.versions.manifest import DELTA
        from fulmen.versions.model_version import fetch_full_version, fetch_version

        weights = llm.get("weights") if isinstance(llm.get("weights"), dict) else None
        found = await fetch_version(self.store, version, resource=llm, prefetched=prefetched)
        if prefetched is not None:
            self.prefetched.append(version)
        if found.manifest is None or found.manifest.format != DELTA:
            return found.state, weights
        current = self.backend.current_weights()
        if current is not None and self.backend.model_version == found.manifest.base_version:
            try:
                changed = await asyncio.to_thread(apply_delta, found.state, found.manifest, current.__getitem__, version)
                return changed, {**(weights or {}), "format": DELTA}
            except (RecordError, KeyError) as e:
                log.warning("model version %s does not apply onto the served %s (%s): loading it whole", version,
                            found.manifest.base_version, e)
        full = await fetch_full_version(self.store, version, resource=llm)
        return full.state, {**(weights or {}), "format": "full"}


def _model_version(update: ResourcesUpdate) -> str | None:
    """The model version an update's ``llm`` entry names, or None."""
    from fulmen.versions.model_version import llm_resource

    version = (llm_resource(update) or {}).get("model_version")
    return version if isinstance(version, str) and version else None


def next_name(served: str | None) -> str:
    """The name a publisher most likely gives the version after ``served``: its trailing number plus
    one (``v7`` → ``v8``, the trainer's names; ``run2-step9`` → ``run2-step10``); ``v1`` after the base
    weights or a name without a number."""
    match = re.fullmatch(r"(.*?)(\d+)", served or "")
    return f"{match[1]}{int(match[2]) + 1}" if match else "v1"


def _quiet(task: asyncio.Task[Any]) -> None:
    """A prefetch nobody took: its outcome (a cancel, a failed read) is not worth a log line."""
    if not task.cancelled():
        task.exception()
