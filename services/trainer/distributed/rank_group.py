"""Data-parallel trainer ranks over Redis: leading and following a step.

A star: each rank sends its token-scaled encoded gradient once, the leader (rank 0, never failed
over) sums and sends one aggregate back. Ranks meet the trainer only through `RankTrainer`.
The step, membership and failure handling: docs/design/trainer.md.
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
from fulmen.store import RedisStore
from fulmen.versions.model_version import ModelVersion
from fulmen_trainer.distributed.codecs import sum_decoded
from fulmen_trainer.distributed.exchange import Exchange
from fulmen_trainer.distributed.gradients import LOSSLESS, RankCodec, cosine, flat_gradient, set_gradient
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
        self._last_live: list[int] = []

    @property
    def rank(self) -> int:
        assert self.members.rank is not None
        return self.members.rank

    def wrap(self, policy: Any) -> None:
        """Nothing to wrap: gradients travel through the streams, not through the model's backward."""

    async def idle(self) -> None:
        """Nothing to do while rank 0 waits for samples: the other ranks wait on a stream."""

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
        return [0, *[r for r in live if r != 0]]

    async def lead_step(self, trainer: RankTrainer, plan: StepPlan,
                        stop: asyncio.Event | None = None) -> dict[str, Any] | None:
        """Rank 0: split the step over the live ranks; per PPO epoch, back-propagate our share, sum the
        ranks' gradients, send the sum back and update. The caller counts the step. None when ``stop``
        is set while waiting for missing ranks: nothing was trained, the step's entries stay pending."""
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
        for rank, (lo, hi) in zip(ranks[1:], shares[1:], strict=True):
            await self.exchange.send_plan(RankPlan(
                step=step, rank=rank, step_before=trainer.step, model_version=trainer.version.name,
                total_tokens=total_tokens, epochs=epochs, samples=[s.to_wire() for s in plan.samples[lo:hi]],
                advantages=tokens.pack_floats(plan.advantages[lo:hi].tolist()),
                rewards=[float(r) for r in plan.rewards[lo:hi]], group_keys=list(plan.group_keys[lo:hi]),
            ))
        own = plan.share(*shares[0])  # one object over the passes: it keeps the step's π_prox
        answering = ranks[1:]
        passes = []
        for epoch in range(epochs):
            metrics = await asyncio.to_thread(trainer.backward, own, total_tokens)
            gathered = await self.exchange.gather(step, answering, self.members.timeout_s, epoch)
            answering = sorted(gathered)  # a rank left out of one pass is not waited for again this step
            metrics.update(await self._sum_and_apply(trainer, step, epoch, gathered))
            metrics.update({"comm/ranks_missing": len(ranks) - 1 - len(gathered),
                            "perf/tokens": total_tokens, "perf/samples": size})
            passes.append(metrics)
        self._last_live = [0, *answering]  # who took part in the whole step
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
        own_chunks = self.codec.encode(true, step, 0)
        encode_s = time.perf_counter() - started
        started = time.perf_counter()
        try:
            total = sum_decoded([own_chunks, *(gathered[r] for r in sorted(gathered))])
        except RecordError as e:
            # a rank's chunks that do not decode (damaged, or foreign): step without that rank
            bad = [r for r in sorted(gathered) if not _decodes(gathered[r])]
            log.warning("step %d: gradients of rank(s) %s do not decode (%s); stepping without them", step, bad, e)
            gathered = {r: c for r, c in gathered.items() if r not in bad}
            total = sum_decoded([own_chunks, *(gathered[r] for r in sorted(gathered))])
        decode_s = time.perf_counter() - started
        own_cos = cosine(RankCodec.decode(own_chunks), true)
        sync = self.codec.observe(float(true.norm()), own_cos)
        aggregate = self.aggregate_codec.encode(total, step, 0)
        await self.exchange.send_aggregate(step, aggregate, epoch)
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

    async def _next_plan(self, stop: asyncio.Event) -> RankPlan | None:
        """The leader's next plan for this rank; None once ``stop`` is set."""
        reading = asyncio.ensure_future(self.exchange.next_plan(self.rank))
        stopping = asyncio.ensure_future(stop.wait())
        done, _ = await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if reading not in done:
            reading.cancel()
            return None
        stopping.cancel()
        return reading.result()

    async def follow(self, trainer: RankTrainer, stop: asyncio.Event) -> None:
        """Every rank but 0: train the shares the leader sends, until stopped."""
        while (plan_msg := await self._next_plan(stop)) is not None:
            version = ModelVersion.parse(plan_msg.model_version)
            if plan_msg.step_before != trainer.step:  # joined late or came back: take the leader's weights
                log.info("rank %d at step %d, leader at %d: loading model version %s", self.rank, trainer.step,
                         plan_msg.step_before, version)
                await trainer.load_version(version, plan_msg.step_before)
            samples = [Sample.from_wire(b) for b in plan_msg.samples]
            share = StepPlan(samples, list(plan_msg.rewards), torch.tensor(tokens.floats(plan_msg.advantages)),
                             list(plan_msg.group_keys), [])
            step = trainer.step + 1
            if await self._follow_passes(trainer, share, plan_msg, step):
                await trainer.finish_step(step, version)
                continue
            # A newer plan came before this step's sum: the leader went on without us (we were too
            # slow) or was restarted. Its next plan names weights to load; make sure we load them.
            log.warning("rank %d: step %d left without us; taking the leader's weights with its next plan",
                        self.rank, step)
            trainer.lose_step()

    async def _follow_passes(self, trainer: RankTrainer, share: StepPlan, plan_msg: RankPlan, step: int) -> bool:
        """A follower's passes of one step: backward, send, apply the leader's sum. False if the sum of
        a pass never comes (a newer plan arrived first)."""
        for epoch in range(plan_msg.epochs):
            await asyncio.to_thread(trainer.backward, share, plan_msg.total_tokens)
            true = flat_gradient(trainer.model)
            started = time.perf_counter()
            chunks = self.codec.encode(true, step, self.rank)
            encode_s = time.perf_counter() - started
            cos = cosine(self.codec.decode(chunks), true)  # what the leader will see, against the truth
            self.codec.observe(float(true.norm()), cos)
            await self.exchange.send_gradient(step, self.rank, chunks, {"cos": cos, "encode_s": encode_s}, epoch)
            summed = await self.exchange.next_aggregate(step, epoch, self.rank)
            if summed is None:
                return False
            set_gradient(trainer.model, RankCodec.decode(summed))
            trainer.update()
        return True


def _decodes(chunks: list[bytes]) -> bool:
    try:
        RankCodec.decode(chunks)
    except RecordError:
        return False
    return True


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
