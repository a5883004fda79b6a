"""The trainer's loop, top to bottom: samples → complete groups → advantages → loss → step → publish
→ checkpoint → acknowledge.

Exactly-once consumption: a sample-stream entry is acknowledged only after a checkpoint that
includes the step that consumed it; the checkpoint lists the entries consumed since the previous
one, so a trainer killed between the checkpoint and the acknowledgement acknowledges them on restart
instead of training on them twice. Entries read but not yet consumed stay pending under the
trainer's stable consumer name and are read again after a restart. Metrics lines are written after
their checkpoint, so the metrics file never counts a step twice either; the checkpoint carries
them too, so a trainer that died before writing them writes them on restart.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from fulmen import keys as k
from fulmen.model_versions import publish_model_version, version_number
from fulmen.records import Sample
from fulmen.settings import TrainerSettings
from fulmen.store import RedisStore
from fulmen_trainer import checkpoint as ckpt
from fulmen_trainer.batch import TokenBatch, make_batch, token_logprobs
from fulmen_trainer.groups import GroupCollector, ReadyGroup
from fulmen_trainer.metrics import StepMetrics
from fulmen_trainer.objectives import (
    Baseline,
    entropy_from_logits,
    group_advantages,
    kl_to_reference,
    objective,
)

log = logging.getLogger(__name__)

@dataclass
class StepPlan:
    """One optimizer step's work: the samples, their advantages, and every stream entry it consumes."""

    samples: list[Sample]
    rewards: list[float]
    advantages: torch.Tensor
    group_keys: list[str]
    entry_ids: list[str]
    dropped_groups: int = 0
    stats: dict[str, float] = field(default_factory=dict)
    # The policy's log-probabilities at the start of the step, one [B, T-1] tensor per micro-batch:
    # recorded by the first pass, the centre of the clip in the later ones (see `Trainer._backward`).
    prox_logp: list[torch.Tensor] | None = None


def merge_passes(passes: list[dict[str, Any]]) -> dict[str, Any]:
    """A step's metrics from its PPO passes: the first pass's (the batch under the policy the step
    started from, comparable whatever ppo_epochs is), plus where the last pass ended."""
    metrics = dict(passes[0])
    metrics["loss/clip_frac"] = passes[-1]["loss/clip_frac"]
    metrics["loss/policy_last_pass"] = passes[-1]["loss/policy"]
    metrics["loss/ppo_epochs"] = len(passes)
    return metrics


def rollout_reward(sample: Sample, source: str) -> float:
    if source == "matched" and sample.reward is not None:
        return sample.reward
    value = sample.final_reward if sample.final_reward is not None else sample.reward
    return float(value if value is not None else 0.0)


def plan_step(groups: list[ReadyGroup], algorithm: str, reward_source: str, baseline: Baseline,
              sft_min_reward: float | None = None) -> StepPlan:
    """Advantages per sample. GRPO normalises within each group at the rollout level (a rollout with
    three LLM calls does not count three times), then every sample gets its rollout's advantage."""
    samples, weights, keys, entry_ids = [], [], [], []
    dropped = 0
    for g in groups:
        entry_ids += g.entry_ids
        if not g.samples:
            dropped += 1
            continue
        samples += g.samples
        weights += g.weights
        keys += [g.key] * len(g.samples)
    rewards = [rollout_reward(s, reward_source) for s in samples]
    reward_t = torch.tensor(rewards, dtype=torch.float)
    if algorithm == "grpo":
        rollouts = {(key, s.rollout_id): i for i, (key, s) in enumerate(zip(keys, samples, strict=True))}
        index = {r: j for j, r in enumerate(rollouts)}
        per_rollout = torch.tensor([rewards[i] for i in rollouts.values()], dtype=torch.float)
        group_of = {key: j for j, key in enumerate(dict.fromkeys(keys))}
        rollout_groups = torch.tensor([group_of[key] for key, _ in rollouts], dtype=torch.long)
        rollout_adv = group_advantages(per_rollout, rollout_groups) if len(per_rollout) else per_rollout
        advantages = torch.stack([rollout_adv[index[(key, s.rollout_id)]] for key, s in zip(keys, samples, strict=True)]) \
            if samples else torch.zeros(0)
    elif algorithm in ("ppo", "reinforce"):
        advantages = baseline.advantages(reward_t) if samples else torch.zeros(0)
    else:  # sft: advantages unused; a sample below the reward threshold gets weight 0
        advantages = torch.zeros(len(samples))
        if sft_min_reward is not None:
            weights = [w if r >= sft_min_reward else 0.0 for w, r in zip(weights, rewards, strict=True)]
    advantages = advantages * torch.tensor(weights, dtype=torch.float) if samples else advantages
    plan = StepPlan(samples, rewards, advantages, keys, entry_ids, dropped)
    if algorithm == "sft":
        plan.stats["sft_weights"] = float(sum(weights))
        plan.advantages = torch.tensor(weights, dtype=torch.float)  # sft reads them as sample weights
    return plan


class Trainer:
    def __init__(self, store: RedisStore, settings: TrainerSettings, *, rank: int = 0, ranks: Any = None) -> None:
        if settings.model_dir is None:
            raise ValueError("the trainer needs --model-dir (a Hugging Face model folder)")
        objective(settings.algorithm)  # unknown names fail here, at start
        self.store = store
        self.s = settings
        self.rank = rank
        self.ranks = ranks  # fulmen_trainer.ranks.RankGroup when several ranks train together
        self.consumer = f"trainer-{rank}"
        self.model_name = settings.model_name or settings.model_dir.resolve().name
        self.collector = GroupCollector(
            group_size=settings.group_size, shape=settings.sample_shape, max_staleness=settings.max_staleness,
            stale_policy=settings.stale_policy,
        )
        self.baseline = Baseline()
        self.ready: list[ReadyGroup] = []
        self.step = 0
        self.version = "base"
        self.consumed_since_checkpoint: list[str] = []
        self.unlogged: list[dict[str, Any]] = []
        self._logged_step: int | None = None  # the metrics file's last step, read on first use
        self.model: Any = None
        self.reference: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.metrics: StepMetrics | None = None

    # --- setup and resume ----------------------------------------------------------------------------

    async def setup(self) -> None:
        transformers = await asyncio.to_thread(__import__, "transformers")  # a slow import, off the loop
        AutoModelForCausalLM = transformers.AutoModelForCausalLM

        torch.manual_seed(self.s.seed)
        self.metrics = StepMetrics(self.rank, self.s.metrics_port)
        if self.s.torch_threads:
            torch.set_num_threads(self.s.torch_threads)
        directory = self.s.checkpoint_dir / f"rank-{self.rank}"
        path = ckpt.latest(directory)
        source = path / "model" if path else self.s.model_dir
        # in a thread: loading takes seconds, and the rank's heartbeat must keep beating meanwhile
        self.model = await asyncio.to_thread(AutoModelForCausalLM.from_pretrained, source, dtype=torch.float32)
        self.model.train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.s.learning_rate)
        if self.s.kl_coef > 0:
            base = await asyncio.to_thread(AutoModelForCausalLM.from_pretrained, self.s.model_dir, dtype=torch.float32)
            self.reference = base.eval().requires_grad_(False)
        await self.store.ensure_samples_group(k.TRAINERS_GROUP)
        already_done: set[str] = set()
        if path is not None:
            checkpoint, codec_state = ckpt.load(path, self.optimizer)
            if self.ranks is not None and codec_state:
                self.ranks.codec.load_state_dict(codec_state)  # error feedback carries over the restart
            self.step, self.version = checkpoint.step, checkpoint.model_version
            already_done = set(checkpoint.consumed_entry_ids)
            log.info("resumed from %s: step %d, model version %s", path, self.step, self.version)
            if self.rank == 0:
                # a trainer that died after its checkpoint but before the metrics write (SIGKILL, or
                # Redis gone at the acknowledgement) logs those steps now, or the file misses them
                self._log_metrics(checkpoint.extra.get("metrics", []))
        await self._recover_pending(already_done)

    async def _recover_pending(self, already_done: set[str]) -> None:
        """Entries read before a restart: those the last checkpoint consumed are acknowledged now; the
        rest go back into the groups."""
        acked = requeued = 0
        after = "0"
        while True:
            entries = await self.store.read_samples(k.TRAINERS_GROUP, self.consumer, count=1000, pending=True,
                                                    after=after)
            if not entries:
                break
            after = entries[-1][0]
            done = [e for e, _ in entries if e in already_done]
            await self.store.ack_samples(k.TRAINERS_GROUP, done)
            acked += len(done)
            for entry_id, item in entries:
                if entry_id not in already_done:
                    if not self.collector.add(entry_id, item):
                        self.consumed_since_checkpoint.append(entry_id)
                    requeued += 1
        if acked or requeued:
            log.info("after restart: %d entries were already trained on, %d back in their groups", acked, requeued)

    # --- the loop ------------------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        assert self.model is not None, "call setup() first"
        while not stop.is_set() and (self.s.max_steps is None or self.step < self.s.max_steps):
            entries = await self.store.read_samples(k.TRAINERS_GROUP, self.consumer, count=512, block_s=1.0)
            for entry_id, item in entries:
                if not self.collector.add(entry_id, item):  # validation or APO: never trained on
                    self.consumed_since_checkpoint.append(entry_id)
            self.ready += self.collector.take_complete(version_number(self.version))
            usable = [g for g in self.ready if g.samples]
            if len(usable) < self.s.groups_per_step:
                continue
            cut = self.ready.index(usable[self.s.groups_per_step - 1]) + 1
            groups, self.ready = self.ready[:cut], self.ready[cut:]
            await self.train_step(groups, stop)

    async def train_step(self, groups: list[ReadyGroup], stop: asyncio.Event | None = None) -> dict[str, Any]:
        # advantages
        plan = plan_step(groups, self.s.algorithm, self.s.reward_source, self.baseline, self.s.sft_min_reward)
        started = time.perf_counter()
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
        # publish a model version for the proxies
        if self.rank == 0 and self.step % self.s.publish_every == 0:
            update = await publish_model_version(
                self.store, self.model.state_dict(), model=self.model_name, shared_dir=self.s.weights_dir
            )
            self.version = update.resources["llm"]["model_version"]
        metrics.update({"step": self.step, "model_version": self.version, "time": time.time(),
                        "sample_ids": [s.sample_id for s in plan.samples]})
        self.consumed_since_checkpoint += plan.entry_ids
        self.unlogged.append(metrics)
        if self.metrics is not None:
            self.metrics.record(self.step, metrics)
        # checkpoint, then acknowledge what it covers, then log it
        if self.step % self.s.checkpoint_every == 0:
            await self.checkpoint()
        log.info(
            "step %d  loss %.4f  reward %.3f±%.3f  kl %.4f  entropy %.3f  %d samples  %.0f tok/s  version %s",
            self.step, metrics["loss/total"], metrics["rollout/reward_mean"], metrics["rollout/reward_std"],
            metrics["loss/kl"], metrics["loss/entropy"], metrics["perf/samples"], metrics["perf/tokens_per_s"],
            self.version,
        )
        return metrics

    def train_passes(self, plan: StepPlan) -> dict[str, Any]:
        """One rank alone: ``ppo_epochs`` passes over the batch, each a backward and an update."""
        passes = []
        for _ in range(self.s.ppo_epochs):
            passes.append(self._backward(plan))
            passes[-1]["loss/grad_norm"] = self._update()
        return merge_passes(passes)

    def _backward(self, plan: StepPlan, total_tokens: float | None = None) -> dict[str, Any]:
        """One pass over this rank's share: gradients scaled so that the shares of all ranks add up to
        the token mean of the whole step (``total_tokens``: the step's trained tokens over every share).

        PPO epochs: the first pass records the policy's log-probabilities (π_prox, the policy at the
        start of the step) in ``plan.prox_logp``; later passes clip the ratio π_θ/π_prox around them,
        while the importance weight π_prox/π_behaviour keeps using the proxy's recorded log-probs, so
        w · ratio = π_θ/π_behaviour (until truncated) in every pass."""
        model = self.model
        batch = self._batch(plan)
        advantages = plan.advantages
        loss_fn = objective(self.s.algorithm)
        total_tokens = max(total_tokens if total_tokens is not None else batch.tokens, 1)
        first_pass = plan.prox_logp is None
        prox_logps: list[torch.Tensor] = [] if plan.prox_logp is None else plan.prox_logp
        sums = {"loss": 0.0, "pg": 0.0, "kl": 0.0, "entropy": 0.0, "is_weight": 0.0, "mismatch": 0.0,
                "clip_frac": 0.0}
        for index, lo in enumerate(range(0, len(batch), self.s.micro_batch)):
            micro = batch.slice(lo, lo + self.s.micro_batch)
            adv = advantages[lo : lo + self.s.micro_batch]
            logp, logits = token_logprobs(model, micro)
            if first_pass:
                prox_logps.append(logp.detach())
            prox = prox_logps[index]
            weight = micro.tokens / total_tokens  # micro-batches add up to the token mean of the batch
            if self.s.algorithm == "sft":
                pg = loss_fn(logp, micro.behaviour_logp, adv, micro.mask * adv[:, None],
                             aggregation=self.s.loss_aggregation)
            else:
                pg = loss_fn(logp, micro.behaviour_logp, adv, micro.mask, prox_logp=prox, clip_eps=self._clip(),
                             tis_cap=self.s.tis_cap, aggregation=self.s.loss_aggregation)
            mask = micro.mask
            entropy = (entropy_from_logits(logits) * mask).sum() / mask.sum().clamp(min=1)
            kl = torch.zeros(())
            if self.reference is not None:
                with torch.no_grad():
                    ref_logp, _ = token_logprobs(self.reference, micro)
                kl = (kl_to_reference(logp, ref_logp) * mask).sum() / mask.sum().clamp(min=1)
            loss = pg - self.s.ent_coef * entropy + self.s.kl_coef * kl
            (loss * weight).backward()
            with torch.no_grad():  # diagnostics: how far the proxy's log-probabilities are from ours
                gap = (logp - micro.behaviour_logp) * mask
                tokens = mask.sum().clamp(min=1)
                is_weight = (torch.exp(gap).clamp(max=self.s.tis_cap) * mask).sum() / tokens
                # tokens whose ratio to the step's start left the clip range (0 in a first pass)
                outside = ((logp - prox).exp() - 1).abs() > self._clip()
                sums["clip_frac"] += float((outside * mask).sum() / tokens) * weight
                sums["loss"] += float(loss) * weight
                sums["pg"] += float(pg) * weight
                sums["kl"] += float(kl) * weight
                sums["entropy"] += float(entropy) * weight
                sums["is_weight"] += float(is_weight) * weight
                sums["mismatch"] += float(gap.abs().sum() / tokens) * weight
        plan.prox_logp = prox_logps
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
        }

    def _batch(self, plan: StepPlan) -> TokenBatch:
        pad_id = getattr(self.model.config, "pad_token_id", None) or 0
        version_now = version_number(self.version)
        return make_batch(
            plan.samples, pad_id=pad_id, rewards=plan.rewards, group_keys=plan.group_keys,
            staleness=[version_now - version_number(s.model_version) for s in plan.samples],
        )

    def _clip(self) -> float:
        return math.inf if self.s.algorithm == "reinforce" else self.s.clip_eps

    def learning_rate(self, step: int) -> float:
        """Linear warm-up over lr_warmup_steps, then linear decay to lr_final over lr_decay_steps."""
        s = self.s
        if s.lr_warmup_steps and step < s.lr_warmup_steps:
            return s.learning_rate * (step + 1) / s.lr_warmup_steps
        if s.lr_decay_steps and s.lr_final is not None:
            done = min(1.0, (step - s.lr_warmup_steps) / s.lr_decay_steps)
            return s.learning_rate + (s.lr_final - s.learning_rate) * done
        return s.learning_rate

    def _update(self) -> float:
        """One optimizer update from the gradients in ``.grad`` (clipped); the caller counts the step
        once all of its PPO epochs are done. Returns the gradient norm before clipping."""
        norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.s.max_grad_norm))
        assert self.optimizer is not None
        # the schedule is a function of the step (every epoch of a step uses one rate): resumes exactly
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate(self.step)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm

    async def checkpoint(self) -> None:
        assert self.optimizer is not None
        checkpoint = ckpt.Checkpoint(self.step, self.version, self.consumed_since_checkpoint,
                                     {"metrics": self.unlogged} if self.rank == 0 else {})
        directory = self.s.checkpoint_dir / f"rank-{self.rank}"
        codec_state = self.ranks.codec.state_dict() if self.ranks is not None else None
        await asyncio.to_thread(ckpt.save, directory, checkpoint, self.model, self.optimizer, codec_state)
        await self.store.ack_samples(k.TRAINERS_GROUP, self.consumed_since_checkpoint)
        self.consumed_since_checkpoint = []
        if self.rank == 0:
            self._log_metrics(self.unlogged)
        self.unlogged = []

    def _log_metrics(self, lines: list[dict[str, Any]]) -> None:
        """Append the lines of steps the metrics file does not have yet (each step once)."""
        if self._logged_step is None:  # once per process: the last step the file has
            self._logged_step = 0
            if self.s.metrics_file.exists():
                with self.s.metrics_file.open() as f:
                    for raw in f:
                        if raw.strip():
                            self._logged_step = max(self._logged_step, int(json.loads(raw)["step"]))
        new = [line for line in lines if line["step"] > self._logged_step]
        if not new:
            return
        self.s.metrics_file.parent.mkdir(parents=True, exist_ok=True)
        with self.s.metrics_file.open("a") as f:
            for line in new:
                f.write(json.dumps(line) + "\n")
        self._logged_step = new[-1]["step"]
