"""Keep one vLLM server serving the trainer's newest model version — and say so only when it does.

On any failure the replica stays NOT READY and the sync is retried; a version whose weights Redis
lost is asked for (`fulmen.versions.rebuild_asks`) and waited for, out of routing. The swap, LoRA
loading and verification: docs/design/vllm-sync.md; the routes: `fulmen_vllm_sync.admin`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from fulmen.errors import NotFound, RecordError
from fulmen.records import ReplicaState, ResourcesUpdate
from fulmen.records.messages import TRACKING_GRACE_S
from fulmen.settings import VllmSyncSettings
from fulmen.store import RedisStore
from fulmen.versions.folder import apply_onto_folder
from fulmen.versions.lora import LORA_FORMAT
from fulmen.versions.manifest import DELTA, FULL
from fulmen.versions.model_version import fetch_full_version, fetch_version, llm_resource
from fulmen_vllm_sync.admin import AdminError, GroupNotEnabled, LoraNotEnabled, VllmAdmin
from fulmen_vllm_sync.materialize import materialize, materialize_adapter, materialize_full
from fulmen_vllm_sync.weight_group import GroupUnavailable, WeightGroup

log = logging.getLogger(__name__)

CANARY_PROMPT = [1, 5, 6, 7, 8, 9, 10, 11]  # token ids every vocabulary has
LORA_LOADINGS = ("auto", "dynamic", "merge")
ADAPTERS_KEPT = 2  # the served adapter and the one before it, for calls that named it and still run
POLL_S = 0.2  # how often a new resources version is looked for
TURN_POLL_S = 0.2  # how often a replica waiting for its turn to load looks again
ANNOUNCED_POLL_S = 0.02  # how often a version received ahead of its announcement looks for it
LOAD_ROUTES = 5  # a load's routes (pause, reload, set version, reset the cache, resume): its turn lasts their timeouts


class SyncFailed(Exception):
    """One sync attempt did not end with the server verifiably serving the version."""


class VllmSync:
    def __init__(self, store: RedisStore, admin: VllmAdmin, settings: VllmSyncSettings, *, check_s: float = 5.0,
                 canary_prompt: list[int] | None = None) -> None:
        """From ``settings``: the replica's URL (replica_url, else vllm_url), model_name, model_dir,
        sync_dir, pause_mode, sync_retry_s, lora_loading and checkpoint_dir."""
        if settings.model_dir is None:
            raise ValueError("vllm-sync needs model_dir: the base model the server started from")
        self.store = store
        self.admin = admin
        self.url = settings.replica_url or settings.vllm_url or ""
        self.model = settings.model_name
        self.model_dir: Path = settings.model_dir
        self.sync_dir = settings.sync_dir
        self.pause_mode = settings.pause_mode
        self.retry_s = settings.sync_retry_s
        self.check_s = check_s
        self.canary_prompt = canary_prompt or CANARY_PROMPT
        self.state = ReplicaState(self.url, "base", ready=False, reason="starting")
        self.recorded_at: float | None = None  # when this replica was first recorded (monotonic)
        self.served_sha: str | None = None
        self.verified_canary: list[float] | None = None  # the canary of the weights last verified
        self.ab_refused: str | None = None  # the A/B version said once not to be servable here
        self.b_failed: tuple[str, float] | None = None  # the A/B version whose load failed, and when
        self.weights_known = True  # False from a failed load until a sync succeeds: what it serves is unknown
        self.lora_loading: str = settings.lora_loading
        self.base_loaded = True  # the server's own weights are the base model's (adapters apply onto them)
        self.adapters: list[str] = []  # loaded adapters, oldest first
        self.syncs = {"ok": 0, "failed": 0}
        self.asked: str | None = None  # the lost version a rebuild was asked for
        self.checkpoint_dir = settings.checkpoint_dir  # the trainer's, rebuilt from if this host reads it
        self.turn_ttl_s = LOAD_ROUTES * settings.sync_timeout_s  # a dead vllm-sync's turn ends by itself
        self.group = (WeightGroup(store, admin, self.url, settings.weight_group_timeout_s)
                      if settings.weight_group else None)
        self.announced: str | None = None  # the newest model version a resources entry names

    async def _mark(self, **changes: Any) -> None:
        self.state = await self.store.registry.set_replica(dataclasses.replace(self.state, **changes))
        if self.recorded_at is None:
            self.recorded_at = time.monotonic()

    async def _after_grace(self) -> None:
        """Change no weights in the first `TRACKING_GRACE_S` after this replica was recorded: a proxy
        that sent a call before it was tracked confirms that call from its view alone."""
        if self.recorded_at is not None:
            await asyncio.sleep(max(0.0, self.recorded_at + TRACKING_GRACE_S - time.monotonic()))

    # --- following the versions ------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Catch up with the newest version, then follow every new one until ``stop``."""
        await self.start()
        while not stop.is_set():
            seen, target = await self._newest()
            if self.group is not None and await self._load_ahead():
                continue
            stale = target is not None and (target[0] != self.state.model_version or not self.state.ready)
            if stale and target is not None and not await self.sync(*target):
                await _sleep_or_stop(stop, self.retry_s)
                continue
            if target is not None and self.state.ready:
                await self.follow_b(target[1])
            await self._wait_for_news(stop, seen)
            await self.check()

    async def start(self) -> None:
        """Take over a server that is already up: it serves the base model until we load a version."""
        try:
            served = await self.admin.served_version()
        except AdminError as e:
            await self._mark(ready=False, reason=f"server not answering: {e}")
            return
        # a version we did not load (an earlier vllm-sync's) is loaded again: its weights are unknown here
        self.base_loaded = served in (None, "base")
        await self._mark(model_version="base", ready=served in (None, "base"),
                         reason="" if served in (None, "base") else f"serves {served!r}: loading again")

    async def check(self) -> None:
        """A server that restarted (or was reloaded by someone else) no longer serves what we set: it
        leaves routing until the next sync puts the version back. A server that did not answer at
        start and now does, serving the base model, joins routing."""
        try:
            served = await self.admin.served_version()
        except AdminError as e:
            if self.state.ready:
                await self._mark(ready=False, reason=f"server not answering: {e}")
            return
        if not self.state.ready:
            if self.weights_known and self.state.model_version == "base" and served in (None, "base"):
                await self._mark(ready=True, reason="")
            return
        own = "base" if self.state.served_model else self.state.model_version
        if (served or "base") != own:
            log.warning("%s serves %r, not %s (restarted?): out of routing until it is loaded again", self.url,
                        served, own)
            if self.group is not None:
                self.group.name = None  # a restarted server's workers are in no group
            await self._mark(ready=False, reason=f"serves {served!r} after a restart")
        elif self.state.served_model:
            try:
                listed = await self.admin.models()
            except AdminError as e:
                await self._mark(ready=False, reason=f"server not answering: {e}")
                return
            if self.state.served_model not in listed:
                log.warning("%s lost the adapter %s (restarted?): out of routing until it is loaded again",
                            self.url, self.state.served_model)
                self.adapters = [a for a in self.adapters if a in listed]
                await self._mark(ready=False, reason=f"adapter {self.state.served_model} is gone after a restart")

    async def _newest(self) -> tuple[int | None, tuple[str, Mapping[str, Any]] | None]:
        """The latest resources version, and the newest model version any entry names with its
        ``llm`` entry (the latest entry may name none: the algorithm's validation resources)."""
        updates = await self.store.resources.query_resources(descending=True)
        seen = updates[0].version if updates else None
        target = next((found for u in updates if (found := _named(u)) is not None), None)
        self.announced = target[0] if target is not None else None
        return seen, target

    async def _wait_for_news(self, stop: asyncio.Event, after: int | None) -> None:
        """Until a resources version newer than ``after`` exists, ``stop`` is set, or ``check_s`` passed.
        Polled (one small read per ``POLL_S``): nothing to cancel mid-read when it returns."""
        deadline = time.monotonic() + self.check_s
        while not stop.is_set() and time.monotonic() < deadline:
            latest = await self.store.resources.get_latest_resources()
            if latest is not None and (after is None or latest.version > after):
                return
            if self.group is not None and await self.group.ahead(self.announced, self.state.model_version):
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), POLL_S)

    # --- one sync --------------------------------------------------------------------------------

    async def sync(self, version: str, llm: Mapping[str, Any]) -> bool:
        """One attempt to make the server serve ``version``; True when it verifiably does."""
        started = time.perf_counter()
        try:
            await self._sync(version, llm)
        except (RecordError, NotFound) as e:
            # read before the server is touched: it keeps serving what it served, verified
            self.syncs["failed"] += 1
            log.error("model version %s cannot be read (%s); %s keeps serving %s and tries again in %.0f s",
                      version, e, self.url, self.state.model_version, self.retry_s)
            if isinstance(e, NotFound):
                await self._wait_for_rebuild(version)
            return False
        except (SyncFailed, AdminError, OSError) as e:
            self.syncs["failed"] += 1
            reason = f"loading {version} failed: {e}"
            log.error("%s. The replica is out of routing until a sync succeeds (retrying in %.0f s); if it "
                      "keeps failing, check that the server runs with VLLM_SERVER_DEV_MODE=1 and sees %s, "
                      "or restart it", reason, self.retry_s, self.sync_dir)
            self.weights_known = False
            await self._mark(ready=False, reason=reason[:500])
            return False
        self.syncs["ok"] += 1
        log.info("%s serves model version %s (loaded and verified in %.2f s)", self.url, version,
                 time.perf_counter() - started)
        return True

    async def _wait_for_rebuild(self, version: str) -> None:
        """``version``'s weights are gone from Redis but not deleted (`fulmen.versions.rebuild`): out of
        routing, saying which version it waits for, and a rebuild asked for once (every retry reads
        it again; whoever rebuilds it answers on the stream)."""
        from fulmen.versions.rebuild import rebuild_here, weights_lost
        from fulmen.versions.rebuild_asks import ask_rebuild

        if await weights_lost(self.store, version) is None:
            return  # deleted by retention: a newer version is named, or will be
        if self.asked != version and await rebuild_here(self.store, version, self.checkpoint_dir,
                                                        by=f"vllm-sync {self.url}"):
            return  # stored again: the next try loads it
        reason = (f"waiting for model version {version}: its weights are gone from Redis (it restarted); asked for "
                  f"a rebuild from the trainer's checkpoint (a running trainer answers; with it stopped, run "
                  f"`fulmen rollback {version}`)")
        if self.asked != version:
            self.asked = version
            await ask_rebuild(self.store, version, f"vllm-sync {self.url}")
            log.warning("%s: %s", self.url, reason)
        if self.state.ready or self.state.reason != reason:
            await self._mark(ready=False, reason=reason)

    async def _sync(self, version: str, llm: Mapping[str, Any]) -> None:
        weights = llm.get("weights") if isinstance(llm.get("weights"), Mapping) else {}
        if self.group is not None and weights.get("format", FULL) != LORA_FORMAT and await self._by_group(version, weights.get("sha256")):
            return
        folder = None
        if weights.get("format", FULL) == FULL:  # the published file as it is, checked on the way
            folder = await materialize_full(self.store, version, weights, self.model_dir, self.sync_dir)
        if folder is None:
            folder = await self._built_folder(version, llm, weights)
        if folder is None:  # loaded as an adapter
            return
        await self._load_folder(version, folder, weights.get("sha256"))

    async def _built_folder(self, version: str, llm: Mapping[str, Any], weights: Mapping[str, Any]) -> Path | None:
        """The folder of a version built from its tensors (a LoRA merged onto the base, a delta applied);
        None when it was loaded as an adapter instead."""
        found = await fetch_version(self.store, version, resource=llm)
        state = found.state
        if weights.get("format") == LORA_FORMAT and self.lora_loading != "merge" and self.base_loaded:
            try:
                await self._sync_adapter(version, state, weights.get("lora") or {})
                return None
            except LoraNotEnabled as e:
                if self.lora_loading == "dynamic":
                    raise SyncFailed(f"the server cannot load LoRA adapters ({e}): start it with --enable-lora "
                                     "--max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, or use "
                                     "--lora-loading merge") from None
                log.warning("%s cannot load LoRA adapters at run time (%s): merging each onto the base weights "
                            "instead (start it with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True to "
                            "load adapters without a reload)", self.url, e)
                self.lora_loading = "merge"
        if found.manifest is not None and found.manifest.format == DELTA:
            # onto the folder of its base when this server loaded it last, else rebuilt from the chain
            base = self.sync_dir / str(found.manifest.base_version)
            rebuilt = await asyncio.to_thread(apply_onto_folder, found, base, version)
            state = rebuilt if rebuilt is not None else (await fetch_full_version(self.store, version, resource=llm)).state
            weights = {**weights, "format": "full"}
        return await asyncio.to_thread(materialize, version, state, weights, self.model_dir, self.sync_dir)

    async def _load_ahead(self) -> bool:
        """The version the trainer holds for the weight group, newer than any announced: received while
        its folder is still written, served once it is announced. True when one was tried (if that
        failed, the announced version loads as usual)."""
        assert self.group is not None
        version = await self.group.ahead(self.announced, self.state.model_version)
        if version is None:
            return False
        self.group.tried_ahead = version
        started = time.perf_counter()
        if await self._by_group(version, None, ahead=True):
            self.syncs["ok"] += 1
            log.info("%s serves model version %s (received over the weight group while its folder was written; "
                     "loaded and verified in %.2f s)", self.url, version, time.perf_counter() - started)
        return True

    async def _by_group(self, version: str, sha: str | None, *, ahead: bool = False) -> bool:
        """Load ``version`` (or the trainer's newer one) over the weight group; False when it cannot be,
        with the server as it was or marked as not known (the folder path then loads it). A version
        not announced yet (``ahead``, or a newer one sent) is served once it is (`_announced`)."""
        assert self.group is not None
        group = self.group

        async def receive() -> tuple[str, str | None]:
            arrived = await group.receive(version)
            if ahead or arrived != version:
                return arrived, await self._announced(arrived)
            return arrived, sha

        try:
            await group.ready()  # before the pause: the server serves meanwhile
            await self._load(version, receive)
            return True
        except GroupUnavailable:
            return False
        except GroupNotEnabled as e:
            log.error("%s; loading from folders from now on", e)
            self.group = None
        except (AdminError, SyncFailed) as e:
            log.warning("%s: loading %s over the weight group failed (%s); loading it from a folder", self.url,
                        version, e)
        self.weights_known = False  # paused, or part of the weights received
        return False

    async def _announced(self, version: str) -> str | None:
        """Wait, paused with ``version`` received, until a resources entry names it: its sha256. The
        server never serves a version the trainer did not announce (its publish may yet fail)."""
        assert self.group is not None
        deadline = time.monotonic() + self.group.timeout_s
        looked_at: int | None = -1  # the resources version the log was read at last
        while True:
            latest = await self.store.resources.get_latest_resources()  # one small read per poll
            if (latest.version if latest is not None else None) != looked_at:
                looked_at = latest.version if latest is not None else None
                for update in await self.store.resources.query_resources(descending=True):
                    named = _named(update)
                    if named is not None and named[0] == version:
                        weights = named[1].get("weights")
                        return weights.get("sha256") if isinstance(weights, Mapping) else None
            if time.monotonic() > deadline:
                raise SyncFailed(f"{version} arrived over the weight group but the trainer did not announce it "
                                 f"within {self.group.timeout_s:.0f} s (weight_group_timeout_s): did its publish fail?")
            await asyncio.sleep(ANNOUNCED_POLL_S)

    async def _load_folder(self, version: str, folder: Path, sha: str | None) -> None:
        async def reload() -> tuple[str, str | None]:
            await self.admin.reload_weights(str(folder.resolve()))
            return version, sha

        await self._load(version, reload)

    async def _load(self, version: str, reload: Callable[[], Awaitable[tuple[str, str | None]]]) -> None:
        """The swap around ``reload`` (which returns the version it loaded, and its sha256 if known):
        canary, turn, pause, reload, set the version, reset the cache, resume, verify."""
        if not self.weights_known:  # a failed attempt may have left the server paused
            await self.admin.resume()
        # the canary of the weights verified last stands for the served ones (nothing else changes
        # them; a restarted server is loaded again): after a failed load the weights may be part (or
        # all) of the new version, and a load that did apply would look like one that did nothing
        if self.verified_canary is None:
            before = await self.admin.canary(self.model, self.canary_prompt)
            if self.weights_known:
                self.verified_canary = before
        else:
            before = self.verified_canary
        await self._after_grace()
        await self._my_turn(version)
        try:  # the turn is given back once this replica is ready again (or its load failed)
            await self._mark(ready=False, generation=self.state.generation + 1, reason=f"loading {version}")
            await self.admin.pause(self.pause_mode)
            version, sha = await reload()
            await self.admin.set_version(version)
            await self.admin.reset_prefix_cache()
            await self.admin.resume()
            served = await self.admin.served_version()
            if served != version:
                raise SyncFailed(f"the server reports {served!r} after the load")
            after = await self.admin.canary(self.model, self.canary_prompt)
            if after == before and (sha is None or sha != self.served_sha):  # unknown weights must change it
                raise SyncFailed("the canary's log-probabilities did not change: the weights were not applied")
            self.served_sha, self.verified_canary = sha, after
            self.weights_known = True
            self.base_loaded = False
            # an A/B test's B adapter applied onto the base weights, which are gone
            await self._mark(model_version=version, ready=True, reason="", served_model="", b_version="", b_split=0.0)
        finally:
            await self.store.registry.end_replica_load(self.url)

    async def _my_turn(self, version: str) -> None:
        """Wait until no other replica is loading: reloads are staggered, so with several replicas at
        least one serves at any time (with one, there is never a wait: calls wait for it instead)."""
        waited = False
        while not await self.store.registry.take_replica_load(self.url, self.turn_ttl_s):
            if not waited:
                log.info("another replica is loading a version: %s waits for its turn to load %s", self.url, version)
                waited = True
            await asyncio.sleep(TURN_POLL_S)

    async def follow_b(self, llm: Mapping[str, Any]) -> None:
        """An A/B test's B version (`fulmen.serving.ab`) beside the served one: loaded as an adapter of
        its name while the test lasts (a LoRA version, on a server that loads adapters onto its base
        weights), and unloaded after; the replica state names it, so proxies send B's calls there."""
        from fulmen.serving.ab import ab_of

        arm = ab_of(dict(llm))
        if arm is None:
            if self.state.b_version:
                await self._end_b()
            return
        version, weights, split = arm
        if version == self.state.b_version:
            if split != self.state.b_split:
                await self._mark(b_split=split)
            return
        if weights.get("format") != LORA_FORMAT or not self.base_loaded or self.lora_loading == "merge":
            if self.ab_refused != version:
                self.ab_refused = version
                log.warning("A/B test of %s on %s: vLLM serves B beside A only as a LoRA adapter on its base weights "
                            "(%s is a %s version): B is not served here, its calls get A and are recorded so; use "
                            "torch proxies for A/B of full versions", version, self.url, version,
                            weights.get("format", "full"))
            return
        failed = self.b_failed
        if failed is not None and failed[0] == version and time.monotonic() - failed[1] < self.retry_s:
            return
        try:
            await self._load_b(version, weights)
        except (AdminError, SyncFailed, RecordError, NotFound, OSError) as e:
            if failed is None or failed[0] != version:
                log.error("A/B test: loading %s on %s failed (%s); its calls get %s until a retry succeeds (every "
                          "%.0f s)", version, self.url, e, self.state.model_version, self.retry_s)
            self.b_failed = (version, time.monotonic())
            return
        self.b_failed = None
        await self._mark(b_version=version, b_split=split)
        log.info("A/B test on %s: %s for %.0f%% of rollouts (adapter %s), %s for the rest", self.url, version,
                 100 * split, version, self.state.model_version)

    async def _load_b(self, version: str, weights: Mapping[str, Any]) -> None:
        found = await fetch_version(self.store, version, resource={"weights": dict(weights)})
        folder = await asyncio.to_thread(materialize_adapter, version, found.state, weights.get("lora") or {},
                                         self.model_dir, self.sync_dir)
        if version not in self.adapters:
            await self._load_adapter(version, folder)
        if version not in await self.admin.models():
            raise SyncFailed(f"the server does not list the adapter {version} after loading it")

    async def _end_b(self) -> None:
        old = self.state.b_version
        await self._mark(b_version="", b_split=0.0)
        if old != self.state.served_model and old in self.adapters:
            with contextlib.suppress(AdminError):
                await self.admin.unload_lora(old)
            self.adapters.remove(old)
        log.info("%s: the A/B test is over; serving %s alone", self.url, self.state.model_version)

    async def _load_adapter(self, version: str, folder: Path) -> None:
        """Load the adapter ``version`` from ``folder``; one of that name the server holds already (an
        earlier vllm-sync's, maybe of another experiment: not known to be these weights) goes first."""
        if version in await self.admin.models():
            with contextlib.suppress(AdminError):
                await self.admin.unload_lora(version)
        await self.admin.load_lora(version, str(folder.resolve()))
        self.adapters.append(version)

    async def _sync_adapter(self, version: str, adapter: Mapping[str, Any], lora: Mapping[str, Any]) -> None:
        """Load a LoRA version as an adapter named ``version``; the replica serves it once verified."""
        folder = await asyncio.to_thread(materialize_adapter, version, adapter, lora, self.model_dir, self.sync_dir)
        if not self.weights_known:
            await self.admin.resume()
        base = await self.admin.canary(self.model, self.canary_prompt)
        if version in self.adapters:  # loaded before a failed verification: load it afresh
            with contextlib.suppress(AdminError):
                await self.admin.unload_lora(version)
            self.adapters.remove(version)
        await self._load_adapter(version, folder)
        if version not in await self.admin.models():
            raise SyncFailed(f"the server does not list the adapter {version} after loading it")
        zero = all(float(t.abs().max()) == 0 for n, t in adapter.items() if ".lora_B." in n) or not lora.get("scaling")
        if await self.admin.canary(version, self.canary_prompt) == base and not zero:
            raise SyncFailed(f"the adapter {version} does not change the canary: it was not applied")
        self.weights_known = True
        try:  # only for a person watching the server: the replica state is what proxies go by
            await self.admin.label_adapter(version)
        except AdminError as e:
            log.warning("%s: naming %s in /weight_info failed (%s); it serves it all the same", self.url, version, e)
        await self._mark(model_version=version, ready=True, reason="", served_model=version)
        for old in [a for a in self.adapters[:-ADAPTERS_KEPT] if a != self.state.b_version]:
            try:
                await self.admin.unload_lora(old)
            except AdminError as e:
                log.warning("%s: unloading the adapter %s failed (%s); it stays loaded", self.url, old, e)
                continue
            self.adapters.remove(old)


def _named(update: ResourcesUpdate) -> tuple[str, Mapping[str, Any]] | None:
    llm = llm_resource(update)
    version = (llm or {}).get("model_version")
    return (version, llm) if isinstance(version, str) and version and llm else None


async def _sleep_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
