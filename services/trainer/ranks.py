"""Data-parallel trainer ranks over Redis: membership, step plans, gradients up, one aggregate down.

    leader (rank 0)                               every other rank
    plan the step, XADD one share per live rank ─► read its share
    per PPO epoch (ppo_epochs passes over the share, each a full exchange):
      backward on its own share                   backward on its share, scale, encode
      read the ranks' chunks  ◄────────────────── XADD its gradient chunks
      sum, XADD the aggregate ───────────────────► read the aggregate
      optimizer update                            optimizer update    (same weights everywhere)

A star, not all-to-all: each rank uploads its gradient once and one aggregate comes back per step.
Each rank scales its gradient by its share of the step's tokens before encoding, so the leader only
sums and the result is the token-mean gradient of the whole batch, as one rank would compute it.
The leader's own gradient goes through its codec too (it never crosses the network, but error
feedback keeps what the codec drops for the next step): the aggregate is then `sum_decoded` of every
rank's encoded gradient, in rank order — the same function of the same encodings as the DDP hook's
`mean_decoded` — so the step does not depend on which rank leads, and the Redis path and the DDP
hook give the same weights for the same codec, seeds and batches.

Membership: rank n is a Redis key held with a TTL and refreshed by a heartbeat; a process takes the
lowest free rank. A rank silent for ``rank_timeout_s`` is gone: the leader then continues without
its share or waits for it to return, as configured — it never blocks forever on a dead rank. A rank
that (re)joins behind the leader, or was left out of a step, loads the weights of the model version
named in its next plan (the leader publishes one whenever the ranks of a step differ from the last's).
``on_rank_loss=wait``: a step starts only when every rank is live; the leader waits (a stop request
ends the wait, the step's samples stay pending) and resumes when the missing rank is back.
Leader failover: there is none; rank 0 is the only leader. If it dies, the other ranks keep their
rank and wait (blocked reads, heartbeats going on) until a process takes rank 0 again — honcho,
systemd or Kubernetes restarts it — which resumes from rank 0's checkpoint; a rank waiting for the
sum of a step the old leader never finished drops that step when the new leader's plan arrives and
loads the weights that plan names. Electing another rank would need rank 0's checkpoint (its
consumer's pending sample entries and its optimizer state) to be readable by that rank.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Sequence
from typing import Any

import msgpack
import torch

from fulmen.compression import sum_decoded
from fulmen.errors import InvalidInput, RecordError
from fulmen.records import RankPlan
from fulmen.store import RedisStore

log = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
READY = ":ready"
STREAM_MAXLEN = 2000  # plans, gradients and aggregates of old steps are not needed again
CHUNK_BYTES = 4 << 20  # below the 8 MiB record limit
# KEYS[1] = the rank's key, ARGV[1] = our token, ARGV[2] = TTL ms. Returns 1 if we hold the rank
# (refreshed, or taken back after a pause long enough to let it expire), 0 if another process has it.
_REFRESH = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
if not holder then redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]); return 1 end
return 0
"""


# --- codecs (fulmen.compression), framed chunks in, dense fp32 out ---------------------------------


class RankCodec:
    """A rank's gradient codec: its state (error feedback, DGC momentum) persists across steps and in
    checkpoints. Decoding needs no state, so the leader decodes every rank's chunks alike."""

    def __init__(self, name: str, **knobs: Any) -> None:
        from fulmen import compression

        if name in ("dgc",):
            knobs.setdefault("momentum", 0.0)  # AdamW keeps the momentum; DGC's would count it twice
        if name not in ("topk", "dgc"):
            knobs.pop("density", None)
        try:
            self.state = compression.make_codec(name, **knobs)
        except (InvalidInput, ValueError, KeyError) as e:
            raise ValueError(str(e)) from None
        self.name = name

    def encode(self, flat: torch.Tensor, step: int, rank: int) -> list[bytes]:
        return self.state.encode(flat, name="grads", step=step, rank=rank)

    @staticmethod
    def decode(chunks: Sequence[bytes]) -> torch.Tensor:
        from fulmen import compression

        return compression.decode(chunks).reshape(-1)

    def state_dict(self) -> dict[str, Any]:
        return self.state.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state.load_state_dict(state)


def make_codec(name: str, **knobs: Any) -> RankCodec:
    return RankCodec(name, **knobs)


LOSSLESS = "none"  # the leader's aggregate: one per step, exact, so every rank applies the same bits


def flat_gradient(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in model.parameters()
    ])


def set_gradient(model: torch.nn.Module, flat: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


# --- membership ----------------------------------------------------------------------------------


class Membership:
    def __init__(self, store: RedisStore, world_size: int, timeout_s: float) -> None:
        self.store = store
        self.world_size = world_size
        self.timeout_ms = int(timeout_s * 1000)
        self.token = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.rank: int | None = None
        self._refresh = store.redis.register_script(_REFRESH)

    async def claim(self, wait_s: float = 60.0) -> int:
        """Take the lowest free rank (waiting while all are held)."""
        deadline = time.monotonic() + wait_s
        while True:
            for rank in range(self.world_size):
                if await self.store.redis.set(self.store.keys.trainer_slot(rank), self.token, nx=True, px=self.timeout_ms):
                    self.rank = rank
                    log.info("holding trainer rank %d of %d", rank, self.world_size)
                    return rank
            if time.monotonic() > deadline:
                raise RuntimeError(f"all {self.world_size} trainer ranks are taken; raise FULMEN_WORLD_SIZE")
            await asyncio.sleep(HEARTBEAT_S)

    async def heartbeat(self) -> None:
        while True:
            await asyncio.sleep(HEARTBEAT_S)
            assert self.rank is not None
            key = self.store.keys.trainer_slot(self.rank)
            try:
                if not await self._refresh(keys=[key], args=[self.token, self.timeout_ms]):
                    log.error("trainer rank %d was taken by another process while we were silent; stopping",
                              self.rank)
                    os._exit(3)  # another process may hold it now: two rank-n would corrupt the run
            except Exception as e:
                log.warning("rank heartbeat failed: %s", e)

    async def mark_ready(self) -> None:
        """Count in the live ranks from now on (model loaded, reading plans). Until then the leader
        does not hand this rank a share it could not compute in time."""
        assert self.rank is not None
        ready = self.token + READY
        await self.store.redis.set(self.store.keys.trainer_slot(self.rank), ready, px=self.timeout_ms)
        self.token = ready

    async def live(self) -> list[int]:
        """Ranks held by a process that is ready."""
        pipe = self.store.redis.pipeline(transaction=False)
        for rank in range(self.world_size):
            pipe.get(self.store.keys.trainer_slot(rank))
        return [r for r, value in enumerate(await pipe.execute()) if value and value.decode().endswith(READY)]

    async def release(self) -> None:
        if self.rank is not None:
            key = self.store.keys.trainer_slot(self.rank)
            if (await self.store.redis.get(key) or b"").decode() == self.token:  # still ours
                await self.store.redis.delete(key)


# --- the streams of one step ---------------------------------------------------------------------


class Exchange:
    def __init__(self, store: RedisStore, membership: Membership) -> None:
        self.store = store
        self.keys = store.keys
        self.members = membership
        self._cursors: dict[str, bytes | str] = {}
        self.reports: dict[tuple[int, int, int], dict[str, float]] = {}
        # Entries read but not yet asked for: one XREAD may return a later plan or aggregate than the
        # one awaited (a rank that fell behind), and dropping it would leave that rank waiting forever.
        self._plans: list[RankPlan] = []
        self._aggregates: dict[tuple[int, int], list[bytes]] = {}

    async def _xadd(self, stream: str, fields: dict[str, Any]) -> None:
        await self.store.redis.xadd(stream, fields, maxlen=STREAM_MAXLEN, approximate=True)

    async def _read(self, stream: str, block_s: float) -> list[tuple[bytes, dict[bytes, bytes]]]:
        cursor = self._cursors[stream]
        reply = await self.store.redis.xread({stream: cursor}, count=100, block=max(1, int(block_s * 1000)))
        entries = reply[0][1] if reply else []
        if entries:
            self._cursors[stream] = entries[-1][0]
        return entries

    async def start_reading(self) -> None:
        """Read what is sent from now on: call it before anything this rank waits for can be sent.
        (The cursor is the stream's current last id, not "$", which would move with every read.)"""
        for stream in (self.keys.trainer_plans, self.keys.trainer_grads, self.keys.trainer_aggregates):
            last = await self.store.redis.xrevrange(stream, count=1)
            self._cursors[stream] = last[0][0] if last else "0-0"

    # leader → ranks
    async def send_plan(self, plan: RankPlan) -> None:
        await self._xadd(self.keys.trainer_plans, {"rank": plan.rank, "m": plan.to_wire()})

    async def next_plan(self, rank: int) -> RankPlan:
        while not self._plans:
            for _, fields in await self._read(self.keys.trainer_plans, 5.0):
                if int(fields.get(b"rank", -1)) == rank:  # the others' shares are not decoded at all
                    self._plans.append(RankPlan.from_wire(fields[b"m"]))
        return self._plans.pop(0)

    # ranks → leader
    async def send_gradient(self, step: int, rank: int, chunks: Sequence[bytes], report: dict[str, float],
                            epoch: int = 0) -> None:
        """The chunks of one pass (``epoch``) of ``step``; the first entry also carries the rank's
        report (cosine to its true gradient, encode time), which the leader logs."""
        for i, chunk in enumerate(chunks):
            extra = {"report": msgpack.packb(report)} if i == 0 else {}
            await self._xadd(self.keys.trainer_grads,
                             {"step": step, "epoch": epoch, "rank": rank, "m": chunk, **extra})

    async def gather(self, step: int, ranks: Sequence[int], deadline_s: float,
                     epoch: int = 0) -> dict[int, list[bytes]]:
        """The chunks of every rank in ``ranks`` for pass ``epoch`` of ``step``. A rank that left the membership, or that
        has sent nothing for ``deadline_s``, is left out of this step: waiting on it could last forever
        (a rank that restarts has missed the plan). Whether the *next* step waits for the world to be
        whole again is the leader's choice (``on_rank_loss``)."""
        wanted = set(ranks)
        got: dict[int, list[bytes]] = {}
        complete: set[int] = set()
        deadline = time.monotonic() + deadline_s
        while wanted - complete:
            entries = await self._read(self.keys.trainer_grads, 0.5)
            for _, f in entries:
                if (int(f[b"step"]), int(f.get(b"epoch", 0))) != (step, epoch):
                    continue  # a late pass of a rank that was left out: its step went on without it
                rank = int(f[b"rank"])
                got.setdefault(rank, []).append(f[b"m"])
                if b"report" in f:
                    self.reports[(step, epoch, rank)] = msgpack.unpackb(f[b"report"])
                if len(got[rank]) >= _chunk_count(f[b"m"]):
                    complete.add(rank)
            if entries:
                deadline = time.monotonic() + deadline_s  # progress: give the others time too
                continue
            gone = (wanted - complete) - set(await self.members.live())
            silent = wanted - complete if time.monotonic() > deadline else set()
            if gone or silent:
                log.warning("step %d: no gradient from rank(s) %s (%s); stepping without them", step,
                            sorted(gone or silent), "gone" if gone else "silent")
                wanted -= gone or silent
        return {r: got[r] for r in complete}

    # leader → ranks
    async def send_aggregate(self, step: int, chunks: Sequence[bytes], epoch: int = 0) -> None:
        for chunk in chunks:
            await self._xadd(self.keys.trainer_aggregates, {"step": step, "epoch": epoch, "m": chunk})

    async def next_aggregate(self, step: int, epoch: int = 0, rank: int | None = None) -> list[bytes] | None:
        """The leader's sum for pass ``epoch`` of ``step``; None if a newer plan for ``rank`` arrives
        first (the leader went on without this rank, or restarted): that sum may never come."""
        key = (step, epoch)
        newer_plan = False
        while True:
            chunks = self._aggregates.get(key, [])
            if chunks and len(chunks) >= _chunk_count(chunks[-1]):
                # older ones can no longer be asked for: this rank applies aggregates in order
                self._aggregates = {k: v for k, v in self._aggregates.items() if k > key}
                return chunks
            if newer_plan:
                return None
            entries = await self._read(self.keys.trainer_aggregates, 1.0)
            for _, f in entries:
                got = (int(f[b"step"]), int(f.get(b"epoch", 0)))
                if got >= key:
                    self._aggregates.setdefault(got, []).append(f[b"m"])
            if rank is not None and not entries:
                # The leader sends a step's sums before the next plan, so once a plan is visible, one
                # more (non-blocking) read of the sums settles whether ours was sent.
                newer_plan = await self._poll_plans(rank)
                if newer_plan:
                    for _, f in await self._read(self.keys.trainer_aggregates, 0.001):
                        got = (int(f[b"step"]), int(f.get(b"epoch", 0)))
                        if got >= key:
                            self._aggregates.setdefault(got, []).append(f[b"m"])

    async def _poll_plans(self, rank: int) -> bool:
        for _, fields in await self._read(self.keys.trainer_plans, 0.001):
            if int(fields.get(b"rank", -1)) == rank:
                self._plans.append(RankPlan.from_wire(fields[b"m"]))
        return bool(self._plans)


def _chunk_count(chunk: bytes) -> int:
    from fulmen.records import GradientChunk

    try:
        return int(GradientChunk.from_wire(chunk).count)
    except RecordError:
        return 1  # a broken chunk: decoding it will say what is wrong


# --- leading and following a step ----------------------------------------------------------------


class RankGroup:
    """What a trainer process needs to train with others: its membership, the streams, the codec."""

    def __init__(self, store: RedisStore, membership: Membership, exchange: Exchange, codec: Any,
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

    async def lead_step(self, trainer: Any, plan: Any, stop: asyncio.Event | None = None) -> dict[str, Any] | None:
        """Rank 0: split the step over the live ranks; per PPO epoch, back-propagate our share, sum the
        ranks' gradients, send the sum back and update. The caller counts the step. None when ``stop``
        is set while waiting for missing ranks: nothing was trained, the step's entries stay pending."""
        from fulmen import tokens
        from fulmen.model_versions import publish_model_version
        from fulmen_trainer.trainer import merge_passes

        live = await self.members.live()
        waiting_since = None
        while self.wait_for_full_world and len(live) < self.members.world_size:
            if stop is not None and stop.is_set():
                return None
            if waiting_since is None or time.monotonic() - waiting_since > 30:
                log.warning("step %d waits for %d trainer rank(s) to come back (on_rank_loss=wait)",
                            trainer.step + 1, self.members.world_size - len(live))
                waiting_since = time.monotonic()
            await asyncio.sleep(HEARTBEAT_S)
            live = await self.members.live()
        ranks = [0, *[r for r in live if r != 0]]
        if ranks != self._last_live and len(ranks) > 1:
            # someone (re)joined, or was left out of the last step: publish our weights so a rank that
            # is behind can catch up (the plan names this version)
            update = await publish_model_version(self.store, trainer.model.state_dict(), model=trainer.model_name,
                                                 shared_dir=trainer.s.weights_dir)
            trainer.version = update.resources["llm"]["model_version"]
        step = trainer.step + 1
        epochs = trainer.s.ppo_epochs
        total_tokens = trainer._batch(plan).tokens
        size = len(plan.samples)
        shares = [(size * i // len(ranks), size * (i + 1) // len(ranks)) for i in range(len(ranks))]
        for rank, (lo, hi) in zip(ranks[1:], shares[1:], strict=True):
            await self.exchange.send_plan(RankPlan(
                step=step, rank=rank, step_before=trainer.step, model_version=trainer.version,
                total_tokens=total_tokens, epochs=epochs, samples=[s.to_wire() for s in plan.samples[lo:hi]],
                advantages=tokens.pack_floats(plan.advantages[lo:hi].tolist()),
                rewards=[float(r) for r in plan.rewards[lo:hi]], group_keys=list(plan.group_keys[lo:hi]),
            ))
        own = _share(plan, *shares[0])  # one object over the passes: it keeps the step's π_prox
        answering = ranks[1:]
        passes = []
        for epoch in range(epochs):
            metrics = await asyncio.to_thread(trainer._backward, own, total_tokens)
            gathered = await self.exchange.gather(step, answering, trainer.s.rank_timeout_s, epoch)
            answering = sorted(gathered)  # a rank left out of one pass is not waited for again this step
            true = flat_gradient(trainer.model)
            started = time.perf_counter()
            own_chunks = self.codec.encode(true, step, 0)
            encode_s = time.perf_counter() - started
            started = time.perf_counter()
            total = sum_decoded([own_chunks, *(gathered[r] for r in sorted(gathered))])
            decode_s = time.perf_counter() - started
            own_cos = _cosine(RankCodec.decode(own_chunks), true)
            aggregate = self.aggregate_codec.encode(total, step, 0)
            await self.exchange.send_aggregate(step, aggregate, epoch)
            set_gradient(trainer.model, total)
            metrics["loss/grad_norm"] = trainer._update()
            received = sum(len(c) for chunks in gathered.values() for c in chunks)
            reports = [{"cos": own_cos, "encode_s": encode_s},
                       *(self.exchange.reports.pop((step, epoch, r), {}) for r in gathered)]
            metrics.update({
                "comm/ratio": total.numel() * 4 * len(gathered) / received if received else 1.0,
                "comm/cosine": _mean([r["cos"] for r in reports if "cos" in r]),
                "comm/encode_s": _mean([r["encode_s"] for r in reports if "encode_s" in r]),
                "comm/ranks": 1 + len(gathered), "comm/ranks_missing": len(ranks) - 1 - len(gathered),
                "comm/bytes_received": received, "comm/aggregate_bytes": sum(len(c) for c in aggregate),
                "comm/decode_s": decode_s, "perf/tokens": total_tokens, "perf/samples": size,
            })
            passes.append(metrics)
        self._last_live = [0, *answering]  # who took part in the whole step
        metrics = merge_passes(passes)
        # who took part in the whole step (the last pass), and what every pass cost on the wire
        metrics.update({k: v for k, v in passes[-1].items() if k.startswith("comm/")})
        for key in ("comm/bytes_received", "comm/aggregate_bytes", "comm/decode_s", "comm/encode_s"):
            metrics[key] = sum(p[key] for p in passes)
        return metrics

    async def follow(self, trainer: Any, stop: asyncio.Event) -> None:
        """Every rank but 0: train the shares the leader sends, until stopped."""
        from fulmen import tokens
        from fulmen.model_versions import fetch_model_version
        from fulmen.records import Sample
        from fulmen_trainer.trainer import StepPlan

        while not stop.is_set():
            reading = asyncio.ensure_future(self.exchange.next_plan(self.rank))
            stopping = asyncio.ensure_future(stop.wait())
            done, _ = await asyncio.wait({reading, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if reading not in done:
                reading.cancel()
                break
            stopping.cancel()
            plan_msg = reading.result()
            if plan_msg.step_before != trainer.step:  # joined late or came back: take the leader's weights
                log.info("rank %d at step %d, leader at %d: loading model version %s", self.rank, trainer.step,
                         plan_msg.step_before, plan_msg.model_version)
                state = await fetch_model_version(self.store, plan_msg.model_version)
                trainer.model.load_state_dict(state, strict=False)
                trainer.step = plan_msg.step_before
            samples = [Sample.from_wire(b) for b in plan_msg.samples]
            share = StepPlan(samples, list(plan_msg.rewards), torch.tensor(tokens.floats(plan_msg.advantages)),
                             list(plan_msg.group_keys), [])
            step = trainer.step + 1
            for epoch in range(plan_msg.epochs):
                await asyncio.to_thread(trainer._backward, share, plan_msg.total_tokens)
                true = flat_gradient(trainer.model)
                started = time.perf_counter()
                chunks = self.codec.encode(true, step, self.rank)
                encode_s = time.perf_counter() - started
                cos = _cosine(self.codec.decode(chunks), true)  # what the leader will see, against the truth
                await self.exchange.send_gradient(step, self.rank, chunks, {"cos": cos, "encode_s": encode_s}, epoch)
                summed = await self.exchange.next_aggregate(step, epoch, self.rank)
                if summed is None:
                    break
                set_gradient(trainer.model, RankCodec.decode(summed))
                trainer._update()
            else:
                trainer.step = step
                trainer.version = plan_msg.model_version
                if trainer.step % trainer.s.checkpoint_every == 0:
                    await trainer.checkpoint()
                continue
            # A newer plan came before this step's sum: the leader went on without us (we were too
            # slow) or was restarted. Its next plan names weights to load; make sure we load them.
            log.warning("rank %d: step %d left without us; taking the leader's weights with its next plan",
                        self.rank, step)
            trainer.step = -1


def _cosine(sent: torch.Tensor, true: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(sent, true, dim=0)) if true.any() else 1.0


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


def _share(plan: Any, lo: int, hi: int) -> Any:
    from fulmen_trainer.trainer import StepPlan

    return StepPlan(plan.samples[lo:hi], plan.rewards[lo:hi], plan.advantages[lo:hi], plan.group_keys[lo:hi],
                    plan.entry_ids, plan.dropped_groups)
