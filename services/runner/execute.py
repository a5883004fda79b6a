"""One attempt, start to end: hooks, the agent under its timeout, heartbeats, the reward, the report.

Every span is stored before the status is reported; whatever the agent raises ends its attempt,
never the runner. The sequence and why: docs/design/runner.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from fulmen.errors import InvalidInput, RecordError
from fulmen.records import AttemptedRollout, AttemptStatus, RolloutStatus
from fulmen.sdk.agent import Agent
from fulmen.sdk.emit import emit_exception, emit_reward
from fulmen.sdk.hooks import Hook, run_hooks
from fulmen.store import RedisStore
from fulmen.telemetry import semconv
from fulmen.telemetry.tracing import RootSpan, bind
from fulmen_runner.agent_threads import AgentThreads
from fulmen_runner.heartbeats import Heartbeats
from fulmen_runner.inputs import InputResolver
from fulmen_runner.proxy_outage import (
    ProxyUnreachable,
    error_record,
    proxy_unreachable,
    unreachable_since,
    wait_for_proxy,
)
from fulmen_runner.span_writer import SpanWriter

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Outcome:
    status: AttemptStatus | None  # None: handed back or abandoned, nothing reported
    reward: float | None = None
    error: BaseException | None = None


@dataclass
class AttemptContext:
    store: RedisStore
    agent: Agent
    hooks: Sequence[Hook]
    resolver: InputResolver
    writer: SpanWriter
    heartbeats: Heartbeats
    worker_id: str
    threads: AgentThreads | None = None  # where sync agents run (None: asyncio's default executor)
    proxy_retry_s: float = 60.0  # how long a rollout waits for an unreachable proxy (`fulmen_runner.proxy_outage`)


class Abandoned(Exception):
    """The store says the attempt is over (rollout cancelled, attempt timed out elsewhere)."""


class AgentRaisedBaseException(Exception):
    """The agent raised what only the runner may (an interrupt, an exit, a cancellation of its own)."""

    def __init__(self, raised: BaseException) -> None:
        what = type(raised).__name__ + (f"({raised})" if str(raised) else "")
        super().__init__(
            f"the agent raised {what}; it ends this attempt only, not the runner — raise an Exception "
            "subclass to fail an attempt"
        )


def _cancelled_from_outside() -> bool:
    """True when this task was asked to stop (the runner's shutdown, the heartbeat loop, a timeout);
    False when the CancelledError came from the agent's own code."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _reward_of(result: Any) -> float | Mapping[str, float] | None:
    if result is None or isinstance(result, Mapping):
        return result
    if isinstance(result, int | float):  # bool included: True is a reward of 1.0
        return result
    raise InvalidInput(
        f"the agent returned a {type(result).__name__}; return a float reward, a dict of named "
        "rewards, or None after fulmen.emit_reward(...)"
    )


async def _run_agent(ctx: AttemptContext, claimed: AttemptedRollout) -> Any:
    """The agent under its timeout; cancelled by the heartbeat loop if the store abandons it."""
    timeout_s = claimed.rollout.config.timeout_seconds
    inputs = await ctx.resolver.resolve(claimed, wants_llm=ctx.agent.wants("llm"))
    try:
        async with asyncio.timeout(timeout_s):
            return await ctx.agent.call(inputs, ctx.threads.run if ctx.threads is not None else None)
    except TimeoutError:
        raise TimeoutError(f"the agent ran longer than timeout_seconds={timeout_s}") from None
    finally:
        if inputs.llm is not None:
            await inputs.llm.aclose()


async def execute(ctx: AttemptContext, claimed: AttemptedRollout) -> Outcome:
    rollout, attempt = claimed.rollout, claimed.attempt
    rid, aid = rollout.rollout_id, attempt.attempt_id
    started = time.monotonic()
    with bind(rid, aid):
        await run_hooks("on_rollout_start", ctx.agent, ctx.hooks, rollout)
        await run_hooks("on_trace_start", ctx.agent, ctx.hooks, rollout)
        status: AttemptStatus | None = AttemptStatus.SUCCEEDED
        error: BaseException | None = None
        root = RootSpan(
            semconv.ROLLOUT_SPAN,
            {
                semconv.SPAN_KIND: semconv.KIND_ROLLOUT,
                "fulmen.worker_id": ctx.worker_id,
                "fulmen.attempt_sequence": attempt.sequence_id,
            },
        )
        # The agent runs under handlers in this coroutine, the attempt task's own: an exception of a
        # thread's agent is thrown into the task's coroutine, and a GeneratorExit thrown so closes the
        # coroutines it awaits instead of entering them, so a handler there would never see it.
        try:
            with trace.use_span(root.span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                ctx.heartbeats.watch(claimed, asyncio.current_task())  # type: ignore[arg-type]
                try:
                    result = await _run_agent(ctx, claimed)
                    value = _reward_of(result)
                except TimeoutError as e:
                    status, error = AttemptStatus.TIMEOUT, e
                except asyncio.CancelledError as e:
                    if not _cancelled_from_outside():  # the agent's own: handing back would loop forever
                        status, error = AttemptStatus.FAILED, AgentRaisedBaseException(e)
                    else:
                        status, error = await _on_cancelled(ctx, root, rid, aid)
                except Exception as e:
                    status, error = AttemptStatus.FAILED, e
                except BaseException as e:  # KeyboardInterrupt, SystemExit, GeneratorExit of the agent's
                    status, error = AttemptStatus.FAILED, AgentRaisedBaseException(e)
                finally:
                    ctx.heartbeats.unwatch(aid)
                if error is not None and status is not None:
                    emit_exception(error)
                    root.set_error(str(error))
            root.end()
            if status is AttemptStatus.SUCCEEDED and value is not None:
                with trace.use_span(root.span, end_on_exit=False):
                    try:
                        emit_reward(value)
                    except Exception as e:  # a NaN, huge or malformed reward fails the attempt, clearly
                        status, error = AttemptStatus.FAILED, e
                        emit_exception(e)
        finally:
            root.end()
        await run_hooks("on_trace_end", ctx.agent, ctx.hooks, rollout)
        outcome = await _report(ctx, claimed, status, error, started)
        await run_hooks("on_rollout_end", ctx.agent, ctx.hooks, rollout, outcome.reward)
    return outcome


async def _report(
    ctx: AttemptContext, claimed: AttemptedRollout, status: AttemptStatus | None, error: BaseException | None,
    started: float,
) -> Outcome:
    """Store the attempt's last spans with its status and reward in one step; or, the proxy being
    unreachable, wait for it and run the rollout again (`_proxy_outage`); or, abandoned, store the
    spans alone."""
    rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    spans = await ctx.writer.drain(aid)
    final = ctx.writer.final_reward(aid)
    reward = final if status is AttemptStatus.SUCCEEDED else None
    unreachable = proxy_unreachable(error) if status is AttemptStatus.FAILED else None
    if unreachable is not None:
        await ctx.writer.write(spans)
        return await _proxy_outage(ctx, claimed, unreachable)
    if status is not None:
        try:  # the last spans, the status and the reward in one atomic step
            stored = await ctx.store.rollouts.update_attempt(
                rid, aid, status=status, error=error, spans=spans, reward=reward
            )
            ctx.writer.written += len(spans)  # stored with the status: they count as written (/metrics)
        except RecordError:  # a span the store refuses (too large): store the rest, then report
            await ctx.writer.write(spans)
            stored = await ctx.store.rollouts.update_attempt(rid, aid, status=status, error=error, reward=reward)
        log.debug("attempt %s %s -> %s in %.3f s", aid, status.value, stored, time.monotonic() - started)
    else:
        await ctx.writer.write(spans)
        log.info("attempt %s abandoned: %s", aid, error)
    return Outcome(status, reward, error)


async def _proxy_outage(ctx: AttemptContext, claimed: AttemptedRollout, unreachable: ProxyUnreachable) -> Outcome:
    """The proxy was unreachable: hold the attempt (heartbeating, so the store still sees it alive and
    a cancel still stops it) until the proxy answers, then hand it back, which runs the rollout again
    without counting against its max_attempts; past ``proxy_retry_s`` since the rollout first found
    the proxy unreachable, fail the rollout saying so. A runner that dies meanwhile leaves the attempt
    to the watchdog, as one that dies while its agent runs."""
    rid, aid = claimed.rollout.rollout_id, claimed.attempt.attempt_id
    since = await unreachable_since(ctx.store, claimed)
    deadline = since + ctx.proxy_retry_s
    log.warning("attempt %s: %s; waiting up to %.0f s more for it", aid, unreachable, max(0.0, deadline - time.time()))

    async def moved() -> bool:  # the registry would now give the rollout another proxy
        base = await ctx.resolver.registered_proxy(rid)
        return base is not None and base != unreachable.base_url

    ctx.heartbeats.watch(claimed, asyncio.current_task())  # type: ignore[arg-type]
    try:
        back = await wait_for_proxy(unreachable.base_url, deadline, moved)
    except asyncio.CancelledError:
        reason = ctx.heartbeats.abandoned_reason(aid)
        if reason is None:  # the runner is stopping: hand the attempt back, the outage's start with it
            await _hand_back(ctx, rid, aid, error_record(unreachable, since))
            raise
        asyncio.current_task().uncancel()  # type: ignore[union-attr]
        log.info("attempt %s abandoned while its proxy was unreachable: %s", aid, reason)
        return Outcome(None, None, Abandoned(reason))
    finally:
        ctx.heartbeats.unwatch(aid)
    if back:
        released = await ctx.store.rollouts.release_attempt(rid, aid, reason=error_record(unreachable, since))
        log.info("attempt %s: the proxy answers again; rollout %s", aid, "requeued" if released else "already over")
        return Outcome(None, None, unreachable)
    failed = ProxyUnreachable(
        f"{unreachable}; still unreachable after {time.time() - since:.1f} s (proxy_retry_s={ctx.proxy_retry_s:g})",
        unreachable.base_url,
    )
    await ctx.store.rollouts.update_rollout(
        rid, status=RolloutStatus.FAILED, reason=error_record(failed, since), only_attempt_id=aid
    )
    log.warning("rollout %s failed: %s", rid, failed)
    return Outcome(AttemptStatus.FAILED, None, failed)


async def _on_cancelled(
    ctx: AttemptContext, root: RootSpan, rollout_id: str, attempt_id: str
) -> tuple[AttemptStatus | None, BaseException]:
    """The attempt's task was cancelled: the store abandoned it (nothing to report), or the runner is
    shutting down (hand it back, and let the cancellation go on)."""
    reason = ctx.heartbeats.abandoned_reason(attempt_id)
    if reason is None:  # the runner is shutting down: hand the attempt back
        root.set_error("handed back")
        root.end()
        await _hand_back(ctx, rollout_id, attempt_id)
        raise asyncio.CancelledError
    current = asyncio.current_task()
    if current is not None:
        current.uncancel()
    return None, Abandoned(reason)


async def _hand_back(ctx: AttemptContext, rollout_id: str, attempt_id: str, reason: Any = None) -> None:
    """Store what the attempt traced so far and requeue its rollout for another runner (``reason``:
    the error the attempt ends with; None: this runner stopped)."""
    try:
        await asyncio.shield(ctx.writer.flush(attempt_id))
        released = await asyncio.shield(ctx.store.rollouts.release_attempt(
            rollout_id, attempt_id, reason=reason if reason is not None else f"runner {ctx.worker_id} stopped"
        ))
        log.info("attempt %s handed back (%s)", attempt_id, "requeued" if released else "already over")
    except Exception as e:
        log.error("could not hand back attempt %s (%s); the watchdog will recover it", attempt_id, e)
