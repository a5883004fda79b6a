"""What an agent may record besides its LLM calls: rewards, messages, objects, exceptions, operations.

Each call is one span on the runner's tracer, bound to the running attempt. Outside a rollout the
spans belong to nothing and are dropped (a warning says so once), so an agent can be unit-tested
without a runner.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import math
import traceback
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, TypeVar, overload

from opentelemetry import trace

from fulmen.errors import InvalidInput
from fulmen.telemetry import semconv
from fulmen.telemetry.tracing import bound_attributes, current_binding, record_event_span, tracer

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
_warned = False


def _check_bound(what: str) -> None:
    global _warned
    if current_binding() is None and not _warned:
        _warned = True
        log.warning("%s called outside a rollout: not recorded (run the agent with `fulmen run-once`)", what)


def _event(name: str, attributes: dict[str, Any], error: str | None = None) -> None:
    """One point-in-time span for an ``emit_*`` call."""
    if record_event_span(name, attributes, error):
        return
    span = tracer().start_span(name, attributes=bound_attributes(attributes))
    if error is not None:
        span.set_status(trace.Status(trace.StatusCode.ERROR, error))
    span.end()


def check_reward(value: Any, name: str = "reward") -> float:
    """A reward as a finite float, or a clear error (a NaN reward would poison every gradient)."""
    if isinstance(value, bool):
        return float(value)
    if not isinstance(value, int | float):
        raise InvalidInput(f"{name} must be a number, got {type(value).__name__} {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int beyond a float's range (10**400): no reward, and no repr of 400 digits
        raise InvalidInput(f"{name} must be a finite number, got an integer too large for a float") from None
    if not math.isfinite(value):
        raise InvalidInput(f"{name} must be a finite number, got {value}")
    return value


def emit_reward(reward: float | Mapping[str, float], primary: str | None = None) -> float:
    """Record the attempt's reward: one value, or several named values of which ``primary`` (default:
    the first) is the one training uses. Returns the primary value."""
    attributes: dict[str, Any] = {semconv.SPAN_KIND: semconv.KIND_REWARD}
    if isinstance(reward, Mapping):
        if not reward:
            raise InvalidInput("emit_reward got an empty mapping; give at least one named reward")
        values = {str(n): check_reward(v, f"reward {n!r}") for n, v in reward.items()}
        primary = primary if primary is not None else next(iter(values))
        if primary not in values:
            raise InvalidInput(f"primary reward {primary!r} is not among {sorted(values)}")
        for n, v in values.items():
            attributes[semconv.REWARD_PREFIX + n] = v
        attributes[semconv.REWARD_PRIMARY] = primary
        value = values[primary]
    else:
        if primary is not None:
            raise InvalidInput("primary= only makes sense with several named rewards")
        value = check_reward(reward)
    attributes[semconv.REWARD] = value
    _check_bound("emit_reward")
    _event(semconv.REWARD_SPAN, attributes)
    return value


def emit_message(message: str, **attributes: Any) -> None:
    """Record a free-text message (a log line that belongs to the rollout)."""
    _check_bound("emit_message")
    attrs = {semconv.SPAN_KIND: semconv.KIND_MESSAGE, semconv.MESSAGE: str(message), **attributes}
    _event(semconv.MESSAGE_SPAN, attrs)


def emit_object(obj: Any, **attributes: Any) -> None:
    """Record any JSON-serialisable object (a tool result, a parsed answer)."""
    _check_bound("emit_object")
    try:
        text = json.dumps(obj, default=str)
    except (TypeError, ValueError) as e:
        raise InvalidInput(f"emit_object needs a JSON-serialisable object: {e}") from None
    attrs = {semconv.SPAN_KIND: semconv.KIND_OBJECT, semconv.OBJECT_JSON: text, **attributes}
    _event(semconv.OBJECT_SPAN, attrs)


def emit_exception(exc: BaseException, **attributes: Any) -> None:
    """Record an exception (type, message, traceback) without raising it."""
    _check_bound("emit_exception")
    attrs = {
        semconv.SPAN_KIND: semconv.KIND_EXCEPTION,
        semconv.EXCEPTION_TYPE: type(exc).__qualname__,
        semconv.EXCEPTION_MESSAGE: str(exc),
        semconv.EXCEPTION_STACKTRACE: "".join(traceback.format_exception(exc)),
        **attributes,
    }
    _event(semconv.EXCEPTION_SPAN, attrs, error=str(exc))


def _json(value: Any) -> str:
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return repr(value)


class Operation:
    """A span around a piece of the agent's work, as a context manager or a decorator.

    ``with fulmen.operation("search") as op: op.set_output(hits)`` or ``@fulmen.operation``; a
    decorated function's arguments and return value are recorded as the operation's input and output."""

    def __init__(self, name: str, **attributes: Any) -> None:
        self.name = name
        self.attributes = attributes
        self._span: trace.Span | None = None
        self._scope: Any = None

    def __enter__(self) -> Operation:
        attrs = {semconv.SPAN_KIND: semconv.KIND_OPERATION, semconv.OPERATION_NAME: self.name, **self.attributes}
        self._scope = tracer().start_as_current_span(self.name, attributes=attrs)
        self._span = self._scope.__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._scope.__exit__(exc_type, exc, tb)

    def set_input(self, *args: Any, **kwargs: Any) -> None:
        if self._span is not None:
            self._span.set_attribute(semconv.OPERATION_INPUT, _json({"args": args, "kwargs": kwargs}))

    def set_output(self, value: Any) -> None:
        if self._span is not None:
            self._span.set_attribute(semconv.OPERATION_OUTPUT, _json(value))

    def __call__(self, fn: F) -> F:
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def run_async(*args: Any, **kwargs: Any) -> Any:
                with Operation(self.name, **self.attributes) as op:
                    op.set_input(*args, **kwargs)
                    result = await fn(*args, **kwargs)
                    op.set_output(result)
                    return result

            return run_async  # type: ignore[return-value]

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with Operation(self.name, **self.attributes) as op:
                op.set_input(*args, **kwargs)
                result = fn(*args, **kwargs)
                op.set_output(result)
                return result

        return run  # type: ignore[return-value]


@overload
def operation(fn: F) -> F: ...
@overload
def operation(fn: str | None = None, **attributes: Any) -> Operation: ...
def operation(fn: Any = None, **attributes: Any) -> Any:
    """``@operation``, ``@operation("name")`` or ``with operation("name") as op:``."""
    if callable(fn):
        return Operation(fn.__qualname__)(fn)
    return Operation(fn or "operation", **attributes)
