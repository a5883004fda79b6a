"""The runner as a `Service`: `run(settings, stop)`, which `fulmen runner` and `fulmen dev` both call,
and its figures on /metrics. Kept light at import (`fulmen --help` loads it); the runner itself:
`fulmen_runner.runner`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from fulmen import keys as k
from fulmen.cli.service import Service, before_stop, opened_store, when_stopped
from fulmen.errors import FulmenError, InvalidInput
from fulmen.settings import RunnerSettings

log = logging.getLogger("fulmen.runner")


def load_agent(agent_spec: str | None, hook_specs: Sequence[str] = ()) -> tuple[Any, list[Any]]:
    """The agent and the hooks (each ``module:name``, a `fulmen.Hook` or its class), checked before
    anything connects: a wrong one raises InvalidInput."""
    from fulmen.sdk.agent import load_agent as load
    from fulmen.sdk.hooks import Hook

    if not agent_spec:
        raise InvalidInput("no agent: pass --agent module:function (or set FULMEN_AGENT)")
    try:
        agent = load(agent_spec)
        hooks = []
        for spec in hook_specs:
            module, _, name = spec.partition(":")
            hook = getattr(__import__(module, fromlist=[name]), name)
            hook = hook() if isinstance(hook, type) else hook
            if not isinstance(hook, Hook):
                raise InvalidInput(f"--hook {spec!r} is not a fulmen.Hook")
            hooks.append(hook)
    except (FulmenError, ImportError, AttributeError) as e:
        raise InvalidInput(str(e)) from None
    return agent, hooks


async def run(settings: RunnerSettings, stop: asyncio.Event, *, hooks: Sequence[str] = ()) -> None:
    """Claim rollouts and run the agent on them until ``stop`` is set, then hand back what is left
    after the grace; ``hooks``: `fulmen.Hook` specs (``module:name``)."""
    from fulmen.sdk.resources import close_async_pool
    from fulmen.telemetry.tracing import setup_tracing
    from fulmen_runner.runner import Runner

    # in a thread: an agent's imports (a framework, a model) take seconds, during which SIGTERM must
    # still stop the runner, which holds nothing yet
    agent, hook_objects = await before_stop(asyncio.to_thread(load_agent, settings.agent, hooks), stop,
                                            f"importing the agent {settings.agent}")
    provider, buffer = setup_tracing("fulmen-runner")
    try:
        async with opened_store(settings, stop) as store:
            runner = Runner(store, agent, buffer, settings, hooks=hook_objects)
            await _run_until_stopped(runner, settings, stop)
            await close_async_pool()
        log.info("runner %s stopped after %d rollout(s)", runner.worker_id, runner.finished)
    finally:
        provider.shutdown()  # export what OTLP still holds


async def _run_until_stopped(runner: Any, settings: RunnerSettings, stop: asyncio.Event) -> None:
    from fulmen.telemetry.http import start_ops
    from fulmen.telemetry.metrics import CountersCollector

    stopping = when_stopped(stop, runner.stop)
    try:
        with start_ops(settings, "runner", groups=[("queue", k.RUNNERS_GROUP)]) as ops:
            ops.add(CountersCollector(lambda: runner_counters(runner)))
            ops.add(AgentThreadGauges(runner))
            await runner.run()
    finally:
        stopping.cancel()


def runner_counters(runner: Any) -> list[Any]:
    """The runner's own counters for /metrics (claims, ends, spans)."""
    from fulmen.telemetry.metrics import CounterValue

    return [
        CounterValue("fulmen_runner_claims", "Rollouts claimed.", runner.claimed),
        CounterValue("fulmen_runner_attempts_ended", "Attempts ended, by outcome.", runner.finished, {"outcome": "ended"}),
        CounterValue("fulmen_runner_attempts_ended", "Attempts ended, by outcome.", runner.failed, {"outcome": "crashed"}),
        CounterValue("fulmen_runner_spans_written", "Agent spans stored.", runner.writer.written),
        CounterValue("fulmen_runner_spans_dropped", "Agent spans that could not be stored.", runner.writer.dropped),
        CounterValue(
            "fulmen_runner_agent_threads_abandoned",
            "Sync agent calls left running in their thread after their attempt ended.",
            runner.threads.abandoned,
        ),
    ]


class AgentThreadGauges:
    """The sync agents' pool on /metrics: its size, threads in an agent, and the hung ones among them."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner

    def collect(self) -> Any:
        from prometheus_client.core import GaugeMetricFamily

        threads = self.runner.threads
        yield GaugeMetricFamily("fulmen_runner_agent_threads", "Threads sync agents may use.", value=threads.size)
        yield GaugeMetricFamily(
            "fulmen_runner_agent_threads_busy", "Threads running a sync agent now.", value=threads.running
        )
        yield GaugeMetricFamily(
            "fulmen_runner_agent_threads_hung",
            "Threads still running a sync agent whose attempt is over (it ignored its timeout).",
            value=threads.hung,
        )


SERVICE = Service("runner", RunnerSettings, run)
