"""Agents: a decorated function (``@fulmen.rollout``) or a class with ``rollout()`` / ``rollout_async()``.

Parameters are matched by name (the task first, then ``llm``, ``prompt_template``, ``rollout``,
``resources``); anything else is refused at load. More: docs/design/sdk.md.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from fulmen.errors import InvalidInput
from fulmen.records import Rollout

PARAMETERS = ("llm", "prompt_template", "rollout", "resources")


@dataclass(frozen=True)
class AgentInputs:
    """Everything an agent may ask for; `Agent.call` passes the subset its signature names."""

    task: Any
    llm: Any
    prompt_template: Any
    rollout: Rollout
    resources: Mapping[str, Any]


class Agent:
    """Subclass and implement ``rollout(self, task, llm, rollout)`` (sync, run in a worker thread) or
    ``async rollout_async(...)``; return a float reward, or None after `fulmen.emit_reward`.

    The hook methods run around every rollout (sync or async); override the ones you need."""

    def rollout(self, task: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    async def rollout_async(self, task: Any, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def on_rollout_start(self, rollout: Rollout) -> Any: ...
    def on_trace_start(self, rollout: Rollout) -> Any: ...
    def on_trace_end(self, rollout: Rollout) -> Any: ...
    def on_rollout_end(self, rollout: Rollout, result: Any) -> Any: ...

    # --- resolved once, when the agent is loaded --------------------------------------------------

    _entry: Callable[..., Any] | None = None
    _is_async: bool = False
    _wanted: tuple[str, ...] = ()

    def _prepare(self) -> None:
        overrides_async = type(self).rollout_async is not Agent.rollout_async
        overrides_sync = type(self).rollout is not Agent.rollout
        if not overrides_async and not overrides_sync:
            raise InvalidInput(f"agent {type(self).__qualname__} implements neither rollout() nor rollout_async()")
        entry = self.rollout_async if overrides_async else self.rollout
        self._entry, self._is_async = entry, overrides_async
        self._wanted = wanted_parameters(entry, type(self).__qualname__)

    def wants(self, name: str) -> bool:
        if self._entry is None:
            self._prepare()
        return name in self._wanted

    async def call(self, inputs: AgentInputs, run_sync: Callable[..., Awaitable[Any]] | None = None) -> Any:
        """Run one rollout: async agents on the event loop, sync agents in a worker thread (which
        inherits the context, so their spans stay bound to the attempt). ``run_sync(fn, *args,
        **kwargs)`` runs a sync agent: the runner gives its own bounded pool (`AgentThreads`), so a
        hung agent never holds a thread of asyncio's default executor; unset, ``asyncio.to_thread``."""
        if self._entry is None:
            self._prepare()
        assert self._entry is not None
        kwargs = {name: getattr(inputs, name) for name in self._wanted}
        if self._is_async:
            return await self._entry(inputs.task, **kwargs)
        return await (run_sync or asyncio.to_thread)(self._entry, inputs.task, **kwargs)


def wanted_parameters(fn: Callable[..., Any], what: str) -> tuple[str, ...]:
    """The named inputs a rollout function asks for after the task; a clear error for anything else."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"agent {what}: cannot read its signature ({e})") from None
    positional = [
        p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]
    if not positional or positional[0].kind is inspect.Parameter.KEYWORD_ONLY:
        raise InvalidInput(f"agent {what} must take the task as its first parameter, e.g. (task, llm)")
    wanted = []
    for p in positional[1:]:
        if p.name not in PARAMETERS:
            if p.default is not inspect.Parameter.empty:
                continue  # the agent's own optional parameter: leave it at its default
            raise InvalidInput(
                f"agent {what}: parameter {p.name!r} unknown; after the task, name parameters "
                f"{', '.join(PARAMETERS)}"
            )
        wanted.append(p.name)
    return tuple(wanted)


class FunctionAgent(Agent):
    """An agent made from a function by `rollout` / `prompt_rollout`."""

    def __init__(self, fn: Callable[..., Any], *, needs_prompt_template: bool = False) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", "agent")
        self.__doc__ = fn.__doc__
        self._is_async = inspect.iscoroutinefunction(fn)
        self._entry = fn
        self._wanted = wanted_parameters(fn, getattr(fn, "__qualname__", repr(fn)))
        if needs_prompt_template and "prompt_template" not in self._wanted:
            raise InvalidInput(f"prompt_rollout agent {self.__name__} must take a prompt_template parameter")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """The function stays callable directly (for the user's own tests)."""
        return self.fn(*args, **kwargs)


def rollout(fn: Callable[..., Any]) -> FunctionAgent:
    """Make a function an agent: ``@fulmen.rollout def agent(task, llm): ... return reward``."""
    return FunctionAgent(fn)


def prompt_rollout(fn: Callable[..., Any]) -> FunctionAgent:
    """An agent trained by prompt optimisation: ``def agent(task, prompt_template, llm=None)``."""
    return FunctionAgent(fn, needs_prompt_template=True)


def load_agent(spec: str) -> Agent:
    """Load ``module:attribute`` (a decorated function, a plain function, an `Agent` subclass or
    instance) and check its signature. Errors say what is wrong and what to do."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise InvalidInput(f"--agent {spec!r}: give it as module:function or module:Class")
    if "" not in sys.path and "." not in sys.path:
        sys.path.insert(0, "")  # like `python -m`: the agent's module may sit in the working directory
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise InvalidInput(f"--agent {spec!r}: cannot import module {module_name!r}: {e}") from None
    target: Any = module
    for part in attribute.split("."):
        try:
            target = getattr(target, part)
        except AttributeError:
            raise InvalidInput(f"--agent {spec!r}: module {module_name!r} has no {attribute!r}") from None
    if isinstance(target, Agent):
        agent = target
    elif isinstance(target, type) and issubclass(target, Agent):
        try:
            agent = target()
        except TypeError as e:
            raise InvalidInput(f"--agent {spec!r}: cannot construct {attribute} without arguments: {e}") from None
    elif callable(target):
        try:
            agent = FunctionAgent(target)
        except InvalidInput as e:
            raise InvalidInput(f"--agent {spec!r}: {e}") from None
    else:
        raise InvalidInput(f"--agent {spec!r}: {attribute} is not an agent but a {type(target).__name__} value")
    if agent._entry is None:
        agent._prepare()
    return agent
