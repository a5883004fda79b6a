"""Data-parallel trainer ranks over Redis: leading and following a step, and handing the lead over.

A star: each rank sends its token-scaled encoded gradient once, the leader sums and sends one aggregate
back. The leader is whoever holds the lease (`fulmen_trainer.distributed.leadership`): the lowest live
rank takes it when it runs out, and a step counts only once its leader agreed it under its lease.
Ranks meet the trainer only through `RankTrainer`. The step, membership, failover: docs/design/trainer.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Protocol

import torch

from fulmen import tokens
from fulmen.errors import RecordError
from fulmen.records import RankPlan, Sample
from fulmen.records.ranks import AgreedStep
from fulmen.store import RedisStore
from fulmen.store.samples import SampleEntry
from fulmen.telemetry.steps import summarize
from fulmen.versions.model_version import ModelVersion
from fulmen_trainer.distributed.codecs import sum_decoded
from fulmen_trainer.distributed.exchange import Exchange
from fulmen_trainer.distributed.gradients import LOSSLESS, RankCodec, cosine, flat_gradient, set_gradient
from fulmen_trainer.distributed.leadership import Leadership, claim_pending
from fulmen_trainer.distributed.membership import HEARTBEAT_S, Membership
from fulmen_trainer.plan import StepPlan, merge_passes

log = logging.getLogger(__name__)

WAIT_LOG_EVERY_S = 30.0  # a leader waiting for missing ranks says so this often
COMM_TOTALS = ("comm/bytes_received", "comm/aggregate_bytes", "comm/decode_s", "comm/encode_s")


class RankTrainer(Protocol):
    """What a rank group needs of the trainer loop (`fulmen_trainer.trainer.Trainer` is one)."""

    step: int  # optimizer steps taken
    version: ModelVersion  # the weights this rank holds, as last published or loaded
    model: Any  # a torch.nn.Module

    @property
    def ppo_epochs(self) -> int: ...

    def batch_tokens(self, plan: StepPlan) -> int:
        """Trained tokens in ``plan`` (the step's token mean divides by these)."""
        ...

    def backward(self, plan: StepPlan, total_tokens: float | None = None) -> dict[str, Any]:
        """One pass over ``plan``: gradients in ``.grad``, scaled by its tokens over ``total_tokens``."""
        ...

    def update(self) -> float:
        """One optimizer update from ``.grad``; returns the gradient norm before clipping."""
        ...

    async def publish_next(self) -> None:
        """Publish the current weights as a new model version (checkpointed first, held as ``version``)."""
        ...

    async def load_version(self, version: ModelVersion, step: int) -> None:
        """Take the weights of a published ``version``, reached at ``step``."""
        ...

    async def finish_step(self, step: int, version: ModelVersion) -> None:
        """Count a step taken with the others (checkpointing when one is due)."""
        ...

    def lose_step(self) -> None:
        """A step went on without this rank: its weights are no longer the others'."""
        ...

    def keep_step_start(self) -> None:
        """Hold the weights and optimizer state as they are: the step about to start may be dropped."""
        ...

    def undo_step(self) -> None:
        """The step under way was never agreed: drop its gradients and undo the updates of its passes."""
        ...

    async def run(self, stop: asyncio.Event) -> None:
        """Lead: read samples and train steps until stopped, done, or no longer the leader."""
        ...

    async def take_lead(self, group: RankGroup) -> None:
        """Take up the lead from the newest agreed step (`fulmen_trainer.checkpoints.resume_lead`)."""
        ...

    def step_down(self) -> None:
        """No longer the leader: forget the samples in hand (the new leader takes them over)."""
        ...


class RankGroup:
    """What a trainer process needs to train with others: its membership, the streams, the codec."""

    shares_checkpoint = False  # every rank checkpoints its own folder (its consumer, its codec state)
    sharded = False

    def __init__(self, store: RedisStore, membership: Membership, exchange: Exchange, codec: RankCodec,
                 *, wait_for_full_world: bool = False) -> None:
        self.store = store
        self.members = membership
        self.exchange = exchange
        self.codec = codec
        self.wait_for_full_world = wait_for_full_world
        self.aggregate_codec = RankCodec(LOSSLESS)
        self.leadership = Leadership(store, membership.token, membership.timeout_s)
        self.leading = False  # we hold the lease (and have not seen it lost)
        self.won = asyncio.Event()  # a follower took the lease: it leads once its step under way is settled
        self._last_live: list[int] = []
        self._next_stray_check = 0.0

    @property
    def rank(self) -> int:
        assert self.members.rank is not None
        return self.members.rank

    def wrap(self, policy: Any) -> None:
        """Nothing to wrap: gradients travel through the streams, not through the model's backward."""

    async def idle(self) -> None:
        """Nothing to do while the leader waits for samples: the other ranks wait on a stream."""

    # --- the lease: who leads ---------------------------------------------------------------------

    async def serve(self, trainer: RankTrainer, stop: asyncio.Event) -> None:
        """Lead or follow until ``stop`` is set: lead while holding the lease, follow while another
        rank does, and take the lead when its lease runs out and this is the lowest live rank."""
        watching = asyncio.create_task(self._watch())
        try:
            self.leading = await self._try_lead()
            while not stop.is_set():
                if not self.leading:
                    if not await self.follow(trainer, stop):
                        return
                    self.won.clear()
                    self.leading = self.leadership.value is not None  # not lost while settling the step
                    continue
                await trainer.take_lead(self)
                await trainer.run(stop)
                if self.leading:  # stopped, or done (max steps)
                    return
                trainer.step_down()
        finally:
            watching.cancel()
            await self.leadership.release()  # a clean exit hands the lead over at once

    async def _try_lead(self, *, anyone: bool = False) -> bool:
        """Take the lease if it is free and no lower rank is live (``anyone``: whatever the others)."""
        if not anyone and any(r < self.rank for r in await self.members.live()):
            return False
        epoch = await self.leadership.acquire(self.rank)
        if epoch is None:
            return False
        self.exchange.lease = max(self.exchange.lease, epoch)
        return True

    async def _watch(self) -> None:
        """Every heartbeat: the leader renews its lease (stepping down if it is lost); a follower looks
        at it, and takes it once it has run out (the lowest live rank at once, any rank after two
        TTLs, in case the lowest cannot)."""
        absent_since: float | None = None
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            try:
                if self.leading or self.won.is_set():
                    self.leading = await self.leadership.renew() and self.leading
                    continue
                holder = await self.leadership.holder()
                if holder is not None:
                    absent_since = None
                    self.exchange.lease = max(self.exchange.lease, holder.epoch)  # older leases' plans: stale
                    continue
                absent_since = absent_since or time.monotonic()
                patient = time.monotonic() - absent_since > 2 * self.members.timeout_s
                if await self._try_lead(anyone=patient):
                    self.won.set()  # `follow` settles the step under way, then `serve` leads
            except Exception as e:  # Redis away for a moment: the lease decides again next beat
                log.warning("trainer leader lease check failed: %s", e)

    async def agree(self, trainer: RankTrainer, entry_ids: list[str], metrics: dict[str, Any],
                    publishes: bool) -> bool:
        """Commit the step just taken (``trainer.step``): the ranks apply its last update once this is
        written. False if our lease is lost: the step is not agreed, and we no longer lead."""
        record = AgreedStep(trainer.step, self.leadership.epoch, self.rank, trainer.version.name, publishes,
                            list(entry_ids), summarize(trainer.step, metrics, time.time()).to_wire())
        if await self.leadership.agree(record):
            return True
        log.error("step %d not agreed: rank %d no longer holds the leader's lease (epoch %d)", trainer.step,
                  self.rank, self.leadership.epoch)
        self.leading = False
        return False

    async def still_leading(self) -> bool:
        """Whether we still hold the lease, asked now (renewing it): a leader that lost it must not
        publish or record the step it agreed before (the new leader does)."""
        self.leading = self.leading and await self.leadership.renew()
        return self.leading

    async def stray_entries(self, consumer: str) -> list[SampleEntry]:
        """Sample entries a deposed leader read after it lost the lease, once they have been idle a
        TTL in its hands: ours now (looked for every TTL)."""
        if time.monotonic() < self._next_stray_check:
            return []
        self._next_stray_check = time.monotonic() + self.members.timeout_s
        return await claim_pending(self.store, consumer, min_idle_ms=self.members.timeout_ms, others_only=True)

    # --- a step ---------------------------------------------------------------------------------------

    async def _live_ranks(self, trainer: RankTrainer, stop: asyncio.Event | None) -> list[int] | None:
        """The live ranks, leader first; with ``wait_for_full_world``, once all are back (None: stopped)."""
        live = await self.members.live()
        waiting_since = None
        while self.wait_for_full_world and len(live) < self.members.world_size:
            if stop is not None and stop.is_set():
                return None
            if waiting_since is None or time.monotonic() - waiting_since > WAIT_LOG_EVERY_S:
                log.warning("step %d waits for %d trainer rank(s) to come back (on_rank_loss=wait)",
                            trainer.step + 1, self.members.world_size - len(live))
                waiting_since = time.monotonic()
            await asyncio.sleep(HEARTBEAT_S)
            live = await self.members.live()
        return [self.rank, *[r for r in live if r != self.rank]]

    async def lead_step(self, trainer: RankTrainer, plan: StepPlan,
                        stop: asyncio.Event | None = None) -> dict[str, Any] | None:
        """The leader: split the step over the live ranks; per PPO epoch, back-propagate our share, sum
        the ranks' gradients, send the sum back and update. The caller counts the step and agrees it
        (`agree`). None when ``stop`` is set while waiting for missing ranks: nothing was trained, the
        step's entries stay pending."""
        ranks = await self._live_ranks(trainer, stop)
        if ranks is None:
            return None
        if ranks != self._last_live and len(ranks) > 1:
            # someone (re)joined, or was left out of the last step: publish our weights so a rank that
            # is behind can catch up (the plan names this version)
            await trainer.publish_next()
        step = trainer.step + 1
        epochs = trainer.ppo_epochs
        total_tokens = trainer.batch_tokens(plan)
        size = len(plan.samples)
        shares = [(size * i // len(ranks), size * (i + 1) // len(ranks)) for i in range(len(ranks))]
        lease = self.leadership.epoch
        for rank, (lo, hi) in zip(ranks[1:], shares[1:], strict=True):
            await self.exchange.send_plan(RankPlan(
                step=step, rank=rank, step_before=trainer.step, model_version=trainer.version.name,
                total_tokens=total_tokens, epochs=epochs, samples=[s.to_wire() for s in plan.samples[lo:hi]],
                advantages=tokens.pack_floats(plan.advantages[lo:hi].tolist()),
                rewards=[float(r) for r in plan.rewards[lo:hi]], group_keys=list(plan.group_keys[lo:hi]),
            ), lease)
        own = plan.share(*shares[0])  # one object over the passes: it keeps the step's π_prox
        answering = ranks[1:]
        passes = []
        for epoch in range(epochs):
            metrics = await asyncio.to_thread(trainer.backward, own, total_tokens)
            gathered = await self.exchange.gather(step, answering, self.members.timeout_s, epoch, lease)
            answering = sorted(gathered)  # a rank left out of one pass is not waited for again this step
            metrics.update(await self._sum_and_apply(trainer, step, epoch, gathered))
            metrics.update({"comm/ranks_missing": len(ranks) - 1 - len(gathered),
                            "perf/tokens": total_tokens, "perf/samples": size})
            passes.append(metrics)
        self._last_live = [self.rank, *answering]  # who took part in the whole step
        metrics = merge_passes(passes)
        # who took part in the whole step (the last pass), and what every pass cost on the wire
        metrics.update({k: v for k, v in passes[-1].items() if k.startswith("comm/")})
        for key in COMM_TOTALS:
            metrics[key] = sum(p[key] for p in passes)
        return metrics

    async def _sum_and_apply(self, trainer: RankTrainer, step: int, epoch: int,
                             gathered: dict[int, list[bytes]]) -> dict[str, Any]:
        """The leader's half of one pass: encode our gradient, sum it with the others' in rank order,
        send the sum back, update. Returns the pass's ``comm/`` metrics and its gradient norm."""
        true = flat_gradient(trainer.model)
        started = time.perf_counter()
        own_chunks = self.codec.encode(true, step, self.rank)
        encode_s = time.perf_counter() - started
        started = time.perf_counter()
        try:
            total = sum_decoded(_in_rank_order(self.rank, own_chunks, gathered))
        except RecordError as e:
            # a rank's chunks that do not decode (damaged, or foreign): step without that rank
            bad = [r for r in sorted(gathered) if not _decodes(gathered[r])]
            log.warning("step %d: gradients of rank(s) %s do not decode (%s); stepping without them", step, bad, e)
            gathered = {r: c for r, c in gathered.items() if r not in bad}
            total = sum_decoded(_in_rank_order(self.rank, own_chunks, gathered))
        decode_s = time.perf_counter() - started
        own_cos = cosine(RankCodec.decode(own_chunks), true)
        sync = self.codec.observe(float(true.norm()), own_cos)
        aggregate = self.aggregate_codec.encode(total, step, self.rank)
        await self.exchange.send_aggregate(step, aggregate, epoch, self.leadership.epoch)
        set_gradient(trainer.model, total)
        grad_norm = trainer.update()
        received = sum(len(c) for chunks in gathered.values() for c in chunks)
        reports = [{"cos": own_cos, "encode_s": encode_s},
                   *(self.exchange.reports.pop((step, epoch, r), {}) for r in gathered)]
        return {
            "loss/grad_norm": grad_norm,
            "comm/ratio": total.numel() * 4 * len(gathered) / received if received else 1.0,
            "comm/cosine": _mean([r["cos"] for r in reports if "cos" in r]),
            "comm/encode_s": _mean([r["encode_s"] for r in reports if "encode_s" in r]),
            "comm/ranks": 1 + len(gathered),
            "comm/bytes_received": received, "comm/aggregate_bytes": sum(len(c) for c in aggregate),
            "comm/decode_s": decode_s, **sync,
        }

    async def _next_plan(self, stop: asyncio.Event) -> tuple[int, RankPlan] | None:
        """The leader's next plan for this rank and its lease; None once ``stop`` is set or this rank
        took the lead."""
        if self.won.is_set():
            return None
        reading = asyncio.ensure_future(self.exchange.next_plan(self.rank))
        waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self.won.wait())}
        done, _ = await asyncio.wait({reading, *waits}, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
        if reading not in done:
            reading.cancel()
            return None
        return reading.result()

    async def follow(self, trainer: RankTrainer, stop: asyncio.Event) -> bool:
        """Train the shares the leader sends until stopped (False) or this rank took the lead (True)."""
        while (got := await self._next_plan(stop)) is not None:
            lease, plan_msg = got
            version = ModelVersion.parse(plan_msg.model_version)
            if plan_msg.step_before != trainer.step:  # joined late or came back: take the leader's weights
                log.info("rank %d at step %d, leader at %d: loading model version %s", self.rank, trainer.step,
                         plan_msg.step_before, version)
                await trainer.load_version(version, plan_msg.step_before)
            samples = [Sample.from_wire(b) for b in plan_msg.samples]
            share = StepPlan(samples, list(plan_msg.rewards), torch.tensor(tokens.floats(plan_msg.advantages)),
                             list(plan_msg.group_keys), [])
            step = trainer.step + 1
            agreed = await self._follow_passes(trainer, share, plan_msg, lease, step)
            if agreed is not None:
                await trainer.finish_step(step, ModelVersion.parse(agreed.model_version))
            elif self.won.is_set() or self.exchange.newer_lease_queued(lease):
                # its leader is gone and never agreed it: the new leader trains its samples again
                log.warning("rank %d: step %d of lease %d was never agreed; dropping it", self.rank, step, lease)
                trainer.undo_step()
            else:
                # A newer plan came before this step's sum: the leader went on without us (we were too
                # slow) or was restarted. Its next plan names weights to load; make sure we load them.
                log.warning("rank %d: step %d left without us; taking the leader's weights with its next plan",
                            self.rank, step)
                trainer.lose_step()
        return self.won.is_set() and not stop.is_set()

    async def _follow_passes(self, trainer: RankTrainer, share: StepPlan, plan_msg: RankPlan, lease: int,
                             step: int) -> AgreedStep | None:
        """A follower's passes of one step: backward, send, apply the leader's sum; the last pass's
        sum only once the step is agreed. The step's record, or None if a sum or the record never comes
        (a newer plan arrived first, or this rank took the lead)."""
        if plan_msg.epochs > 1:
            trainer.keep_step_start()  # the passes before the last update the weights before agreement
        agreed = None
        for epoch in range(plan_msg.epochs):
            await asyncio.to_thread(trainer.backward, share, plan_msg.total_tokens)
            true = flat_gradient(trainer.model)
            started = time.perf_counter()
            chunks = self.codec.encode(true, step, self.rank)
            encode_s = time.perf_counter() - started
            cos = cosine(self.codec.decode(chunks), true)  # what the leader will see, against the truth
            self.codec.observe(float(true.norm()), cos)
            await self.exchange.send_gradient(step, self.rank, chunks, {"cos": cos, "encode_s": encode_s}, epoch,
                                              lease)
            summed = await self.exchange.next_aggregate(step, epoch, self.rank, lease, self.won)
            if summed is None:
                return None
            if epoch == plan_msg.epochs - 1:
                agreed = await self.exchange.next_agreed(step, lease, self.rank, self.won)
                if agreed is None:
                    return None
            set_gradient(trainer.model, RankCodec.decode(summed))
            trainer.update()
        return agreed


def _in_rank_order(rank: int, own: list[bytes], gathered: dict[int, list[bytes]]) -> list[list[bytes]]:
    """Every rank's chunks in rank order, whichever rank leads (the sum is then the same)."""
    chunks = {**gathered, rank: own}
    return [chunks[r] for r in sorted(chunks)]


def _decodes(chunks: list[bytes]) -> bool:
    try:
        RankCodec.decode(chunks)
    except RecordError:
        return False
    return True


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
