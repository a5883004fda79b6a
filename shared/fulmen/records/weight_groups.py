"""Sending model versions over a weight group: the record of the weight-group-asks stream.

vllm-sync asks the trainer's rank 0 to ``join`` a group of ``world_size`` (itself and the server's
workers), then to ``send`` a version over it; the trainer does each as the workers wait for it
(`fulmen.versions.transport.group`). Wire form: an entry ``{"m": <msgpack record>}`` on
``store.keys.weight_group_asks``; the record is ``{"v": 1, "kind": "weight_group_ask", "action": "join" |
"send", "group": str, "world_size": int, "model_version": str, "by": str, "time": float}``."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar

from fulmen.records.base import Record, require_at_least, require_finite, require_id


class WeightGroupAction(StrEnum):
    JOIN = "join"  # make the group ``group`` of ``world_size`` members (the asker's workers join it too)
    SEND = "send"  # send the newest full version over ``group`` (``model_version``: the one asked for)


@dataclass(frozen=True, slots=True)
class WeightGroupAsk(Record):
    """One ask to the trainer's weight sender."""

    KIND: ClassVar[str] = "weight_group_ask"

    action: WeightGroupAction
    group: str
    world_size: int = 2
    model_version: str = ""
    by: str = ""  # "vllm-sync <url>"
    time: float = 0.0

    def check_wire(self) -> None:
        require_id(self, "group")
        require_at_least(self, 2, "world_size")
        require_finite(self, "time", minimum=0.0)
