"""The trainer's end of the weight groups (``weight_group``): rank 0 of one group per vLLM server,
sending it the newest full version when its vllm-sync asks.

It holds a host copy of the newest full version published (`hold`: the weights train on meanwhile)
and answers the asks (`fulmen.versions.transport.group_asks`) in a thread beside the training loop,
one at a time. Why the receivers ask rather than the trainer pushing: docs/design/vllm-sync.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import torch

from fulmen.records import WeightGroupAction, WeightGroupAsk
from fulmen.settings import TrainerSettings
from fulmen.store import RedisStore
from fulmen.versions.manifest import tensor_sha256
from fulmen.versions.transport import group
from fulmen.versions.transport.group_asks import Rendezvous, advertise, ask_stream, stale, withdraw

log = logging.getLogger(__name__)

READ_BLOCK_S = 1.0


class WeightSender:
    def __init__(self, store: RedisStore, settings: TrainerSettings) -> None:
        self.store = store
        self.s = settings
        # the held copy is on the host, so gloo whatever the device (NCCL from the GPU weights is next)
        self.backend = "gloo"
        self.rendezvous: Any = None
        self.groups: dict[str, Any] = {}
        self.held: tuple[str, dict[str, torch.Tensor], dict[str, str]] | None = None
        self.sent = 0
        self.asks = ask_stream(store)

    async def start(self) -> Rendezvous:
        """Listen for the groups' members, and say where in the store."""
        self.rendezvous = await asyncio.to_thread(group.serve_store, self.s.weight_group_port,
                                                  self.s.weight_group_timeout_s)
        where = Rendezvous(self.s.weight_group_host, int(self.rendezvous.port), self.backend)
        await self.asks.ensure_group()  # before the advertisement: no ask made after it is missed
        await advertise(self.store, where)
        log.info("weight group: vLLM servers join at %s:%d (%s)", where.host, where.port, where.backend)
        return where

    async def close(self) -> None:
        await withdraw(self.store)
        self.groups.clear()

    async def hold(self, version: str, state: Mapping[str, torch.Tensor]) -> None:
        """Keep ``version`` (a full one, just published) to send: a host copy, and the sha256 of the
        tensors the receivers check (the same sample `group.sampled_names` draws for them)."""

        def copy() -> tuple[dict[str, torch.Tensor], dict[str, str]]:
            held = {name: t.detach().to("cpu", copy=True).contiguous() for name, t in state.items()}
            names = group.sampled_names(group.specs_of(held), seed=version)
            return held, {name: tensor_sha256(held[name]) for name in names}

        held, checks = await asyncio.to_thread(copy)
        self.held = (version, held, checks)

    async def run(self, stop: asyncio.Event) -> None:
        """Answer the asks until ``stop``; an ask that fails is logged (its asker loads from a folder)."""
        consumer = f"trainer-{self.s.experiment}"
        while not stop.is_set():
            entries = await self.asks.read(consumer, 8, READ_BLOCK_S)
            for _, record in entries:
                await self.answer(record)
            await self.asks.ack([entry_id for entry_id, _ in entries])

    async def answer(self, record: WeightGroupAsk) -> None:
        if stale(record, self.s.weight_group_timeout_s):
            log.info("weight group: skipped a stale %s ask from %s", record.action, record.by)
            return
        try:
            if record.action is WeightGroupAction.JOIN:
                await self._join(record)
            else:
                await self._send(record)
        except group.GroupError as e:
            self.groups.pop(record.group, None)  # a broken group: its asker joins a new one
            log.warning("weight group %s (%s): %s; it loads from a folder instead", record.group, record.by, e)

    async def _join(self, record: WeightGroupAsk) -> None:
        self.groups[record.group] = await asyncio.to_thread(
            group.join, self.s.weight_group_host, int(self.rendezvous.port), 0, record.world_size, self.backend,
            self.s.weight_group_timeout_s, name=record.group, store=self.rendezvous)
        log.info("weight group %s: %s joined (%d members)", record.group, record.by, record.world_size)

    async def _send(self, record: WeightGroupAsk) -> None:
        members = self.groups.get(record.group)
        if members is None:
            log.warning("weight group %s: %s asked for %s in a group this trainer does not hold (restarted?); "
                        "it times out and joins again", record.group, record.by, record.model_version)
            return
        if self.held is None:
            await asyncio.to_thread(group.send_refusal, members, "the trainer has published no full version yet "
                                    "(or publishes LoRA adapters, which vllm-sync loads as adapters)")
            return
        version, state, checks = self.held
        sent = await asyncio.to_thread(group.send_version, members, version, state, checks)
        self.sent += 1
        log.info("weight group %s: sent %s to %s (%.1f MB; %s asked)", record.group, version, record.by, sent / 1e6,
                 record.model_version)
