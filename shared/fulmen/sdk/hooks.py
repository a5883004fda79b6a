"""Hooks: code that runs around every rollout, outside the agent (Agent Lightning's ``Hook``).

Hooks observe, they do not decide: an exception in one is logged, never fails the rollout. The order
and the rules: docs/design/sdk.md.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Sequence
from typing import Any

from fulmen.records import Rollout

log = logging.getLogger(__name__)
HOOK_NAMES = ("on_rollout_start", "on_trace_start", "on_trace_end", "on_rollout_end")


class Hook:
    """Subclass and override what you need; pass it with ``fulmen runner --hook module:Class``."""

    def on_rollout_start(self, agent: Any, rollout: Rollout) -> Any: ...
    def on_trace_start(self, agent: Any, rollout: Rollout) -> Any: ...
    def on_trace_end(self, agent: Any, rollout: Rollout) -> Any: ...
    def on_rollout_end(self, agent: Any, rollout: Rollout, result: Any) -> Any: ...


def _overrides(obj: Any, name: str, base: type) -> bool:
    method = getattr(type(obj), name, None)
    return method is not None and method is not getattr(base, name, None)


async def run_hooks(name: str, agent: Any, hooks: Sequence[Hook], rollout: Rollout, *extra: Any) -> None:
    """Call the agent's own hook method, then each hook's (only those that do something)."""
    from fulmen.sdk.agent import Agent

    calls = [getattr(agent, name)] if _overrides(agent, name, Agent) else []
    calls += [(lambda *a, h=h: getattr(h, name)(agent, *a)) for h in hooks if _overrides(h, name, Hook)]
    for call in calls:
        try:
            result = call(rollout, *extra)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling() > 0:
                raise  # the attempt's task was cancelled (shutdown, abandoned): not the hook's doing
            log.exception("hook %s raised CancelledError on rollout %s", name, rollout.rollout_id)
        except BaseException:  # an interrupt or exit a hook raises must not take the runner down
            log.exception("hook %s failed on rollout %s", name, rollout.rollout_id)
