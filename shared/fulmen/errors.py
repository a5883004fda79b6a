"""Fulmen's exceptions: one root, split into retryable and terminal (as redis-py does)."""

from __future__ import annotations


class FulmenError(Exception):
    """Root of every error Fulmen raises on purpose."""


class RetryableError(FulmenError):
    """The same call may succeed later (a server not up yet, a connection lost)."""


class TerminalError(FulmenError):
    """Retrying the same call cannot help: the input or the state is wrong."""


class RedisUnavailable(RetryableError):
    """Redis did not answer within the allotted wait."""


class RecordError(TerminalError):
    """A message or stored record cannot be encoded or decoded."""


class SchemaVersionError(RecordError):
    """A record was written by a Fulmen with another schema version; it is refused, never misread."""


class RecordTooLarge(RecordError):
    """A record exceeds the configured size limit (FULMEN_MAX_RECORD_BYTES)."""


class InvalidInput(TerminalError):
    """A caller passed a value Fulmen cannot accept (bad id, bad config, NaN reward…)."""


class NotFound(TerminalError):
    """The rollout, attempt, resources or experiment does not exist."""


class InvalidTransition(TerminalError):
    """The requested status change is not allowed from the current status."""
