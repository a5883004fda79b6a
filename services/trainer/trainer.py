"""The trainer's loop, top to bottom: samples → complete groups → advantages → loss → step →
checkpoint → acknowledge → publish.

An entry is acknowledged only after a checkpoint that includes its step; a version's name is taken
and checkpointed before it is published; with ranks over Redis, a step is agreed (one fenced write)
before anything of it is kept. Lineage, exactly-once, failover and metrics: docs/design/trainer.md.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from fulmen import keys as k
from fulmen.devices import resolve_device
from fulmen.records import Sample, SampleSkip
from fulmen.settings import TrainerSettings
from fulmen.store import RedisStore
from fulmen.telemetry.steps import record_untrained_groups
from fulmen.versions.model_version import (
    BASE_VERSION,
    ModelVersion,
    fetch_model_version,
    next_model_version,
)
from fulmen.versions.retention import retain_versions, rewrite_aof_after_publish
from fulmen_trainer import checkpoints as ckpt
from fulmen_trainer.batch import TokenBatch, make_batch
from fulmen_trainer.distributed.rank_group import RankGroup
from fulmen_trainer.distributed.torch_ranks import TorchRanks
from fulmen_trainer.groups import GroupCollector, ReadyGroup
from fulmen_trainer.logprobs import pack_micro_batch
from fulmen_trainer.loss import clip_fraction, learning_rate, micro_loss, recipe_knobs, value_loss
from fulmen_trainer.metrics import MetricsMirror, StepMetrics
from fulmen_trainer.objectives import Baseline, objective
from fulmen_trainer.plan import StepPlan, merge_passes, nonfinite_plan, plan_step
from fulmen_trainer.policy import Policy, load_policy
from fulmen_trainer.publishing import (
    LostWeightsWatch,
    VersionPublisher,
    answer_rebuild_asks,
    republish_if_lost,
)
from fulmen_trainer.values import ValueTargets, value_targets
from fulmen_trainer.weight_sender import WeightSender

log = logging.getLogger(__name__)

READ_COUNT = 512  # sample entries per read: a few steps' worth, so a read rarely waits on the next
READ_BLOCK_S = 1.0  # also how often the loop looks at the stop event



class Trainer:
    """One trainer process: alone, or rank ``rank`` of a `RankGroup` (it is then a `RankTrainer`)."""

    def __init__(self, store: RedisStore, settings: TrainerSettings, *, rank: int = 0,
                 ranks: RankGroup | TorchRanks | None = None) -> None:
        if settings.model_dir is None:
            raise ValueError("the trainer needs --model-dir (a Hugging Face model folder)")
        objective(settings.algorithm)  # unknown names fail here, at start
        self.knobs = recipe_knobs(settings, announce=rank == 0)  # and settings the recipe cannot run with
        if self.knobs.value_head and ranks is not None:
            raise ValueError(f"{settings.algorithm} trains a value head, which one trainer alone keeps: "
                             "run it without ranks (no torchrun, no --ranks)")
        resolve_device(settings.device)  # likewise a device this machine does not have
        self.store = store
        self.s = settings
        self.rank = rank
        self.ranks = ranks  # when several ranks train together
        self.consumer = f"trainer-{rank}"
        self.model_name = settings.model_name or settings.model_dir.resolve().name
        self.collector = self._new_collector()
        self.baseline = Baseline()
        self.ready: list[ReadyGroup] = []
        self.step = 0
        self.version: ModelVersion = BASE_VERSION
        self.consumed_since_checkpoint: list[str] = []
        self.checkpointed_step: int | None = None  # the step of the newest checkpoint on disk
        self.unlogged: list[dict[str, Any]] = []
        self.mirror = MetricsMirror(settings.metrics_file)
        self.policy: Policy | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.metrics: StepMetrics | None = None
        self.publisher = VersionPublisher(settings, lora=settings.lora_rank is not None)
        self.lost_weights = LostWeightsWatch()  # `fulmen_trainer.publishing`
        self.aof_rewrite: asyncio.Task[None] | None = None  # Redis's AOF rewrite, once the proxies serve a version
        self.sender: WeightSender | None = None  # with weight_group: vLLM servers are sent full versions on asking
        self.vocab_size: int | None = None  # token ids at or above it are refused (set by `setup`)
        self.nonfinite: str | None = None  # why the step under way makes no update (a NaN or inf)
        self.resumed_consumed: set[str] = set()  # entries the resumed checkpoint consumed (Redis ranks)
        self._step_start: tuple[dict[str, torch.Tensor], dict[str, Any]] | None = None  # `keep_step_start`

    def _new_collector(self) -> GroupCollector:
        s = self.s
        return GroupCollector(group_size=s.group_size, shape=s.sample_shape, max_staleness=s.max_staleness,
                              stale_policy=s.stale_policy, rl=s.algorithm != "sft",
                              dynamic_sampling=self.knobs.dynamic_sampling, reward_source=s.reward_source)

    @property
    def leads(self) -> bool:
        """Whether this rank leads: alone, rank 0 under torchrun, the lease's holder over Redis."""
        return self.ranks.leading if isinstance(self.ranks, RankGroup) else self.rank == 0

    @property
    def model(self) -> Any:
        """The model that trains (a PEFT model with LoRA; a DDP wrapper under torch.distributed)."""
        return self.policy.model if self.policy is not None else None

    @model.setter
    def model(self, model: Any) -> None:
        if self.policy is None:
            self.policy = Policy(model, self.s, torch.device("cpu"))
        else:
            self.policy.model, self.policy.scorer = model, None

    @property
    def checkpoint_folder(self) -> Path:
        """This rank's checkpoints; rank 0's for every rank when the ranks share them (torch.distributed)."""
        shared = self.ranks is not None and self.ranks.shares_checkpoint
        return self.s.checkpoint_dir / f"rank-{0 if shared else self.rank}"

    # --- setup and resume ----------------------------------------------------------------------------

    async def setup(self) -> None:
        await asyncio.to_thread(__import__, "transformers")  # a slow import, off the loop
        torch.manual_seed(self.s.seed)
        self.metrics = StepMetrics(self.rank, self.s.metrics_port)
        if self.leads and not isinstance(self.ranks, RankGroup):  # over Redis: once it takes the lead
            self.metrics.log_steps_to(self.store)  # the steps stream: pacing, reward curve, `fulmen top`
        if self.s.torch_threads:
            torch.set_num_threads(self.s.torch_threads)
        path = ckpt.latest(self.checkpoint_folder)
        sharded = path is not None and ckpt.is_sharded(path)
        if sharded and not (self.ranks is not None and self.ranks.sharded):
            raise ValueError(f"{path} is a sharded (FSDP) checkpoint: resume it with --parallel fsdp under torchrun")
        # in a thread: loading takes seconds, and the rank's heartbeat must keep beating meanwhile
        self.policy = await asyncio.to_thread(load_policy, self.s, path / "model" if path and not sharded else None)
        self.vocab_size = int(self.model.get_input_embeddings().num_embeddings)
        if self.ranks is not None:
            self.ranks.wrap(self.policy)  # DDP or FSDP: before the optimizer (FSDP replaces the parameters)
        self.optimizer = torch.optim.AdamW(self.policy.trainable_parameters(), lr=self.s.learning_rate)
        await self.store.samples.ensure_samples_group(k.TRAINERS_GROUP)
        already_done = await ckpt.resume_from(self, path, sharded) if path is not None else set()
        if isinstance(self.ranks, RankGroup):
            self.resumed_consumed = already_done  # the leader's, whoever it is, once it leads (`take_lead`)
        else:
            await ckpt.recover_pending(self, already_done)

    # --- the loop ------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        assert self.model is not None, "call setup() first"
        while not stop.is_set() and self.leads and (self.s.max_steps is None or self.step < self.s.max_steps):
            if self.ranks is not None:
                await self.ranks.idle()
            if isinstance(self.ranks, RankGroup):  # what a deposed leader read after losing the lease
                await self.take(await self.ranks.stray_entries(self.consumer))
            entries = await self.store.samples.read_samples(k.TRAINERS_GROUP, self.consumer, count=READ_COUNT,
                                                    block_s=READ_BLOCK_S)
            await self.take(entries)
            await republish_if_lost(self)
            await answer_rebuild_asks(self)  # lost versions a proxy waits for
            # staleness counts against the version that trains: groups still waiting are weighed again
            waiting = [self.collector.reweigh(g, self.version.number) for g in self.ready]
            complete = self.collector.take_complete(self.version.number)
            # the algorithm enqueues a group for each dropped one now, not once the trainer stalls
            dropped = [new.key for old, new in zip(self.ready, waiting, strict=True) if old.samples and not new.samples]
            lost = dropped + [g.key for g in complete if not g.samples and not g.filtered]
            await record_untrained_groups(self.store.redis, self.store.keys, lost)
            await record_untrained_groups(self.store.redis, self.store.keys,
                                          [g.key for g in complete if g.filtered], filtered=True)
            self.ready = waiting + complete
            usable = [g for g in self.ready if g.samples]
            if len(usable) < self.s.groups_per_step:
                continue
            cut = self.ready.index(usable[self.s.groups_per_step - 1]) + 1
            groups, self.ready = self.ready[:cut], self.ready[cut:]
            await self.train_step(groups, stop)
        if self.metrics is not None:
            await self.metrics.flush()  # the last steps reach the steps stream before we return

    async def take(self, entries: list[tuple[str, Sample | SampleSkip]]) -> None:
        """Put sample-stream entries into their groups. An entry this trainer cannot train on (a token
        id outside its vocabulary) or that fails on the way in is dead-lettered with the reason, and
        the others go on: it would fail again after every restart."""
        for entry_id, item in entries:
            reason = self.unusable(item)
            if reason is None:
                try:
                    if not self.collector.add(entry_id, item):  # validation or APO: never trained on
                        self.consumed_since_checkpoint.append(entry_id)
                    continue
                except Exception as e:  # one bad entry must not stop the trainer
                    reason = f"could not group the sample: {type(e).__name__}: {e}"
            await self.store.samples.dead_letter_samples(k.TRAINERS_GROUP, entry_id, reason)
            self.collector.counts["samples/dead_lettered"] += 1

    def unusable(self, item: Sample | SampleSkip) -> str | None:
        """Why this trainer cannot train on ``item`` although it decoded, or None."""
        if isinstance(item, Sample) and self.vocab_size is not None:
            top = max(max(item.prompt_token_ids, default=0), max(item.response_token_ids, default=0))
            if top >= self.vocab_size:
                return f"token id {top} is outside the model's vocabulary of {self.vocab_size}"
        return None

    async def train_step(self, groups: list[ReadyGroup], stop: asyncio.Event | None = None) -> dict[str, Any]:
        # advantages
        plan = plan_step(groups, self.s.algorithm, self.s.reward_source, self.baseline, self.knobs)
        started = time.perf_counter()
        self.nonfinite = nonfinite_plan(plan)
        if self.nonfinite is not None:  # nothing was sent to the ranks yet: not even counted as a step
            return await self.skip_step(plan)
        if self.ranks is None:
            # loss, backward, update (in a thread: the event loop keeps reading and answering signals)
            metrics = await asyncio.to_thread(self.train_passes, plan)
        else:
            # share the step with the live ranks; per pass they send gradients, we send back their sum
            shared = await self.ranks.lead_step(self, plan, stop)
            if shared is None:  # stopped while waiting for a rank: the groups stay pending, read after a restart
                return {}
            metrics = shared
        self.step += 1
        metrics["perf/step_s"] = time.perf_counter() - started
        metrics["perf/tokens_per_s"] = metrics["perf/tokens"] / max(metrics["perf/step_s"], 1e-9)
        # a model version for the proxies: its name is taken now and checkpointed before it is published
        publishing = self.nonfinite is None and self.leads and self.step % self.s.publish_every == 0
        if publishing:
            self.version = await next_model_version(self.store, shared_dir=self.s.weights_dir)
        metrics.update({"step": self.step, "model_version": self.version.name, "time": time.time(),
                        "sample_ids": [s.sample_id for s in plan.samples]})
        # over Redis, the step counts once agreed under our lease: the ranks then apply its last update
        if isinstance(self.ranks, RankGroup) and not await self.ranks.agree(self, plan.entry_ids, metrics, publishing):
            self.lose_step()  # deposed: our weights are a step no one agreed; the new leader redoes it
            return {}
        if self.nonfinite is not None:  # the ranks counted the step too, and all skipped its update
            return await self.skip_step(plan)
        self.consumed_since_checkpoint += plan.entry_ids
        self.unlogged.append(metrics)
        # checkpoint, then acknowledge what it covers, then publish, then log it. A publishing step always
        # checkpoints first: a trainer killed in between publishes the same weights under the same name
        # when it restarts, so no proxy ever serves a version the trainer's lineage does not contain.
        if publishing or self.step % self.s.checkpoint_every == 0:
            await self.checkpoint()
        # a leader deposed since the agreement leaves its version and record to the new one (`resume_lead`)
        if isinstance(self.ranks, RankGroup) and not await self.ranks.still_leading():
            return metrics
        if publishing:
            await self.publish()
        if self.metrics is not None:  # after the publish: the algorithm paces rollouts on this record
            self.metrics.record(self.step, metrics)
        log.info(
            "step %d  loss %.4f  reward %.3f±%.3f  kl %.4f  entropy %.3f  %d samples  %.0f tok/s  version %s",
            self.step, metrics["loss/total"], metrics["rollout/reward_mean"], metrics["rollout/reward_std"],
            metrics["loss/kl"], metrics["loss/entropy"], metrics["perf/samples"], metrics["perf/tokens_per_s"],
            self.version,
        )
        return metrics

    async def skip_step(self, plan: StepPlan) -> dict[str, Any]:
        """A step with a NaN or infinite reward, advantage, loss or gradient: its update was not made
        and no version is published; its entries count as consumed (they would do the same again) and
        are acknowledged with the next checkpoint."""
        log.warning("step %d skipped: %s (%d samples; no update, nothing published)", self.step,
                    self.nonfinite, len(plan.samples))
        self.collector.counts["steps/skipped_nonfinite"] += 1
        self.consumed_since_checkpoint += plan.entry_ids
        await record_untrained_groups(self.store.redis, self.store.keys, sorted(set(plan.group_keys)))
        return {}

    def train_passes(self, plan: StepPlan) -> dict[str, Any]:
        """One rank alone: ``ppo_epochs`` passes over the batch (the recipe's `RecipeKnobs.passes`),
        each a backward and an update."""
        passes = []
        for _ in range(self.ppo_epochs):
            passes.append(self.backward(plan))
            if not math.isfinite(passes[-1]["loss/total"]):
                self.nonfinite = self.nonfinite or f"loss {passes[-1]['loss/total']}"
            passes[-1]["loss/grad_norm"] = self.update()
            if self.nonfinite is not None:
                break  # a later pass would start from the same broken numbers
        return merge_passes(passes)

    # --- what a step is made of (also `RankTrainer`, what the ranks call) ---------------------------

    @property
    def ppo_epochs(self) -> int:
        return self.knobs.passes

    def batch_tokens(self, plan: StepPlan) -> int:
        return self._batch(plan).tokens

    def backward(self, plan: StepPlan, total_tokens: float | None = None) -> dict[str, Any]:
        """One pass over this rank's share: gradients scaled so that the shares of all ranks add up to
        the token mean of the whole step (``total_tokens``: the step's trained tokens over every share).

        PPO epochs: the first pass records the policy's log-probabilities (π_prox, the policy at the
        start of the step) in ``plan.prox_logp``; later passes clip the ratio π_θ/π_prox around them,
        while the importance weight π_prox/π_behaviour keeps using the proxy's recorded log-probs, so
        w · ratio = π_θ/π_behaviour (until truncated) in every pass."""
        assert self.policy is not None
        policy = self.policy
        batch = self._batch(plan)
        advantages = plan.advantages
        total_tokens = max(total_tokens if total_tokens is not None else batch.tokens, 1)
        first_pass = plan.prox_logp is None
        prox_logps: list[torch.Tensor] = [] if plan.prox_logp is None else plan.prox_logp
        sums = {"loss": 0.0, "pg": 0.0, "kl": 0.0, "entropy": 0.0, "is_weight": 0.0, "mismatch": 0.0,
                "clip_frac": 0.0, "value_loss": 0.0}
        with_entropy = self.s.ent_coef > 0 or self.s.entropy_metric
        ranges = batch.micro_batches(self.s.micro_batch, self.s.micro_batch_tokens, packed=self.s.pack_sequences)
        value_stream = self._value_stream(plan, batch, ranges)
        for index, (lo, hi) in enumerate(ranges):
            micro = batch.slice(lo, hi).trimmed()
            if self.s.pack_sequences:  # the same micro-batch, its forward on rows without padding
                micro = pack_micro_batch(policy.model, micro, self.s.micro_batch_tokens)
            micro = micro.to(policy.device)
            targets = self._micro_targets(plan, lo, hi, micro)  # ppo_gae: per-token advantages, value targets
            adv = targets.advantages if targets is not None else advantages[lo:hi].to(policy.device)
            with policy.gradient_sync(last=index == len(ranges) - 1):
                logp, token_entropy, values = policy.score(micro, self.s.logprob_chunk_tokens, with_entropy)
                if first_pass:
                    prox_logps.append(logp.detach())
                prox = prox_logps[index]
                weight = micro.tokens / total_tokens  # micro-batches add up to the token mean of the batch
                targets = targets.with_current(values) if targets is not None else None
                loss, pg, entropy, kl = micro_loss(self.s, self.policy, micro, adv, logp, token_entropy, prox, targets)
                (loss * weight).backward()
            mask = micro.mask
            with torch.no_grad():  # diagnostics: how far the proxy's log-probabilities are from ours
                gap = (logp - micro.behaviour_logp) * mask
                tokens = mask.sum().clamp(min=1)
                is_weight = (torch.exp(gap).clamp(max=self.s.tis_cap) * mask).sum() / tokens
                # tokens whose ratio to the step's start left the clip range (0 in a first pass)
                sums["clip_frac"] += clip_fraction(self.s, logp, prox, mask) * weight
                sums["loss"] += float(loss) * weight
                sums["pg"] += float(pg) * weight
                sums["kl"] += float(kl) * weight
                sums["entropy"] += float(entropy) * weight
                sums["is_weight"] += float(is_weight) * weight
                sums["mismatch"] += float(gap.abs().sum() / tokens) * weight
                sums["value_loss"] += (float(value_loss(self.s, mask, targets)) if targets else 0.0) * weight
        plan.prox_logp = prox_logps
        return self._pass_metrics(plan, batch, sums, value_stream)

    def _pass_metrics(self, plan: StepPlan, batch: TokenBatch, sums: dict[str, float],
                      value_stream: dict[str, float]) -> dict[str, Any]:
        """A pass's metrics from its sums over micro-batches (`backward`)."""
        rewards = torch.tensor(plan.rewards) if plan.rewards else torch.zeros(1)
        staleness = batch.staleness
        return {
            "loss/total": sums["loss"], "loss/policy": sums["pg"], "loss/kl": sums["kl"],
            "loss/entropy": sums["entropy"], "loss/is_weight_mean": sums["is_weight"],
            "loss/clip_frac": sums["clip_frac"],
            "rollout/logp_mismatch": sums["mismatch"],
            "rollout/reward_mean": float(rewards.mean()), "rollout/reward_std": float(rewards.std(unbiased=False)),
            "rollout/staleness_mean": float(staleness.mean()) if len(staleness) else 0.0,
            "perf/samples": len(batch), "perf/tokens": batch.tokens,
            "groups/dropped": plan.dropped_groups,
            **{f"count/{name}": n for name, n in self.collector.counts.items()},
            **value_stream, **({"loss/value": sums["value_loss"]} if plan.value_targets is not None else {}),
        }

    def _micro_targets(self, plan: StepPlan, lo: int, hi: int, micro: TokenBatch) -> ValueTargets | None:
        """Sequences lo..hi of the step's value targets, as wide as ``micro`` and on its device (None:
        no value head)."""
        if plan.value_targets is None:
            return None
        assert self.policy is not None
        return plan.value_targets.micro(lo, hi, micro.mask.shape[1], self.policy.device)

    def _value_stream(self, plan: StepPlan, batch: TokenBatch, ranges: list[tuple[int, int]]) -> dict[str, float]:
        """ppo_gae, in a step's first pass: the value head's targets for the step's passes (in
        ``plan.value_targets``), from the values before any update; and their metrics (``{}`` otherwise)."""
        assert self.policy is not None
        if self.policy.value_head is None or plan.weights is None or plan.value_targets is not None:
            return {}
        plan.value_targets, stream = value_targets(self.policy, batch, ranges, plan.advantages, plan.weights,
                                                   self.knobs, self.s.logprob_chunk_tokens)
        return stream

    def _batch(self, plan: StepPlan) -> TokenBatch:
        pad_id = getattr(self.model.config, "pad_token_id", None) or 0
        now = self.version.number
        return make_batch(
            plan.samples, pad_id=pad_id, rewards=plan.rewards, group_keys=plan.group_keys,
            staleness=[now - ModelVersion.parse(s.model_version).number for s in plan.samples],
        )

    def learning_rate(self, step: int) -> float:
        return learning_rate(self.s, step)

    def update(self) -> float:
        """One optimizer update from the gradients in ``.grad`` (clipped); the caller counts the step
        once all of its PPO epochs are done. Returns the gradient norm before clipping."""
        assert self.policy is not None
        total = torch.nn.utils.clip_grad_norm_(self.policy.trainable_parameters(), self.s.max_grad_norm)
        norm = float(total.full_tensor() if hasattr(total, "full_tensor") else total)  # FSDP: a DTensor
        assert self.optimizer is not None
        if not math.isfinite(norm) or self.nonfinite is not None:
            # a NaN or inf gradient (or loss) would poison every weight: no update this step. Every
            # rank applies the same summed gradient, so every rank skips alike.
            self.nonfinite = self.nonfinite or f"gradient norm {norm}"
            self.optimizer.zero_grad(set_to_none=True)
            return norm
        # the schedule is a function of the step (every epoch of a step uses one rate): resumes exactly
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    async def publish(self, *, resumed: bool = False, exact: bool = False) -> None:
        """Publish the current weights as ``self.version`` (a name taken by `next_model_version` and
        checkpointed); the proxies load it. ``resumed``: weights a killed publish left half-written
        under that name are replaced. ``exact``: in fp32 whatever ``publish_dtype`` says (ranks that
        catch up from it must hold the leader's master weights bit for bit)."""
        assert self.policy is not None
        # FSDP: a collective with every rank
        state = await asyncio.to_thread(self.policy.published_state, exact=exact)
        # full weights: the weight group's copy first (vLLM receives it while the folder is written;
        # taken beside the publish, the two copies slow each other down)
        if self.sender is not None and self.policy.published_format() is None:
            await self.sender.hold(self.version.name, state)
        await self.publisher.publish(
            self.store, state, model=self.model_name, version=self.version.name, replace_unpublished=resumed,
            weights_format=self.policy.published_format(), exact=exact,
        )
        await retain_versions(self.store, self.s.keep_versions, self.s.weights_dir)
        if self.aof_rewrite is not None:  # a version the proxies never loaded: the new one counts
            self.aof_rewrite.cancel()
        self.aof_rewrite = asyncio.create_task(rewrite_aof_after_publish(self.store))

    async def publish_next(self) -> None:
        """The next model version outside a step (ranks that rejoin catch up from it): its name is
        taken and checkpointed before it is published, as in `train_step`."""
        self.version = await next_model_version(self.store, shared_dir=self.s.weights_dir)
        if self.checkpointed_step != self.step:  # else the newest checkpoint holds these very weights
            await self.checkpoint()
        await self.publish(exact=True)

    async def load_version(self, version: ModelVersion, step: int) -> None:
        """Take the weights of a published version (a rank catching up with its leader's ``step``)."""
        assert self.policy is not None
        state = await fetch_model_version(self.store, version.name)
        self.policy.load_published(state)
        self.step = step

    async def finish_step(self, step: int, version: ModelVersion) -> None:
        """A step taken with the other ranks: count it, and checkpoint when one is due."""
        self.step, self.version = step, version
        self.nonfinite = None  # a follower's flag of this step (its update was skipped) is spent
        self._step_start = None
        if self.step % self.s.checkpoint_every == 0:
            await self.checkpoint()

    def lose_step(self) -> None:
        """A step went on without this rank: no step number matches its weights until the leader's next
        plan names weights to load."""
        self.step = -1
        self.nonfinite = None
        self._step_start = None

    def keep_step_start(self) -> None:
        """Hold a copy of the weights and the optimizer state: a step of several passes updates the
        weights before it is agreed, and `undo_step` may have to take them back."""
        assert self.optimizer is not None
        weights = {n: p.detach().clone() for n, p in self.model.named_parameters() if p.requires_grad}
        self._step_start = (weights, copy.deepcopy(self.optimizer.state_dict()))

    def undo_step(self) -> None:
        """The step under way was never agreed (its leader is gone): drop its gradients, and the updates
        of its passes if `keep_step_start` held the weights from before them."""
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        self.nonfinite = None
        if self._step_start is not None:
            weights, optimizer = self._step_start
            with torch.no_grad():
                for name, p in self.model.named_parameters():
                    if name in weights:
                        p.copy_(weights[name])
            self.optimizer.load_state_dict(optimizer)
            self._step_start = None

    async def take_lead(self, group: RankGroup) -> None:
        """Lead from the newest step the ranks agreed (`fulmen_trainer.checkpoints.resume_lead`)."""
        await ckpt.resume_lead(self, group)

    def step_down(self) -> None:
        """No longer the leader: forget the samples in hand (the new leader takes them over, pending
        as they are) and what is left of our steps (agreed, so the new leader has them)."""
        self.collector = self._new_collector()
        self.ready, self.consumed_since_checkpoint, self.unlogged = [], [], []
        self.publisher.previous = None
        if self.metrics is not None:
            self.metrics.store = None  # the steps stream is the leader's

    async def checkpoint(self) -> None:
        assert self.optimizer is not None
        checkpoint = ckpt.Checkpoint(self.step, self.version.name, self.consumed_since_checkpoint,
                                     {"metrics": self.unlogged} if self.leads else {}, self.s.experiment)
        directory = self.checkpoint_folder
        codec_state = self.ranks.codec.state_dict() if self.ranks is not None else None
        if isinstance(self.ranks, TorchRanks) and self.ranks.sharded:
            await asyncio.to_thread(self.ranks.save_checkpoint, directory, checkpoint, self)
        else:
            await asyncio.to_thread(ckpt.save, directory, checkpoint, self.model, self.optimizer, codec_state,
                                    self.policy.value_head if self.policy is not None else None)
        await self.store.samples.ack_samples(k.TRAINERS_GROUP, self.consumed_since_checkpoint)
        self.consumed_since_checkpoint = []
        self.checkpointed_step = self.step
        if self.leads:
            self.mirror.append(self.unlogged)
        self.unlogged = []
