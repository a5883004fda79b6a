"""What to enqueue and when: GRPO groups, backpressure, the staleness bound, and resuming from the store.

Enqueuing is idempotent (stable rollout ids) and the run's position lives in the store. The pacing
rules and why: docs/design/algorithm.md.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fulmen import keys as k
from fulmen.records import RolloutConfig
from fulmen.records.status import RolloutMode
from fulmen.serving.lag import VersionSteps, served_step
from fulmen.store import RedisStore
from fulmen.telemetry.steps import UntrainedGroups, latest_step
from fulmen.versions.model_version import POLICY_RESOURCES_ID
from fulmen_algorithm.dataset import Task, task_id

log = logging.getLogger(__name__)

FINISHED_READ_COUNT = 500  # finished rollouts per read; the loop reads until none are left
# Dynamic sampling (DAPO) replaces each group it leaves out; at most this many rounds of them per
# round trained (verl's max_num_gen_batches is 10 by default), so a policy that solves or fails
# every task does not sample without end.
FILTERED_ROUNDS = 10


def recoverable_rollout_config(unresponsive_s: float = 30.0, max_attempts: int = 3) -> RolloutConfig:
    """The retry policy of the rollouts the algorithm enqueues (train and validation). Without a
    heartbeat deadline the watchdog can never take
    back the attempts of a runner that died (SIGKILL, OOM, a lost node): they would stay "running"
    forever, their groups would never complete, and the run would wait on them. With one, a dead
    runner's attempts end as unresponsive and are retried on another runner."""
    return RolloutConfig(unresponsive_seconds=unresponsive_s, max_attempts=max_attempts,
                         retry_condition=("unresponsive", "timeout"))


@dataclass
class RunState:
    epoch: int = 0
    cursor: int = 0  # next task (in this epoch's order)
    groups: int = 0  # groups enqueued over the whole run
    enqueued: int = 0  # train rollouts enqueued over the whole run

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> RunState:
        return cls(**{f: int(raw.get(f.encode(), 0)) for f in ("epoch", "cursor", "groups", "enqueued")})


@dataclass(frozen=True)
class SchedulerOptions:
    """What the scheduler enqueues and when (the algorithm's settings of the same names)."""

    n_samples: int = 8  # rollouts per task: one group
    groups_per_step: int = 8
    max_inflight: int = 256  # rollouts queued or running at once
    staleness: int = 0  # rounds of groups enqueued ahead of the trainer step every server serves
    epochs: int | None = None  # None: no end by epochs
    seed: int = 0  # the task order of each epoch
    stall_s: float = 3.0  # the trainer still this long with nothing in flight: one extra group
    total_steps: int | None = None  # no group enqueued for rounds past this trainer step


class Scheduler:
    def __init__(
        self,
        store: RedisStore,
        tasks: Sequence[Task],
        options: SchedulerOptions,
        *,
        run: str = "run",
        resources_id: str = POLICY_RESOURCES_ID,
        rollout_config: RolloutConfig | None = None,
    ) -> None:
        if options.max_inflight < options.n_samples:
            raise ValueError(
                f"max_inflight ({options.max_inflight}) must hold at least one group of {options.n_samples}"
            )
        self.store = store
        self.tasks = list(tasks)
        self.run = run
        self.n = options.n_samples
        self.groups_per_step = options.groups_per_step
        self.max_inflight = options.max_inflight
        self.staleness = options.staleness
        self.epochs = options.epochs
        self.seed = options.seed
        self.resources_id = resources_id
        self.rollout_config = rollout_config or recoverable_rollout_config()
        self.stall_s = options.stall_s
        self.total_steps = options.total_steps
        self.state = RunState()
        self._order: list[int] = []
        self._order_epoch = -1
        self._last_step = -1
        self._step_changed_at = time.monotonic()
        self.untrained = UntrainedGroups(store.redis, store.keys, f"{run}-e")
        self.filtered = UntrainedGroups(store.redis, store.keys, f"{run}-e", filtered=True)
        self.version_steps = VersionSteps()  # the trainer step of each version the servers serve
        self._last_served: int | None = None  # the served step last reported by some server
        self._unserved_logged = False  # said once that no server reports what it serves
        self._capped_at = -1  # the trainer step at which replacing untrained groups last hit its cap
        self._filter_capped_at = -1  # ... and replacing the groups dynamic sampling left out

    # --- state in the store ---------------------------------------------------------------------

    async def load(self) -> RunState:
        self.state = RunState.from_hash(await self.store.redis.hgetall(self.store.keys.algorithm_state))
        await self.store.finished.ensure_finished_group(k.ALGORITHM_GROUP)
        # Completions a killed predecessor read but did not acknowledge are pending under our consumer
        # name, and a read of new entries never returns them: count them now, or their rollouts stay
        # "in flight" for the rest of the run (backpressure shrinks, an epoch-bounded run never ends).
        await self.count_finished(pending=True)
        if self.state.groups:
            log.info("resuming the run: epoch %d, task %d of %d, %d groups enqueued so far",
                     self.state.epoch, self.state.cursor, len(self.tasks), self.state.groups)
        return self.state

    def order(self, epoch: int) -> list[int]:
        """This epoch's task order: a shuffle that depends only on the seed and the epoch."""
        if self._order_epoch != epoch:
            self._order = list(range(len(self.tasks)))
            random.Random(f"{self.seed}-{epoch}").shuffle(self._order)
            self._order_epoch = epoch
        return self._order

    # --- what the rest of the pipeline says ---------------------------------------------------------

    async def trainer_step(self) -> int:
        """The trainer's progress: optimizer steps taken, from its steps stream (0 before the first)."""
        step = await latest_step(self.store.redis, self.store.keys)
        if step != self._last_step:
            self._last_step, self._step_changed_at = step, time.monotonic()
        return step

    async def count_finished(self, block_s: float | None = None, *, pending: bool = False) -> int:
        """Read the finished stream: train rollouts of this run that ended are counted once each.
        ``block_s``: wait that long for the first completion (the run loop's pause between fills).
        ``pending``: instead, the entries read before a restart and never acknowledged."""
        done = 0
        while True:
            batch = await self.store.finished.read_finished(
                k.ALGORITHM_GROUP, "algorithm", count=FINISHED_READ_COUNT, block_s=block_s, pending=pending
            )
            block_s = None
            if not batch:
                return done
            ours = await self._known([c.rollout_id for c in batch if c.rollout_id.startswith(self.run + "-e")])
            if ours:
                done += await self.store.redis.sadd(self.store.keys.algorithm_done, *ours)
            await self.store.finished.ack_finished(k.ALGORITHM_GROUP, [c.entry_id for c in batch])

    async def _known(self, rollout_ids: list[str]) -> list[str]:
        """The ids of rollouts the store holds: an entry naming one it does not (forged, or deleted)
        is not counted as done, which would enqueue more than ``max_inflight``. It is left to the
        adapter, which dead-letters it once for everyone, rather than dead-lettered once per group."""
        if not rollout_ids:
            return []
        rollouts = await self.store.rollouts.get_rollouts(rollout_ids)
        unknown = [rid for rid, r in zip(rollout_ids, rollouts, strict=True) if r is None]
        if unknown:
            log.warning("finished entries name %d rollout(s) of this run the store does not hold (%s): not counted",
                        len(unknown), ", ".join(unknown[:3]))
        return [rid for rid, r in zip(rollout_ids, rollouts, strict=True) if r is not None]

    async def inflight(self) -> int:
        return self.state.enqueued - await self.store.redis.scard(self.store.keys.algorithm_done)

    # --- enqueuing ----------------------------------------------------------------------------------

    async def replaceable(self, trainer_step: int) -> int:
        """The untrained groups to replace: the lost ones (failed, too stale) up to (trainer_step + 1)
        rounds, and those dynamic sampling left out (rewards all equal: DAPO samples more until a
        step is full) up to `FILTERED_ROUNDS` times as many."""
        untrained, filtered = await self.untrained.count(), await self.filtered.count()
        cap = (trainer_step + 1) * self.groups_per_step
        if untrained > cap and self._capped_at != trainer_step:
            self._capped_at = trainer_step
            log.warning("the trainer took %d groups without training on them, more than it trained on: no "
                        "more are replaced until it steps (its log and `fulmen top` say why: rollouts "
                        "failing, samples too stale)", untrained)
        if filtered > FILTERED_ROUNDS * cap and self._filter_capped_at != trainer_step:
            self._filter_capped_at = trainer_step
            log.warning("dynamic sampling left out %d groups whose rewards were all equal, %d times the groups "
                        "trained on: the tasks are all solved or all failed at the policy's level; no more are "
                        "replaced until the trainer steps", filtered, FILTERED_ROUNDS)
        return min(untrained, cap) + min(filtered, FILTERED_ROUNDS * cap)

    @property
    def exhausted(self) -> bool:
        return self.epochs is not None and self.state.epoch >= self.epochs

    def _allowed_groups(self, served: int, untrained: int) -> int:
        """Groups allowed so far: the rounds for trainer steps up to ``served`` (the step whose weights
        every server serves) plus ``staleness`` more, and the untrained groups to replace."""
        rounds = served + self.staleness + 1
        if self.total_steps is not None:  # rounds past the last step would train the trainer past it
            rounds = min(rounds, self.total_steps)
        return rounds * self.groups_per_step + untrained

    async def served(self, trained: int) -> int:
        """The trainer step whose weights every model server serves, at most ``trained``: a round waits
        for the servers to load the weights, not only for the trainer to step. When no server reports
        a version: the last one reported (a proxy restarting catches up before it registers again), or,
        if none ever did (only proxies that forward upstream), ``trained``, with a warning once."""
        served = await served_step(self.store, self.version_steps)
        if served is not None:
            self._last_served = served
        elif self._last_served is None and trained > 0 and not self._unserved_logged:
            self._unserved_logged = True
            log.warning("no torch proxy nor vLLM replica kept in step by vllm-sync reports the model version it "
                        "serves: rounds follow the trainer's steps, and rollouts may run on weights it never "
                        "published (`fulmen status` lists the servers)")
        known = served if served is not None else self._last_served
        return min(trained, known if known is not None else trained)

    async def fill(self) -> int:
        """Enqueue every group pacing allows now. Returns how many groups were enqueued."""
        await self.count_finished()
        trained = await self.trainer_step()
        if self.total_steps is not None and trained >= self.total_steps:
            return 0  # the run is over: not even a top-up
        served = await self.served(trained)
        untrained = await self.replaceable(served)
        added = 0
        while not self.exhausted:
            inflight = await self.inflight()
            if inflight + self.n > self.max_inflight:
                break
            gated = self.state.groups >= self._allowed_groups(served, untrained)
            stalled = inflight == 0 and time.monotonic() - self._step_changed_at > self.stall_s
            if gated and not stalled:
                break
            await self.enqueue_group()
            added += 1
            if gated:  # a top-up: one group, then wait for the trainer again
                self._step_changed_at = time.monotonic()
                log.info("the trainer has not moved for %.0f s with nothing in flight: enqueued one extra group",
                         self.stall_s)
                break
        return added

    async def enqueue_group(self) -> list[str]:
        s = self.state
        task = self.tasks[self.order(s.epoch)[s.cursor]]
        tid = task_id(task)
        group = f"e{s.epoch}-{tid}"
        rollouts = [
            self.store.rollouts.new_rollout(
                task,
                rollout_id=f"{self.run}-{group}-{i}",
                mode=RolloutMode.TRAIN,
                resources_id=self.resources_id,
                config=self.rollout_config,
                metadata={"group_key": f"{self.run}-{group}", "group_size": self.n, "epoch": s.epoch},
            )
            for i in range(self.n)
        ]
        await self.store.rollouts.enqueue_rollouts(rollouts)  # idempotent: a replay after a crash adds nothing
        cursor, epoch = s.cursor + 1, s.epoch
        if cursor >= len(self.tasks):
            cursor, epoch = 0, epoch + 1
        s.epoch, s.cursor, s.groups, s.enqueued = epoch, cursor, s.groups + 1, s.enqueued + self.n
        await self.store.redis.hset(
            self.store.keys.algorithm_state,
            mapping={"epoch": s.epoch, "cursor": s.cursor, "groups": s.groups, "enqueued": s.enqueued},
        )
        return [r.rollout_id for r in rollouts]

    def snapshot(self) -> dict[str, Any]:
        return {"epoch": self.state.epoch, "cursor": self.state.cursor, "groups": self.state.groups,
                "enqueued": self.state.enqueued}
