"""Which attempt a request belongs to, and which trace its span joins.

From the ``/rollout/{r}/attempt/{a}`` prefix or the ``x-fulmen-*`` headers, and the W3C
``traceparent``. The rules: docs/design/proxy.md.
"""

from __future__ import annotations

import os
import random
import re
from dataclasses import dataclass

from fulmen.telemetry import semconv
from fulmen.telemetry.tracing import rollout_trace_id
from fulmen_llm_proxy.errors import bad_request

_ID = re.compile(r"[A-Za-z0-9_.:\-]{1,128}")  # fulmen.keys.check_id's alphabet; always fullmatch
_HEX = frozenset("0123456789abcdef")
_ROLLOUT_HEADER = semconv.HEADER_ROLLOUT_ID.encode()
_ATTEMPT_HEADER = semconv.HEADER_ATTEMPT_ID.encode()


@dataclass(slots=True)
class Target:
    """The route of a request with its attribution prefix removed."""

    path: str  # e.g. /v1/chat/completions
    rollout_id: str = ""
    attempt_id: str = ""


def split_path(path: str) -> Target:
    """Strip ``/rollout/{r}/attempt/{a}`` off the path; ids are checked against the store's alphabet."""
    if not path.startswith("/rollout/"):
        return Target(path)
    parts = path.split("/", 5)  # "", rollout, r, attempt, a, rest
    if len(parts) < 5 or parts[3] != "attempt":
        return Target(path)  # not the prefix: the router answers 404
    rollout_id, attempt_id = parts[2], parts[4]
    if not _ID.fullmatch(rollout_id) or not _ID.fullmatch(attempt_id):
        raise bad_request("rollout and attempt ids in the path must be 1-128 of [A-Za-z0-9_.:-]")
    return Target("/" + parts[5] if len(parts) > 5 else "/", rollout_id, attempt_id)


def from_headers(target: Target, headers: dict[bytes, bytes]) -> None:
    """Attribute by headers when the path did not."""
    if target.rollout_id:
        return
    rollout_id = headers.get(_ROLLOUT_HEADER)
    attempt_id = headers.get(_ATTEMPT_HEADER)
    if rollout_id is None and attempt_id is None:
        return
    if rollout_id is None or attempt_id is None:
        raise bad_request(
            f"send both {semconv.HEADER_ROLLOUT_ID} and {semconv.HEADER_ATTEMPT_ID}, or neither"
        )
    # latin-1 decodes any bytes; the alphabet check below then refuses whatever is not an id.
    target.rollout_id, target.attempt_id = rollout_id.decode("latin-1"), attempt_id.decode("latin-1")
    if not _ID.fullmatch(target.rollout_id) or not _ID.fullmatch(target.attempt_id):
        raise bad_request("rollout and attempt id headers must be 1-128 of [A-Za-z0-9_.:-]")


def trace_context(traceparent: bytes | None, rollout_id: str) -> tuple[str, str | None]:
    """(trace id, parent span id) for the call's span: from ``traceparent`` when it is valid,
    else the rollout's trace (or a fresh one when unattributed) with no parent."""
    if traceparent is not None:
        parts = traceparent.decode("latin-1").strip().lower().split("-")
        if (
            len(parts) >= 4
            and len(parts[1]) == 32
            and len(parts[2]) == 16
            and _HEX.issuperset(parts[1])
            and _HEX.issuperset(parts[2])
            and parts[1] != "0" * 32
            and parts[2] != "0" * 16
        ):
            return parts[1], parts[2]
    if rollout_id:
        return f"{rollout_trace_id(rollout_id):032x}", None
    return os.urandom(16).hex(), None


def new_span_id() -> str:
    """A random span id. Not from os.urandom, a system call per call: ids need to be unique, not
    secret, and `random` is seeded from the system once per process (again in a forked child)."""
    return f"{random.getrandbits(64):016x}"
