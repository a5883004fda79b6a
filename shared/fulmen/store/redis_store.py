"""The store: Agent Lightning 0.3's LightningStore semantics on Redis Streams, as an async API.

Lifecycle of a rollout (every arrow is one Lua script, so it is atomic):

    enqueue ─► queuing ─claim─► preparing ─first span/heartbeat─► running ─► succeeded
                  ▲                  │                                 │
                  └── requeuing ◄────┴── failed / timeout / unresponsive (retry allowed)
                                     └── otherwise: failed          any non-terminal ─► cancelled

Claiming is XREADGROUP on the queue; the claim script creates the attempt and acknowledges the queue
entry in one step, so an entry is pending only between delivery and claim. Entries delivered to a
consumer that died in that window are taken over with XAUTOCLAIM. A claimed attempt that stops
heartbeating is recovered by the watchdog (`fulmen.store.watchdog`), which requeues or fails it.

Hot path: while the queue has work, one script reads and claims (XREADGROUP inside Lua); only an
empty queue costs the blocking read. The hot scripts go through `AutoPipeline`, so the concurrent
calls of one process share round trips.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields as dataclass_fields
from typing import Any, Literal

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import ResponseError

from fulmen import keys as k
from fulmen.codec import DEFAULT_MAX_RECORD_BYTES, pack
from fulmen.errors import InvalidInput, InvalidTransition, NotFound, RecordError
from fulmen.records import (
    Attempt,
    AttemptedRollout,
    Completion,
    QueueEntry,
    Rollout,
    RolloutConfig,
    Span,
    Worker,
)
from fulmen.status import (
    TERMINAL_ROLLOUT,
    AttemptStatus,
    RolloutMode,
    RolloutStatus,
)
from fulmen.store import scripts
from fulmen.store.autopipeline import AutoPipeline
from fulmen.store.completions import CompletionsMixin
from fulmen.store.proxies import ProxiesMixin
from fulmen.store.resources import ResourcesMixin
from fulmen.store.samples import SamplesMixin
from fulmen.store.statistics import aread_snapshot

log = logging.getLogger(__name__)

FinishResult = Literal["running", "succeeded", "requeued", "failed", "already", "superseded", "ignored"]
"""What reporting an attempt's status did. ``already``: the attempt had ended before (a duplicate
report changes nothing); ``superseded``: a newer attempt drives the rollout, so the rollout is
untouched (the attempt changes only if still active); ``ignored``: the rollout had ended (cancelled)
before the report arrived."""


def _pairs(flat: list[Any]) -> dict[bytes, bytes]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


def _attempted(reply: list[Any]) -> AttemptedRollout:
    """A claim script's 'ok' item ({'ok', rollout fields, attempt fields}) as records."""
    return AttemptedRollout(Rollout.from_hash(_pairs(reply[1])), Attempt.from_hash(_pairs(reply[2])))


def _error_record(error: BaseException | Mapping[str, Any] | str | None) -> bytes | str:
    if error is None:
        return ""
    if isinstance(error, BaseException):
        error = {
            "type": type(error).__name__,
            "message": str(error),
            "traceback": "".join(traceback.format_exception(error))[-8000:],
        }
    elif isinstance(error, str):
        error = {"type": "Error", "message": error}
    return pack(dict(error))


class RedisStore(CompletionsMixin, ResourcesMixin, ProxiesMixin, SamplesMixin):
    """One experiment's store. Safe to share between coroutines; one per process is typical."""

    def __init__(
        self,
        redis: aioredis.Redis,
        experiment: str = "default",
        *,
        max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES,
        reclaim_idle_s: float = 10.0,
    ) -> None:
        self.redis = redis
        self.keys = k.Keys(experiment)
        self.experiment = experiment
        self.max_record_bytes = max_record_bytes
        # A queue entry is pending only between delivery and claim (milliseconds), so one idle
        # this long belongs to a consumer that died in between.
        self.reclaim_idle_ms = int(reclaim_idle_s * 1000)
        self._next_reclaim = 0.0
        self._reclaim_cursor: bytes | str = "0-0"
        self._ready = False
        self._claim_in_lua = True  # until the server shows its Lua cannot (see scripts.CLAIM_NEXT)
        self._completion_groups: set[str] = set()  # completions groups this store has ensured
        self._enqueue = redis.register_script(scripts.ENQUEUE)
        self._begin = redis.register_script(scripts.BEGIN_ATTEMPTS)
        self._start_rollout = redis.register_script(scripts.START_ROLLOUT)
        self._claim = redis.register_script(scripts.CLAIM_NEXT)
        self._add_spans = redis.register_script(scripts.ADD_SPANS)
        self._finish = redis.register_script(scripts.FINISH_ATTEMPT)
        self._finish_with_spans = redis.register_script(scripts.FINISH_WITH_SPANS)
        self._expire = redis.register_script(scripts.EXPIRE_ATTEMPT)
        self._set_rollout_status = redis.register_script(scripts.SET_ROLLOUT_STATUS)
        self._set_fields = redis.register_script(scripts.SET_FIELDS_IF_EXISTS)
        self._append_samples = redis.register_script(scripts.APPEND_SAMPLES)
        self._read_for_samples = redis.register_script(scripts.READ_FOR_SAMPLES)
        self._pipeline = AutoPipeline(redis)  # the hot-path scripts go through it

    def __repr__(self) -> str:
        return f"RedisStore(experiment={self.experiment!r})"

    async def _each(self, script: AsyncScript, arg_lists: list[list[Any]]) -> list[Any]:
        """Run ``script`` once per argument list, in one round trip with any other queued calls;
        raises the first error reply."""
        return list(await asyncio.gather(*[self._pipeline.submit(script, args) for args in arg_lists]))

    async def ensure(self) -> None:
        """Create the queue's consumer group and register the experiment (idempotent)."""
        if self._ready:
            return
        try:
            await self.redis.xgroup_create(self.keys.queue, k.RUNNERS_GROUP, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise
        await self.redis.sadd(k.EXPERIMENTS, self.experiment)
        self._ready = True

    async def aclose(self) -> None:
        await self.redis.aclose()

    # --- enqueue ----------------------------------------------------------------------------------

    def new_rollout(
        self,
        input: Any,
        *,
        rollout_id: str | None = None,
        mode: RolloutMode | str | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
    ) -> Rollout:
        """Validate a rollout request (does not store it)."""
        if isinstance(config, Mapping):
            config = RolloutConfig.from_dict(config)
        try:
            mode = RolloutMode(mode) if mode else None
        except ValueError:
            raise InvalidInput(f"mode {mode!r} unknown; use train, val or test") from None
        return Rollout(
            rollout_id=k.check_id("rollout_id", rollout_id) if rollout_id else f"ro-{uuid.uuid4().hex[:16]}",
            input=input,
            mode=mode,
            resources_id=k.check_id("resources_id", resources_id) if resources_id else None,
            config=config or RolloutConfig(),
            metadata=dict(metadata or {}),
        )

    async def enqueue_rollouts(self, rollouts: Sequence[Rollout]) -> list[bool]:
        """Queue many rollouts in one round trip. Returns, per rollout, False if its id existed
        (idempotent enqueue: the existing rollout is left exactly as it was)."""
        await self.ensure()
        if not rollouts:
            return []
        arg_lists = []
        for r in rollouts:
            fields = r.to_hash(self.max_record_bytes)
            flat = [x for kv in fields.items() for x in kv]
            queue_msg = QueueEntry(r.rollout_id).to_wire()
            arg_lists.append([self.keys.prefix, r.rollout_id, queue_msg, *flat])
        return [bool(x) for x in await self._each(self._enqueue, arg_lists)]

    async def enqueue_rollout(self, input: Any, **kwargs: Any) -> Rollout:
        """Queue one rollout and return it as stored (the original one if the id existed)."""
        rollout = self.new_rollout(input, **kwargs)
        await self.enqueue_rollouts([rollout])
        return await self.get_rollout(rollout.rollout_id)

    async def start_rollout(self, input: Any, worker_id: str, **kwargs: Any) -> AttemptedRollout:
        """Create a rollout and its first attempt at once, skipping the queue."""
        await self.ensure()
        rollout = self.new_rollout(input, **kwargs)
        fields = rollout.to_hash(self.max_record_bytes)
        flat = [x for kv in fields.items() for x in kv]
        result = await self._start_rollout(args=[self.keys.prefix, worker_id, rollout.rollout_id, *flat])
        if result[0] == b"exists":
            raise InvalidInput(f"rollout {rollout.rollout_id} already exists; use start_attempt to retry it")
        return _attempted(result)

    async def start_attempt(self, rollout_id: str, worker_id: str = "") -> AttemptedRollout:
        """Begin a new attempt of an existing rollout now (a manual retry); any active one ends."""
        result = await self._begin(args=[self.keys.prefix, worker_id, "", rollout_id])
        code = result[0][0].decode()
        if code == "missing":
            raise NotFound(f"rollout {rollout_id} does not exist in experiment {self.experiment}")
        if code == "terminal":
            raise InvalidTransition(f"rollout {rollout_id} has finished; it cannot start another attempt")
        return _attempted(result[0])

    # --- claim ------------------------------------------------------------------------------------

    async def dequeue_rollouts(
        self, worker_id: str, count: int = 1, block_s: float | None = None
    ) -> list[AttemptedRollout]:
        """Claim up to ``count`` queued rollouts for ``worker_id``, each with a new attempt.

        Blocks up to ``block_s`` seconds for work (None: return at once). Each rollout is claimed by
        exactly one worker; poison entries go to the dead-letter stream on the way.
        """
        await self.ensure()
        deadline = None if block_s is None else time.monotonic() + block_s
        while True:
            entries = await self._reclaim(worker_id, count)
            if not entries and self._claim_in_lua:
                # Read and claim in one round trip; only an empty queue goes on to the blocking read.
                read = await self._claim_next(worker_id, count)
                if read is not None:
                    claimed, n_read = read
                    if claimed:
                        return claimed
                    if n_read:
                        continue  # all it read was stale or poison: work may wait behind it
                    if deadline is None or time.monotonic() >= deadline:
                        return []
            if not entries:
                block_ms = None if deadline is None else max(1, int((deadline - time.monotonic()) * 1000))
                entries = await self._read_queue(worker_id, count, block_ms)
            claimed = await self._claim_entries(worker_id, entries)
            if claimed or not entries or (deadline is not None and time.monotonic() >= deadline):
                return claimed

    async def dequeue_rollout(self, worker_id: str, block_s: float | None = None) -> AttemptedRollout | None:
        claimed = await self.dequeue_rollouts(worker_id, 1, block_s)
        return claimed[0] if claimed else None

    async def _claim_next(self, worker_id: str, count: int) -> tuple[list[AttemptedRollout], int] | None:
        """Read and claim up to ``count`` new queue entries in one round trip (CLAIM_NEXT); entries
        it could not claim go through `_claim_entries`, which dead-letters them. Returns the claimed
        rollouts and how many entries were read, or None if the server cannot do it in one step."""
        try:
            reply = await self._pipeline.submit(self._claim, [self.keys.prefix, worker_id, count])
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._ready = False  # the experiment was deleted under us: recreate and go on
            await self.ensure()
            return None
        if reply == -1:
            self._claim_in_lua = False  # no cmsgpack in this server's Lua: read, then claim
            return None
        claimed = [_attempted(r) for r in reply[0]]
        if reply[1]:
            leftover = [(entry_id, _pairs(flat)) for entry_id, flat in reply[1]]
            claimed += await self._claim_entries(worker_id, leftover)
        return claimed, int(reply[2])

    async def _read_queue(self, worker_id: str, count: int, block_ms: int | None) -> list[Any]:
        try:
            reply = await self.redis.xreadgroup(
                k.RUNNERS_GROUP, worker_id, {self.keys.queue: ">"}, count=count, block=block_ms
            )
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self._ready = False  # the experiment was deleted under us: recreate and go on
            await self.ensure()
            return []
        return reply[0][1] if reply else []

    async def _reclaim(self, worker_id: str, count: int) -> list[Any]:
        now = time.monotonic()
        if now < self._next_reclaim:
            return []
        self._next_reclaim = now + self.reclaim_idle_ms / 2000
        reply = await self.redis.xautoclaim(
            self.keys.queue,
            k.RUNNERS_GROUP,
            worker_id,
            self.reclaim_idle_ms,
            self._reclaim_cursor,
            count=count,
        )
        # Follow the cursor, so entries that cannot be claimed (Redis 6.2 returns deleted ones as nil,
        # without their ids) never hide live ones behind them. Redis 7 adds deleted ids as reply[2].
        self._reclaim_cursor = reply[0]
        entries = reply[1]
        if entries:
            log.warning("reclaimed %d queue entries from dead consumers", len(entries))
        return [e for e in entries if e and e[1] is not None]

    async def _claim_entries(self, worker_id: str, entries: list[Any]) -> list[AttemptedRollout]:
        args: list[Any] = [self.keys.prefix, worker_id]
        raw_by_id: dict[str, dict[bytes, bytes]] = {}
        for entry_id, fields in entries:
            entry_id = entry_id.decode()
            try:
                rollout_id = QueueEntry.from_wire(fields.get(b"m")).rollout_id
            except RecordError as e:
                await self.dead_letter(self.keys.queue, entry_id, str(e), fields, ack_group=k.RUNNERS_GROUP)
                continue
            raw_by_id[entry_id] = fields
            args += [entry_id, rollout_id]
        if len(args) == 2:
            return []
        results = await self._begin(args=args)
        claimed = []
        for i, result in enumerate(results):
            entry_id, rollout_id = args[2 + 2 * i], args[3 + 2 * i]
            code = result[0].decode()
            if code == "ok":
                claimed.append(_attempted(result))
            elif code == "missing":
                reason = f"rollout {rollout_id} does not exist"
                await self.dead_letter(
                    self.keys.queue, entry_id, reason, raw_by_id[entry_id], ack_group=k.RUNNERS_GROUP
                )
        return claimed

    # --- spans and heartbeats ---------------------------------------------------------------------

    async def add_spans(self, spans: Sequence[Span]) -> list[Span]:
        """Store spans (one round trip per call). Each new span gets the next sequence id of its
        rollout; a span already stored (same attempt and span id) is ignored. Counts as a heartbeat.
        Returns the spans stored now, with their sequence ids. Spans of an unknown attempt raise
        NotFound; the other attempts' spans in the same call are stored all the same (retrying the
        call is safe: duplicates are ignored)."""
        by_attempt: dict[tuple[str, str], list[Span]] = {}
        for s in spans:
            by_attempt.setdefault((s.rollout_id, s.attempt_id), []).append(s)
        if not by_attempt:
            return []
        arg_lists = []
        for (rollout_id, attempt_id), group in by_attempt.items():
            args: list[Any] = [self.keys.prefix, rollout_id, attempt_id]
            for s in group:
                args += [f"{attempt_id}/{s.span_id}", s.to_wire(self.max_record_bytes)]
            arg_lists.append(args)
        stored = []
        for ((rollout_id, attempt_id), group), result in zip(
            by_attempt.items(), await self._each(self._add_spans, arg_lists), strict=True
        ):
            if result[0] == b"missing":
                raise NotFound(f"attempt {attempt_id} of rollout {rollout_id} does not exist")
            for s, seq in zip(group, result[2:], strict=True):
                if seq:
                    stored.append(_with_sequence(s, int(seq)))
        return stored

    async def add_span(self, span: Span) -> Span | None:
        """Store one span; None if it was a duplicate."""
        stored = await self.add_spans([span])
        return stored[0] if stored else None

    async def heartbeat(self, rollout_id: str, attempt_id: str) -> tuple[RolloutStatus, AttemptStatus]:
        """Tell the store the attempt is alive. Returns the rollout's and the attempt's status, so a
        worker learns at once that its rollout was cancelled or its attempt given up on."""
        result = await self._pipeline.submit(self._add_spans, [self.keys.prefix, rollout_id, attempt_id])
        if result[0] == b"missing":
            raise NotFound(f"attempt {attempt_id} of rollout {rollout_id} does not exist")
        return RolloutStatus(result[0].decode()), AttemptStatus(result[1].decode())

    # --- status updates ---------------------------------------------------------------------------

    async def update_attempt(
        self,
        rollout_id: str,
        attempt_id: str,
        *,
        status: AttemptStatus | str | None = None,
        worker_id: str | None = None,
        metadata: Mapping[str, Any] | None = None,
        error: BaseException | Mapping[str, Any] | str | None = None,
        spans: Sequence[Span] = (),
    ) -> FinishResult | None:
        """Change an attempt's worker or metadata, and/or report its status (running or an end).

        Reporting an end applies the rollout's retry policy: ``requeued`` or ``failed`` for a failure,
        ``succeeded`` for success. Returns the outcome of the status report (None without one).
        ``spans`` (with a status): the attempt's last spans, stored in the same atomic step."""
        if worker_id is not None or metadata is not None:
            fields: list[Any] = []
            if worker_id is not None:
                fields += ["worker_id", worker_id]
            if metadata is not None:
                fields += ["metadata", pack(dict(metadata), self.max_record_bytes)]
            if not await self._set_fields(keys=[self.keys.attempt(attempt_id)], args=fields):
                raise NotFound(f"attempt {attempt_id} does not exist")
        if status is None:
            return None
        try:
            status = AttemptStatus(status)
        except ValueError:
            raise InvalidInput(f"attempt status {status!r} unknown") from None
        if status is AttemptStatus.PREPARING:
            raise InvalidTransition("an attempt cannot go back to preparing")
        if spans:
            pairs: list[Any] = []
            for s in spans:
                if s.attempt_id != attempt_id or s.rollout_id != rollout_id:
                    raise InvalidInput(f"span {s.span_id} belongs to attempt {s.attempt_id}, not {attempt_id}")
                pairs += [f"{attempt_id}/{s.span_id}", s.to_wire(self.max_record_bytes)]
            return await self._report(rollout_id, attempt_id, status, error, self._finish_with_spans, pairs)
        return await self._report(rollout_id, attempt_id, status, error)

    async def expire_attempt(self, rollout_id: str, attempt_id: str, kind: AttemptStatus) -> str:
        """Watchdog step: end the attempt as ``timeout`` or ``unresponsive`` if the server clock says it
        is overdue. Safe to race: returns the `finish` code once, then ``already`` (or ``fresh``)."""
        return await self._report(rollout_id, attempt_id, kind, f"attempt {kind.value}", self._expire)

    async def _report(
        self, rollout_id: str, attempt_id: str, status: AttemptStatus, error: Any, script: Any = None,
        extra: Sequence[Any] = (),
    ) -> FinishResult:
        ending = RolloutStatus.SUCCEEDED if status is AttemptStatus.SUCCEEDED else RolloutStatus.FAILED
        args = [
            self.keys.prefix,
            rollout_id,
            attempt_id,
            status.value,
            _error_record(error),
            QueueEntry(rollout_id).to_wire(),
            Completion(rollout_id, ending, attempt_id).to_wire(),
            *extra,
        ]
        code = (await self._pipeline.submit(script or self._finish, args)).decode()
        if code == "missing" and script in (None, self._finish_with_spans):
            raise NotFound(f"attempt {attempt_id} of rollout {rollout_id} does not exist")
        return code  # type: ignore[return-value]

    async def update_rollout(
        self,
        rollout_id: str,
        *,
        status: RolloutStatus | str | None = None,
        metadata: Mapping[str, Any] | None = None,
        reason: str = "",
        only_attempt_id: str | None = None,
    ) -> RolloutStatus | None:
        """Change a rollout's metadata and/or force its status.

        ``status`` may be terminal (succeeded, failed, cancelled: any active attempt is marked failed
        with ``reason``) or requeuing (queue it again now). Returns the new status, or None when the
        rollout was already there (terminal, or already waiting). With ``only_attempt_id``, the change
        happens only while that attempt is the rollout's latest and still active."""
        if metadata is not None:
            packed = pack(dict(metadata), self.max_record_bytes)
            if not await self._set_fields(keys=[self.keys.rollout(rollout_id)], args=["metadata", packed]):
                raise NotFound(f"rollout {rollout_id} does not exist")
        if status is None:
            return None
        try:
            status = RolloutStatus(status)
        except ValueError:
            raise InvalidInput(f"rollout status {status!r} unknown") from None
        if status not in TERMINAL_ROLLOUT and status is not RolloutStatus.REQUEUING:
            raise InvalidTransition(f"a rollout can be set to a terminal status or requeuing, not {status}")
        args = [
            self.keys.prefix,
            rollout_id,
            status.value,
            _error_record(reason or f"rollout set to {status.value}"),
            QueueEntry(rollout_id).to_wire(),
            Completion(rollout_id, status, None).to_wire(),
            only_attempt_id or "",
        ]
        code = (await self._set_rollout_status(args=args)).decode()
        if code == "missing":
            raise NotFound(f"rollout {rollout_id} does not exist")
        return None if code == "already" else RolloutStatus(code)

    async def release_attempt(self, rollout_id: str, attempt_id: str, reason: str = "released") -> bool:
        """Hand an attempt back (a runner shutting down): it ends as failed with ``reason`` and the
        rollout is queued again at once for another runner, whatever its retry policy — the attempt
        did not fail on its merits. Returns False if the attempt had already ended or been replaced."""
        return (
            await self.update_rollout(
                rollout_id, status=RolloutStatus.REQUEUING, reason=reason, only_attempt_id=attempt_id
            )
            is not None
        )

    async def cancel_rollout(self, rollout_id: str, reason: str = "cancelled") -> bool:
        """Cancel a rollout that has not finished. Returns False if it had already finished."""
        return (
            await self.update_rollout(rollout_id, status=RolloutStatus.CANCELLED, reason=reason) is not None
        )

    # --- reads --------------------------------------------------------------------------------------

    async def get_rollout(self, rollout_id: str) -> Rollout:
        raw = await self.redis.hgetall(self.keys.rollout(rollout_id))
        if not raw:
            raise NotFound(f"rollout {rollout_id} does not exist in experiment {self.experiment}")
        return Rollout.from_hash(raw)

    async def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout | None]:
        pipe = self.redis.pipeline(transaction=False)
        for rid in rollout_ids:
            pipe.hgetall(self.keys.rollout(rid))
        return [Rollout.from_hash(raw) if raw else None for raw in await pipe.execute()]

    async def get_attempt(self, attempt_id: str) -> Attempt:
        raw = await self.redis.hgetall(self.keys.attempt(attempt_id))
        if not raw:
            raise NotFound(f"attempt {attempt_id} does not exist in experiment {self.experiment}")
        return Attempt.from_hash(raw)

    async def get_latest_attempt(self, rollout_id: str) -> Attempt | None:
        rollout = await self.get_rollout(rollout_id)
        return await self.get_attempt(rollout.attempt_id) if rollout.attempt_id else None

    async def query_attempts(
        self,
        rollout_id: str,
        *,
        status: AttemptStatus | str | Iterable[AttemptStatus | str] | None = None,
        worker_id: str | None = None,
        descending: bool = False,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[Attempt]:
        """A rollout's attempts in sequence order (oldest first), filtered and paginated."""
        rollout = await self.get_rollout(rollout_id)
        pipe = self.redis.pipeline(transaction=False)
        for n in range(1, rollout.attempt_count + 1):
            pipe.hgetall(self.keys.attempt(k.attempt_id(rollout_id, n)))
        attempts = [Attempt.from_hash(raw) for raw in await pipe.execute() if raw]
        if status is not None:
            wanted = {AttemptStatus(x) for x in ([status] if isinstance(status, str) else status)}
            attempts = [a for a in attempts if a.status in wanted]
        if worker_id is not None:
            attempts = [a for a in attempts if a.worker_id == worker_id]
        if descending:
            attempts.reverse()
        return attempts[offset : None if limit is None else offset + limit]

    async def query_rollouts(
        self,
        *,
        status: RolloutStatus | str | Iterable[RolloutStatus | str] | None = None,
        mode: RolloutMode | str | None = None,
        rollout_ids: Iterable[str] | None = None,
        sort_by: Literal["enqueue_time", "rollout_id", "status", "end_time"] = "enqueue_time",
        descending: bool = False,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[Rollout]:
        """Rollouts filtered by status, mode or id, sorted and paginated."""
        if rollout_ids is not None:
            ids = list(dict.fromkeys(rollout_ids))
        elif status is not None:
            statuses = [status] if isinstance(status, str) else list(status)
            ids = [
                x.decode()
                for x in await self.redis.sunion([self.keys.status(RolloutStatus(s)) for s in statuses])
            ]
        else:
            ids = [x.decode() for x in await self.redis.zrange(self.keys.rollout_index, 0, -1)]
        rollouts = [r for r in await self.get_rollouts(ids) if r is not None]
        if mode is not None:
            rollouts = [r for r in rollouts if r.mode == RolloutMode(mode)]
        if status is not None and rollout_ids is not None:
            wanted = (
                {RolloutStatus(status)} if isinstance(status, str) else {RolloutStatus(s) for s in status}
            )
            rollouts = [r for r in rollouts if r.status in wanted]

        def key(r: Rollout) -> Any:
            value = getattr(r, sort_by)
            return (value is None, value if value is not None else 0)

        rollouts.sort(key=key, reverse=descending)
        end = None if limit is None else offset + limit
        return rollouts[offset:end]

    async def query_spans(
        self,
        rollout_id: str,
        attempt_id: str | None = None,
        *,
        name: str | None = None,
        after_sequence_id: int = 0,
        limit: int | None = None,
    ) -> list[Span]:
        """A rollout's spans in sequence order, optionally of one attempt (``"latest"``: the latest)
        or one span name; paginate with ``after_sequence_id`` (the last one seen) and ``limit``."""
        if attempt_id == "latest":
            attempt_id = (await self.get_rollout(rollout_id)).attempt_id
        entries = await self.redis.xrange(
            self.keys.spans(rollout_id),
            min=f"({after_sequence_id}-0" if after_sequence_id else "-",
            count=None,
        )
        spans = []
        for entry_id, fields in entries:
            span = Span.from_wire(fields[b"m"], int(entry_id.split(b"-")[0]), self.max_record_bytes)
            if (attempt_id is None or span.attempt_id == attempt_id) and (name is None or span.name == name):
                spans.append(span)
                if limit is not None and len(spans) >= limit:
                    break
        return spans

    # --- workers ------------------------------------------------------------------------------------

    async def update_worker(
        self, worker_id: str, status: str = "idle", metadata: Mapping[str, Any] | None = None
    ) -> Worker:
        """Record a worker's status; doubles as its heartbeat."""
        worker = Worker(worker_id, status, time.time(), dict(metadata or {}))
        await self.redis.hset(self.keys.workers, worker_id, worker.to_wire())
        return worker

    async def query_workers(
        self,
        status: str | None = None,
        *,
        sort_by: Literal["worker_id", "last_heartbeat_time"] = "worker_id",
        descending: bool = False,
        limit: int | None = None,
        offset: int = 0,
    ) -> list[Worker]:
        """Workers as they last reported themselves, filtered by status, sorted and paginated."""
        raw = await self.redis.hgetall(self.keys.workers)
        workers = [
            w for w in (Worker.from_wire(v) for v in raw.values()) if status is None or w.status == status
        ]
        workers.sort(key=lambda w: (getattr(w, sort_by) or 0, w.worker_id), reverse=descending)
        return workers[offset : None if limit is None else offset + limit]

    # --- statistics ---------------------------------------------------------------------------------

    async def statistics(self) -> dict[str, Any]:
        """One snapshot of the experiment: rollouts per status, queue depth, pending, dead letters
        (`fulmen.store.statistics`, which the metrics and `fulmen top` read too)."""
        await self.ensure()
        snap = await aread_snapshot(
            self.redis, self.keys, lambda pipe: pipe.xinfo_consumers(self.keys.queue, k.RUNNERS_GROUP)
        )
        consumers = snap.extra[0] if not isinstance(snap.extra[0], Exception) else []
        latest = snap.latest_resources
        return {
            "experiment": self.experiment,
            "rollouts": snap.rollouts,
            "total_rollouts": sum(snap.rollouts.values()),
            "queue_depth": snap.queue_depth,
            "active_attempts": snap.active_attempts,
            "pending": {
                c["name"].decode() if isinstance(c["name"], bytes) else c["name"]: int(c["pending"])
                for c in consumers
            },
            "heartbeat_watched": snap.heartbeat_watched,
            "dead_letters": snap.stream_lengths["dead_letters"],
            "completions": snap.stream_lengths["completions"],
            "latest_resources": None
            if latest is None
            else {"resources_id": latest.resources_id, "version": latest.version},
            "workers": snap.workers,
        }


# Every Span field but sequence_id, in order: building a Span positionally is ~4x cheaper than
# dataclasses.replace, which add_spans otherwise calls for every stored span.
_SPAN_FIELDS = tuple(f.name for f in dataclass_fields(Span) if f.name != "sequence_id")


def _with_sequence(span: Span, sequence_id: int) -> Span:
    return Span(*[getattr(span, name) for name in _SPAN_FIELDS], sequence_id=sequence_id)
