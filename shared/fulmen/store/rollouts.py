"""Rollouts and attempts: creating them, reporting their status, reading them back.

Every status change is one Lua script (`fulmen.store.lua.scripts`), so it is atomic; the statuses and
where each may go next are the table in `fulmen.records.status`. Claiming from the queue is
`fulmen.store.queue`.
"""

from __future__ import annotations

import traceback
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

from fulmen import keys as k
from fulmen.codec import pack
from fulmen.errors import InvalidInput, InvalidTransition, NotFound
from fulmen.records import (
    Attempt,
    AttemptedRollout,
    AttemptStatus,
    Priority,
    QueueEntry,
    Rollout,
    RolloutConfig,
    RolloutFinished,
    RolloutMode,
    RolloutStatus,
    Span,
)
from fulmen.records.status import TERMINAL_ROLLOUT
from fulmen.store.context import StoreContext
from fulmen.store.lua import scripts
from fulmen.store.lua import spans as span_scripts
from fulmen.store.spans import SpanBatch

FinishResult = Literal["running", "succeeded", "requeued", "failed", "already", "superseded", "ignored"]
"""What reporting an attempt's status did. ``already``: the attempt had ended before (a duplicate
report changes nothing); ``superseded``: a newer attempt drives the rollout, so the rollout is
untouched (the attempt changes only if still active); ``ignored``: the rollout had ended (cancelled)
before the report arrived."""

ENQUEUE_CHUNK = 100  # rollouts per enqueue script call
TRACEBACK_CHARS = 8000  # of an error's traceback kept with the attempt: its end, where it was raised


def pairs(flat: list[Any]) -> dict[bytes, bytes]:
    return {flat[i]: flat[i + 1] for i in range(0, len(flat), 2)}


def attempted(reply: list[Any]) -> AttemptedRollout:
    """A claim script's 'ok' item ({'ok', rollout fields, attempt fields}) as records."""
    return AttemptedRollout(Rollout.from_hash(pairs(reply[1])), Attempt.from_hash(pairs(reply[2])))


def _error_record(error: BaseException | Mapping[str, Any] | str | None) -> bytes | str:
    if error is None:
        return ""
    if isinstance(error, BaseException):
        error = {
            "type": type(error).__name__,
            "message": str(error),
            "traceback": "".join(traceback.format_exception(error))[-TRACEBACK_CHARS:],
        }
    elif isinstance(error, str):
        error = {"type": "Error", "message": error}
    return pack(dict(error))


# Left out of the hash a rollout is created with: the fields the create script writes itself, and
# these when empty, which every reader takes as absent (`Rollout.from_hash`'s defaults, HMGET's nil
# in the browse and sample reads). A small hash is a ziplist, where each field set is a linear search
# and a realloc: the enqueue's HSET was most of its server CPU.
_SET_BY_SCRIPT = frozenset({"status", "enqueue_time", "attempt_n"})
_ABSENT_WHEN_EMPTY = frozenset({"mode", "resources_id", "end_time", "reward"})


def _flat(rollout: Rollout, max_bytes: int) -> list[Any]:
    return [
        x for kv in rollout.to_hash(max_bytes).items()
        if kv[0] not in _SET_BY_SCRIPT and (kv[1] != "" or kv[0] not in _ABSENT_WHEN_EMPTY) for x in kv
    ]


class Rollouts:
    """Part of the store: the rollout and attempt lifecycle, and reading rollouts and attempts."""

    def __init__(self, ctx: StoreContext, ensure_queue: Callable[[], Awaitable[None]]) -> None:
        """``ensure_queue``: creates the queue's consumer group (and registers the experiment),
        before the first rollout is queued, so the group sees every entry."""
        self.ctx = ctx
        self._ensure_queue = ensure_queue
        self._enqueue = ctx.script(scripts.ENQUEUE)
        self._begin = ctx.script(scripts.BEGIN_ATTEMPTS)
        self._start_rollout = ctx.script(scripts.START_ROLLOUT)
        self._finish = ctx.joinable_script(scripts.FINISH_ATTEMPT, scripts.FINISH_ATTEMPTS)
        self._finish_with_spans = ctx.joinable_script(span_scripts.FINISH_WITH_SPANS, span_scripts.FINISHES_WITH_SPANS)
        self._expire = ctx.script(scripts.EXPIRE_ATTEMPT)
        self._set_rollout_status = ctx.script(scripts.SET_ROLLOUT_STATUS)
        self._set_fields = ctx.script(scripts.SET_FIELDS_IF_EXISTS)

    # --- create -----------------------------------------------------------------------------------

    def new_rollout(
        self,
        input: Any,
        *,
        rollout_id: str | None = None,
        mode: RolloutMode | str | None = None,
        resources_id: str | None = None,
        config: RolloutConfig | Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        priority: Priority | str | None = None,
    ) -> Rollout:
        """Validate a rollout request (does not store it). ``priority``: its queue lane (urgent,
        normal, low; None: urgent for a validation rollout, mode val, else normal)."""
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
            priority=Priority.parse(priority) if priority is not None
            else Priority.URGENT if mode is RolloutMode.VAL else Priority.NORMAL,
        )

    async def enqueue_rollouts(self, rollouts: Sequence[Rollout]) -> list[bool]:
        """Queue many rollouts in one round trip. Returns, per rollout, False if its id existed
        (idempotent enqueue: the existing rollout is left exactly as it was)."""
        ctx = self.ctx
        await self._ensure_queue()
        if not rollouts:
            return []
        # One script call per shard and chunk, not per rollout: the call's fixed cost on the server
        # (and the clock read) is paid once for many rollouts. Chunks keep each call short, so the
        # server never stalls long on one enqueue.
        by_shard: dict[str, list[int]] = {}
        for i, r in enumerate(rollouts):
            by_shard.setdefault(ctx.keys.shard(r.rollout_id).prefix, []).append(i)
        calls: list[tuple[list[int], list[Any]]] = []
        for prefix, indexes in by_shard.items():
            for first in range(0, len(indexes), ENQUEUE_CHUNK):
                chunk = indexes[first : first + ENQUEUE_CHUNK]
                args: list[Any] = [prefix]
                for i in chunk:
                    r = rollouts[i]
                    flat = _flat(r, ctx.max_record_bytes)
                    args += [r.rollout_id, QueueEntry(r.rollout_id).to_wire(), len(flat), *flat]
                calls.append((chunk, args))
        created = [False] * len(rollouts)
        for (chunk, _), reply in zip(calls, await ctx.each(self._enqueue, [args for _, args in calls]), strict=True):
            for i, x in zip(chunk, reply, strict=True):
                created[i] = bool(x)
        return created

    async def enqueue_rollout(self, input: Any, **kwargs: Any) -> Rollout:
        """Queue one rollout and return it as stored (the original one if the id existed)."""
        rollout = self.new_rollout(input, **kwargs)
        await self.enqueue_rollouts([rollout])
        return await self.get_rollout(rollout.rollout_id)

    async def start_rollout(self, input: Any, worker_id: str, **kwargs: Any) -> AttemptedRollout:
        """Create a rollout and its first attempt at once, skipping the queue."""
        await self._ensure_queue()
        rollout = self.new_rollout(input, **kwargs)
        flat = _flat(rollout, self.ctx.max_record_bytes)
        prefix = self.ctx.keys.shard(rollout.rollout_id).prefix
        result = await self._start_rollout(keys=[prefix], args=[worker_id, rollout.rollout_id, *flat])
        if result[0] == b"exists":
            raise InvalidInput(f"rollout {rollout.rollout_id} already exists; use start_attempt to retry it")
        return attempted(result)

    async def start_attempt(self, rollout_id: str, worker_id: str = "") -> AttemptedRollout:
        """Begin a new attempt of an existing rollout now (a manual retry); any active one ends."""
        result = await self._begin(keys=[self.ctx.keys.shard(rollout_id).prefix], args=[worker_id, "", "", rollout_id])
        code = result[0][0].decode()
        if code == "missing":
            raise NotFound(f"rollout {rollout_id} does not exist in experiment {self.ctx.experiment}")
        if code == "terminal":
            raise InvalidTransition(f"rollout {rollout_id} has finished; it cannot start another attempt")
        return attempted(result[0])

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
        reward: float | None = None,
    ) -> FinishResult | None:
        """Change an attempt's worker or metadata, and/or report its status (running or an end).

        Reporting an end applies the rollout's retry policy: ``requeued`` or ``failed`` for a failure,
        ``succeeded`` for success. Returns the outcome of the status report (None without one).
        ``spans`` (with a status): the attempt's last spans, stored in the same atomic step.
        ``reward`` (with an end): the attempt's final reward, stored with the attempt and, if the
        attempt ends the rollout, with the rollout, so nobody downstream derives it again."""
        if worker_id is not None or metadata is not None:
            fields: list[Any] = []
            if worker_id is not None:
                fields += ["worker_id", worker_id]
            if metadata is not None:
                fields += ["metadata", pack(dict(metadata), self.ctx.max_record_bytes)]
            if not await self._set_fields(keys=[self.ctx.keys.attempt(attempt_id)], args=fields):
                raise NotFound(f"attempt {attempt_id} does not exist")
        if status is None:
            return None
        try:
            status = AttemptStatus(status)
        except ValueError:
            raise InvalidInput(f"attempt status {status!r} unknown") from None
        if status is AttemptStatus.PREPARING:
            raise InvalidTransition("an attempt cannot go back to preparing")
        reward_arg = "" if reward is None else repr(float(reward))
        if spans:
            for s in spans:
                if s.attempt_id != attempt_id or s.rollout_id != rollout_id:
                    raise InvalidInput(f"span {s.span_id} belongs to attempt {s.attempt_id}, not {attempt_id}")
            return await self._report_with_spans(
                rollout_id, attempt_id, status, error, reward_arg, SpanBatch(spans, self.ctx.max_record_bytes)
            )
        return await self._report(rollout_id, attempt_id, status, error, self._finish, [reward_arg])

    async def expire_attempt(self, rollout_id: str, attempt_id: str, kind: AttemptStatus) -> str:
        """Watchdog step: end the attempt as ``timeout`` or ``unresponsive`` if the server clock says it
        is overdue. Safe to race: returns the `finish` code once, then ``already`` (or ``fresh``)."""
        return await self._report(rollout_id, attempt_id, kind, f"attempt {kind.value}", self._expire)

    async def _report(
        self, rollout_id: str, attempt_id: str, status: AttemptStatus, error: Any, script: Any,
        extra: Sequence[Any] = (),
    ) -> FinishResult:
        reply = await self._report_reply(rollout_id, attempt_id, status, error, script, extra)
        code = reply.decode()
        if code == "missing" and script is not self._expire:
            raise NotFound(f"attempt {attempt_id} of rollout {rollout_id} does not exist")
        return code  # type: ignore[return-value]

    async def _report_with_spans(
        self, rollout_id: str, attempt_id: str, status: AttemptStatus, error: Any, reward_arg: str, batch: SpanBatch,
    ) -> FinishResult:
        """FINISH_WITH_SPANS, sent again without the spans it reports as stored already (which
        leaves it undone), until it is done; with none left, a plain finish."""
        while batch.spans:
            reply = await self._report_reply(
                rollout_id, attempt_id, status, error, self._finish_with_spans, [reward_arg, *batch.args()]
            )
            if not isinstance(reply, list):  # a finish code; else ['dup', positions...]
                if reply == b"missing":
                    raise NotFound(f"attempt {attempt_id} of rollout {rollout_id} does not exist")
                return reply.decode()  # type: ignore[return-value]
            batch = batch.without(reply[1:])
        return await self._report(rollout_id, attempt_id, status, error, self._finish, [reward_arg])

    async def _report_reply(
        self, rollout_id: str, attempt_id: str, status: AttemptStatus, error: Any, script: Any, extra: Sequence[Any],
    ) -> Any:
        ending = RolloutStatus.SUCCEEDED if status is AttemptStatus.SUCCEEDED else RolloutStatus.FAILED
        args = [
            self.ctx.keys.shard(rollout_id).prefix,
            rollout_id,
            attempt_id,
            status.value,
            _error_record(error),
            QueueEntry(rollout_id).to_wire(),
            RolloutFinished(rollout_id, ending, attempt_id).to_wire(),
            *extra,
        ]
        return await self.ctx.pipeline.submit(script, args)

    async def update_rollout(
        self,
        rollout_id: str,
        *,
        status: RolloutStatus | str | None = None,
        metadata: Mapping[str, Any] | None = None,
        reason: BaseException | Mapping[str, Any] | str = "",
        only_attempt_id: str | None = None,
    ) -> RolloutStatus | None:
        """Change a rollout's metadata and/or force its status.

        ``status`` may be terminal (succeeded, failed, cancelled: any active attempt is marked failed
        with ``reason``) or requeuing (queue it again now). Returns the new status, or None when the
        rollout was already there (terminal, or already waiting). With ``only_attempt_id``, the change
        happens only while that attempt is the rollout's latest and still active."""
        if metadata is not None:
            packed = pack(dict(metadata), self.ctx.max_record_bytes)
            if not await self._set_fields(keys=[self.ctx.keys.rollout(rollout_id)], args=["metadata", packed]):
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
            self.ctx.keys.shard(rollout_id).prefix,
            rollout_id,
            status.value,
            _error_record(reason or f"rollout set to {status.value}"),
            QueueEntry(rollout_id).to_wire(),
            RolloutFinished(rollout_id, status, None).to_wire(),
            only_attempt_id or "",
        ]
        code = (await self._set_rollout_status(keys=args[:1], args=args[1:])).decode()
        if code == "missing":
            raise NotFound(f"rollout {rollout_id} does not exist")
        return None if code == "already" else RolloutStatus(code)

    async def release_attempt(
        self, rollout_id: str, attempt_id: str, reason: BaseException | Mapping[str, Any] | str = "released"
    ) -> bool:
        """Hand an attempt back (a runner shutting down, an LLM proxy unreachable): it ends as failed
        with ``reason`` and the rollout is queued again at once for another runner, whatever its retry
        policy — the attempt did not fail on its merits, so it does not count against the rollout's
        max_attempts either. Returns False if the attempt had already ended or been replaced."""
        status = await self.update_rollout(
            rollout_id, status=RolloutStatus.REQUEUING, reason=reason, only_attempt_id=attempt_id
        )
        return status is not None

    async def cancel_rollout(self, rollout_id: str, reason: str = "cancelled") -> bool:
        """Cancel a rollout that has not finished. Returns False if it had already finished."""
        return await self.update_rollout(rollout_id, status=RolloutStatus.CANCELLED, reason=reason) is not None

    # --- reads ------------------------------------------------------------------------------------

    async def get_rollout(self, rollout_id: str) -> Rollout:
        raw = await self.ctx.redis.hgetall(self.ctx.keys.rollout(rollout_id))
        if not raw:
            raise NotFound(f"rollout {rollout_id} does not exist in experiment {self.ctx.experiment}")
        return Rollout.from_hash(raw)

    async def get_rollouts(self, rollout_ids: Sequence[str]) -> list[Rollout | None]:
        pipe = self.ctx.redis.pipeline(transaction=False)
        for rid in rollout_ids:
            pipe.hgetall(self.ctx.keys.rollout(rid))
        return [Rollout.from_hash(raw) if raw else None for raw in await pipe.execute()]

    async def get_attempt(self, attempt_id: str) -> Attempt:
        raw = await self.ctx.redis.hgetall(self.ctx.keys.attempt(attempt_id))
        if not raw:
            raise NotFound(f"attempt {attempt_id} does not exist in experiment {self.ctx.experiment}")
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
        pipe = self.ctx.redis.pipeline(transaction=False)
        for n in range(1, rollout.attempt_count + 1):
            pipe.hgetall(self.ctx.keys.attempt(k.attempt_id(rollout_id, n)))
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
        redis, keys = self.ctx.redis, self.ctx.keys
        if rollout_ids is not None:
            ids = list(dict.fromkeys(rollout_ids))
        elif status is not None:
            statuses = [status] if isinstance(status, str) else list(status)
            ids = []
            for shard in keys.shards:  # one SUNION per shard: a shard's sets share its slot
                ids += [x.decode() for x in await redis.sunion([shard.status(RolloutStatus(s)) for s in statuses])]
        else:
            ids = []
            for shard in keys.shards:
                ids += [x.decode() for x in await redis.zrange(shard.rollout_index, 0, -1)]
        rollouts = [r for r in await self.get_rollouts(ids) if r is not None]
        if mode is not None:
            rollouts = [r for r in rollouts if r.mode == RolloutMode(mode)]
        if status is not None and rollout_ids is not None:
            wanted = (
                {RolloutStatus(status)} if isinstance(status, str) else {RolloutStatus(s) for s in status}
            )
            rollouts = [r for r in rollouts if r.status in wanted]

        def key(r: Rollout) -> Any:
            # ties broken on the id: a total order, so that pages (offset, limit) neither repeat nor skip
            value = getattr(r, sort_by)
            return (value is None, value if value is not None else 0, r.rollout_id)

        rollouts.sort(key=key, reverse=descending)
        end = None if limit is None else offset + limit
        return rollouts[offset:end]
