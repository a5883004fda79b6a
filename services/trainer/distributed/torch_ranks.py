"""Data-parallel trainer ranks on torch.distributed, under torchrun: DDP carries the gradients (through
Fulmen's codecs as its communication hook), broadcasts carry the work.

Only rank 0 reads samples, checkpoints and publishes. The step and why: docs/design/trainer.md.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import msgpack
import torch
import torch.distributed as dist

from fulmen import tokens
from fulmen.records import RankPlan, Sample
from fulmen.settings import TrainerSettings
from fulmen.versions.model_version import ModelVersion
from fulmen_trainer.distributed.codecs import DDPCodecState, codec_hook
from fulmen_trainer.distributed.gradients import RankCodec
from fulmen_trainer.distributed.sync_policy import SyncPolicy
from fulmen_trainer.plan import StepPlan, merge_passes

if TYPE_CHECKING:
    from fulmen_trainer.policy import Policy

Trainer = Any  # fulmen_trainer.trainer.Trainer, which imports this module

log = logging.getLogger(__name__)

HELLO, IDLE, STEP, STOP, GATHER, CHECKPOINT = 0, 1, 2, 3, 4, 5
IDLE_PING_S = 60.0
TIMEOUT = timedelta(minutes=30)  # a collective waits this long (a slow step on a big model, a pause)
MAX_MESSAGE_BYTES = 1 << 30


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


class TorchRanks:
    """This process's place in a torch.distributed group of trainer ranks (see the module docstring)."""

    shares_checkpoint = True

    def __init__(self, settings: TrainerSettings) -> None:
        if not under_torchrun():
            raise ValueError(f"--parallel {settings.parallel} runs under torchrun (torchrun --no-python "
                             f"--nproc-per-node N fulmen trainer --parallel {settings.parallel} ...); "
                             "without it use --parallel redis")
        self.sharded = settings.parallel == "fsdp"
        if self.sharded and settings.codec != "none":
            raise ValueError("--parallel fsdp reduces gradients itself (reduce-scatter): use --codec none, "
                             "or --parallel ddp for the gradient codecs")
        self.rank = int(os.environ["RANK"])
        self.world = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        cuda = settings.device != "cpu" and torch.cuda.is_available()
        self.device = f"cuda:{self.local_rank}" if cuda else "cpu"
        if self.sharded and not cuda and settings.dtype != "float32":
            raise ValueError("--parallel fsdp on a CPU trains in fp32: use --dtype float32")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cuda else "gloo", timeout=TIMEOUT)
        self.control = dist.new_group(backend="gloo", timeout=TIMEOUT)
        # a bad codec name or density raises ValueError here, before any step
        self.codec = DDPCodecState(RankCodec(settings.codec, density=settings.codec_density).state, start_iter=0,
                                   policy=SyncPolicy.from_settings(settings))
        self.bucket_mb = settings.ddp_bucket_mb
        self._last_sent = time.monotonic()

    def settings_for_rank(self, settings: TrainerSettings) -> TrainerSettings:
        """One GPU per rank (its local rank); the CPU stays the CPU."""
        return settings.model_copy(update={"device": self.device})

    def wrap(self, policy: Policy) -> None:
        """DDP around the policy's scoring forward, with the codec as its communication hook (rank 0's
        weights are broadcast to every rank here); or FSDP2: every decoder layer and the rest sharded
        over the ranks. Before the optimizer is made: FSDP replaces the parameters."""
        from torch.nn.parallel import DistributedDataParallel

        from fulmen_trainer.logprobs import TokenScorer

        self.policy = policy
        if self.sharded:
            self._shard(policy)
            return

        ddp = DistributedDataParallel(
            TokenScorer(policy.model), device_ids=[self.local_rank] if self.device.startswith("cuda") else None,
            bucket_cap_mb=self.bucket_mb, find_unused_parameters=True,
        )
        if self.codec.codec.name != "none":
            ddp.register_comm_hook(self.codec, codec_hook)
        policy.scorer = ddp

    def _shard(self, policy: Policy) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        from fulmen_trainer.logprobs import TokenScorer

        mesh = init_device_mesh(self.device.split(":")[0], (self.world,))
        knobs: dict[str, Any] = {"mesh": mesh}
        if policy.autocast_dtype == torch.bfloat16:  # bf16 compute, fp32 gradient reduction
            knobs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in _decoder_layers(policy.model):
            fully_shard(layer, **knobs)
        scorer = TokenScorer(policy.model)
        fully_shard(scorer, **knobs)  # the root: embeddings, final norm, output layer
        policy.scorer = scorer
        policy.gather = self.gather_full_state

    def gather_full_state(self) -> dict[str, torch.Tensor]:
        """Rank 0: the whole model's state for a model version (every rank takes part; the others get {})."""
        if self.rank == 0:
            self._send(GATHER)
        return self._gather()

    def _gather(self) -> dict[str, torch.Tensor]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        assert self.policy is not None
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(self.policy.model, options=options)

    def save_checkpoint(self, directory: Any, checkpoint: Any, trainer: Trainer) -> None:
        """Rank 0: every rank writes its shard of the model and optimizer (`checkpoints.save_sharded`)."""
        from fulmen_trainer import checkpoints

        self._send(CHECKPOINT, msgpack.packb(checkpoint.step))
        assert trainer.optimizer is not None
        checkpoints.save_sharded(directory, checkpoint, trainer.model, trainer.optimizer, 0, self.world, self.control)

    def load_checkpoint(self, path: Any, trainer: Trainer) -> Any:
        from fulmen_trainer import checkpoints

        assert trainer.optimizer is not None
        return checkpoints.load_sharded(path, trainer.model, trainer.optimizer, self.rank, self.world)

    def _serve(self, trainer: Trainer, kind: int, payload: bytes) -> None:
        """A follower's part in what rank 0 does outside a step: gather a version, write a checkpoint."""
        if kind == GATHER:
            self._gather()
        elif kind == CHECKPOINT:
            from fulmen_trainer import checkpoints

            assert trainer.optimizer is not None
            step = msgpack.unpackb(payload)
            checkpoints.save_sharded(trainer.checkpoint_folder, checkpoints.Checkpoint(step, "", []), trainer.model,
                                     trainer.optimizer, self.rank, self.world, self.control)

    # --- control messages ------------------------------------------------------------------------------

    def _send(self, kind: int, payload: bytes = b"") -> None:
        dist.broadcast(torch.tensor([kind, len(payload)], dtype=torch.int64), src=0, group=self.control)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.control)
        self._last_sent = time.monotonic()

    def _receive(self) -> tuple[int, bytes]:
        header = torch.zeros(2, dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.control)
        kind, size = int(header[0]), int(header[1])
        if not 0 <= size <= MAX_MESSAGE_BYTES:
            raise RuntimeError(f"rank {self.rank}: a control message of {size} bytes from rank 0 (corrupt)")
        data = torch.empty(size, dtype=torch.uint8)
        if size:
            dist.broadcast(data, src=0, group=self.control)
        return kind, data.numpy().tobytes()

    async def hello(self, trainer: Trainer) -> None:
        """Every rank resumes at the same step (they all load rank 0's checkpoint), or none starts."""
        if self.rank == 0:
            await asyncio.to_thread(self._send, HELLO, msgpack.packb(trainer.step))
            return
        kind, payload = await asyncio.to_thread(self._receive)
        while kind in (GATHER, CHECKPOINT):  # rank 0 published while starting (a resumed version)
            await asyncio.to_thread(self._serve, trainer, kind, payload)
            kind, payload = await asyncio.to_thread(self._receive)
        step = msgpack.unpackb(payload) if kind == HELLO else None
        if step != trainer.step:
            raise RuntimeError(f"rank {self.rank} resumed at step {trainer.step}, rank 0 at {step}: "
                               "every rank must start from rank 0's checkpoint folder")

    async def idle(self) -> None:
        """Rank 0, waiting for samples: keep the other ranks' receive from timing out."""
        if self.world > 1 and time.monotonic() - self._last_sent > IDLE_PING_S:
            await asyncio.to_thread(self._send, IDLE)

    async def finish(self) -> None:
        """Rank 0 stops: so do the others."""
        if self.world > 1:
            await asyncio.to_thread(self._send, STOP)

    # --- a step -------------------------------------------------------------------------------------------

    async def lead_step(self, trainer: Trainer, plan: StepPlan, stop: asyncio.Event | None = None) -> dict[str, Any]:
        """Rank 0: send every other rank its share, then the passes over our own; the caller counts the
        step (and checkpoints and publishes)."""
        step, epochs = trainer.step + 1, trainer.ppo_epochs
        total_tokens = trainer.batch_tokens(plan)
        size = len(plan.samples)
        shares = [(size * i // self.world, size * (i + 1) // self.world) for i in range(self.world)]
        plans = [self._plan(trainer, plan, lo, hi, step, rank, total_tokens, epochs)
                 for rank, (lo, hi) in enumerate(shares) if rank > 0]
        if plans:
            await asyncio.to_thread(self._send, STEP, msgpack.packb([p.to_wire() for p in plans]))
        own = plan.share(*shares[0]) if shares[0][1] > shares[0][0] else _no_tokens(plan)
        passes = []
        self.codec.step = step
        for _ in range(epochs):
            metrics = await asyncio.to_thread(trainer.backward, own, total_tokens / self.world)
            metrics["loss/grad_norm"] = trainer.update()
            passes.append(metrics)
        metrics = merge_passes(passes)
        rewards = torch.tensor(plan.rewards) if plan.rewards else torch.zeros(1)
        metrics.update({"perf/tokens": total_tokens, "perf/samples": size, "comm/ranks": self.world,
                        "rollout/reward_mean": float(rewards.mean()),
                        "rollout/reward_std": float(rewards.std(unbiased=False)),
                        **self._comm_metrics()})
        return metrics

    def _comm_metrics(self) -> dict[str, float]:
        """This step's wire figures from the hook (``none`` all-reduces fp32 and encodes nothing)."""
        stats = self.codec.compression_stats(reset=True)
        sent = stats.get("comm/wire_bytes", 0.0)
        return {**stats, "comm/bytes": sent, "comm/ratio": stats["comm/compression_ratio"] if sent else 1.0}

    def _plan(self, trainer: Trainer, plan: StepPlan, lo: int, hi: int, step: int, rank: int, total_tokens: int,
              epochs: int) -> RankPlan:
        share = plan.share(lo, hi) if hi > lo else _no_tokens(plan)
        return RankPlan(
            step=step, rank=rank, step_before=trainer.step, model_version=trainer.version.name,
            total_tokens=total_tokens, epochs=epochs, samples=[s.to_wire() for s in share.samples],
            advantages=tokens.pack_floats(share.advantages.tolist()), rewards=[float(r) for r in share.rewards],
            group_keys=list(share.group_keys),
        )

    async def follow(self, trainer: Trainer, stop: asyncio.Event) -> None:
        """Every rank but 0: train the shares rank 0 sends until it says STOP (a SIGTERM here waits for
        rank 0's: torchrun sends it to every rank)."""
        while True:
            kind, payload = await asyncio.to_thread(self._receive)
            if kind == STOP:
                return
            if kind != STEP:
                await asyncio.to_thread(self._serve, trainer, kind, payload)
                continue
            mine = RankPlan.from_wire(msgpack.unpackb(payload)[self.rank - 1])
            samples = [Sample.from_wire(b) for b in mine.samples]
            share = StepPlan(samples, list(mine.rewards), torch.tensor(tokens.floats(mine.advantages)),
                             list(mine.group_keys), [])
            self.codec.step = mine.step
            for _ in range(mine.epochs):
                await asyncio.to_thread(trainer.backward, share, mine.total_tokens / self.world)
                trainer.update()
            trainer.step, trainer.version, trainer.nonfinite = mine.step, ModelVersion.parse(mine.model_version), None
            self.codec.compression_stats(reset=True)

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def _decoder_layers(model: Any) -> list[torch.nn.Module]:
    """The model's repeated blocks (the classes Hugging Face never splits across devices)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in base.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(base).__name__} names no decoder layer class (_no_split_modules): "
                         "FSDP would shard it as one block; use --parallel ddp")
    return layers


def _no_tokens(plan: StepPlan) -> StepPlan:
    """A share for a rank with no samples: the step's first sample with nothing to train, so the rank
    still takes part in every all-reduce and adds a zero gradient."""
    first = plan.samples[0]
    empty = dataclasses.replace(first, response_mask=[0] * len(first.response_mask))
    return StepPlan([empty], plan.rewards[:1], torch.zeros(1), plan.group_keys[:1], plan.entry_ids)
