"""The trainer's end of the weight groups (``weight_group``): rank 0 of one group per vLLM server,
sending it the newest full version when its vllm-sync asks.

It holds a host copy of the newest full version published (`hold`: the weights train on meanwhile)
and answers the asks (`fulmen.versions.transport.group_asks`) in a thread beside the training loop,
one at a time. Why the receivers ask rather than the trainer pushing: docs/design/vllm-sync.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from fulmen.records import WeightGroupAction, WeightGroupAsk
from fulmen.settings import TrainerSettings
from fulmen.store import RedisStore
from fulmen.versions.manifest import tensor_sha256
from fulmen.versions.model_version import ModelVersion
from fulmen.versions.transport import group
from fulmen.versions.transport.group_asks import (
    ADVERTISEMENT_TTL_S,
    Rendezvous,
    advertise,
    announce_held,
    ask_stream,
    entry_time,
    redis_time,
    withdraw,
)

log = logging.getLogger(__name__)

READ_BLOCK_S = 1.0
HELD_WAIT_S = 10.0  # an ask for a version announced but not held yet (its copy is being taken) waits this long


class WeightSender:
    def __init__(self, store: RedisStore, settings: TrainerSettings) -> None:
        self.store = store
        self.s = settings
        # the held copy is on the host, so gloo whatever the device (NCCL from the GPU weights is next)
        self.backend = "gloo"
        self.rendezvous: Any = None
        self.where: Rendezvous | None = None
        self.groups: dict[str, Any] = {}  # group name -> its process group
        self.group_of: dict[str, str] = {}  # asker -> the group it joined last (an older one is dropped)
        self.held: tuple[str, dict[str, torch.Tensor], dict[str, str]] | None = None
        self.sent = 0
        self.asks = ask_stream(store)

    async def start(self) -> Rendezvous:
        """Listen for the groups' members, and say where in the store."""
        self.rendezvous = await asyncio.to_thread(group.serve_store, self.s.weight_group_port,
                                                  self.s.weight_group_timeout_s)
        self.where = Rendezvous(self.s.weight_group_host, int(self.rendezvous.port), self.backend)
        await self.asks.ensure_group()  # before the advertisement: no ask made after it is missed
        await withdraw(self.store)  # an earlier trainer's, with the version it held
        await advertise(self.store, self.where)
        log.info("weight group: vLLM servers join at %s:%d (%s)", self.where.host, self.where.port, self.where.backend)
        return self.where

    async def close(self) -> None:
        await withdraw(self.store)
        self.groups.clear()
        self.group_of.clear()
        self.rendezvous = None

    async def hold(self, version: str, state: Mapping[str, torch.Tensor]) -> None:
        """Keep ``version`` (a full one, being published) to send: a host copy, and the sha256 of the
        tensors the receivers check (the same sample `group.sampled_names` draws for them). Said in
        the store at once: vllm-sync may receive it while its folder is still written."""

        def copy() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
            held = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in state.items()}
            names = group.sampled_names(group.specs_of(held), seed=version)
            return held, {name: tensor_sha256(held[name]) for name in names}

        held, checks = await asyncio.to_thread(copy)
        self.held = (version, held, checks)
        await announce_held(self.store, version)

    async def run(self, stop: asyncio.Event) -> None:
        """Answer the asks until ``stop``, keeping the advertisement fresh (it expires when this stops
        without a word); an ask that fails is logged (its asker loads from a folder)."""
        consumer = f"trainer-{self.s.experiment}"
        refreshed = 0.0
        while not stop.is_set():
            if self.where is not None and time.monotonic() - refreshed > ADVERTISEMENT_TTL_S / 3:
                await advertise(self.store, self.where)
                refreshed = time.monotonic()
            entries = await self.asks.read(consumer, 8, READ_BLOCK_S)
            now = await redis_time(self.store)
            for entry_id, record in entries:
                await self.answer(record, age_s=now - entry_time(entry_id))
            await self.asks.ack([entry_id for entry_id, _ in entries])

    async def answer(self, record: WeightGroupAsk, age_s: float = 0.0) -> None:
        """One ask; whatever goes wrong drops its group (the asker joins a new one), and never this loop."""
        if age_s > self.s.weight_group_timeout_s / 2:
            log.warning("weight group: skipped a %s ask from %s made %.0f s ago (its asker waits %.0f s at most)",
                        record.action, record.by, age_s, self.s.weight_group_timeout_s)
            return
        try:
            if record.action is WeightGroupAction.JOIN:
                await self._join(record)
            else:
                await self._send(record)
        except Exception as e:  # gloo raises RuntimeError on a receiver gone; nothing may stop the loop
            self._drop(record.group)
            log.warning("weight group %s (%s): %s: %s; it loads from a folder instead", record.group, record.by,
                        type(e).__name__, e)

    def _drop(self, name: str) -> None:
        self.groups.pop(name, None)
        for asker in [a for a, g in self.group_of.items() if g == name]:
            del self.group_of[asker]

    async def _join(self, record: WeightGroupAsk) -> None:
        old = self.group_of.get(record.by)
        if old is not None:
            self._drop(old)  # the asker's earlier group: it left it
        self.groups[record.group] = await asyncio.to_thread(
            group.join, self.s.weight_group_host, int(self.rendezvous.port), 0, record.world_size, self.backend,
            self.s.weight_group_timeout_s, name=record.group, store=self.rendezvous)
        self.group_of[record.by] = record.group
        log.info("weight group %s: %s joined (%d members)", record.group, record.by, record.world_size)

    async def _send(self, record: WeightGroupAsk) -> None:
        members = self.groups.get(record.group)
        if members is None:
            log.warning("weight group %s: %s asked for %s in a group this trainer does not hold (restarted?); "
                        "it times out and joins again", record.group, record.by, record.model_version)
            return
        held = await self._held_for(record.model_version)
        if held is None:
            await asyncio.to_thread(group.send_refusal, members, "the trainer holds no full version as new as "
                                    f"{record.model_version} (it publishes LoRA adapters, which vllm-sync loads as "
                                    "adapters, or has published none since it started)")
            return
        version, state, checks = held
        sent = await asyncio.to_thread(group.send_version, members, version, state, checks)
        self.sent += 1
        log.info("weight group %s: sent %s to %s (%.1f MB; %s asked)", record.group, version, record.by, sent / 1e6,
                 record.model_version)

    async def _held_for(self, asked: str) -> tuple[str, dict[str, torch.Tensor], dict[str, str]] | None:
        """The held version if it is ``asked`` or newer, waiting a little for one announced before its
        copy was taken (`hold` runs after the publish); None if none comes."""
        wanted = ModelVersion.parse(asked).number
        deadline = time.monotonic() + HELD_WAIT_S
        while True:
            held = self.held
            if held is not None and (held[0] == asked or ModelVersion.parse(held[0]).number >= wanted):
                return held
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.05)
