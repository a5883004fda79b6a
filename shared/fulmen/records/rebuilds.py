"""Rebuilding a model version whose weights Redis lost: the record of the weights-rebuilds stream.

A proxy or vllm-sync that cannot load a stored version asks (``ask``); whoever rebuilds it from the
trainer's checkpoint (`fulmen.versions.rebuild`) answers ``rebuilt`` or ``refused`` with the reason.
Wire form: an entry ``{"m": <msgpack record>}`` on ``store.keys.version_rebuilds``; the record is
``{"v": 1, "kind": "version_rebuild", "action": "ask" | "rebuilt" | "refused", "model_version": str,
"by": str, "reason": str, "time": float}``."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

from fulmen.records.base import Record, require_finite


class RebuildAction(StrEnum):
    ASK = "ask"  # the version's weights are gone and this process waits for them
    REBUILT = "rebuilt"  # its weights are stored again, the same bytes
    REFUSED = "refused"  # they cannot be rebuilt: ``reason`` says why


@dataclass(frozen=True, slots=True)
class VersionRebuild(Record):
    """One ask for, or one answer about, the weights of ``model_version``."""

    KIND: ClassVar[str] = "version_rebuild"

    action: RebuildAction
    model_version: str
    by: str = ""  # who asks or answers: "llm-proxy <id>", "vllm-sync <url>", "trainer", "fulmen rollback"
    reason: str = ""
    time: float = 0.0

    def check_wire(self) -> None:
        require_finite(self, "time", minimum=0.0)
