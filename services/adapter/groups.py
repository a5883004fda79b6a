"""The post-rollout group step: train rollouts held until their whole group has ended (the rollouts
of one task, ``group_key``, as many as its ``group_size``), then rescored by the judge
(`fulmen_adapter.judge`) and written together as the adapter writes any batch.

Nothing is acknowledged while held: a held rollout's finished entries are acknowledged with its
samples, in the same step. A group that does not complete within the wait, or whose judging fails,
is written with its own rewards. Why: docs/design/adapter.md, "A judge for a whole group".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fulmen.records import RolloutFinished, RolloutForSamples, Span
from fulmen_adapter.judge import GroupJudge
from fulmen_adapter.triplets import Adapted

log = logging.getLogger(__name__)

WRITTEN_REMEMBERED = 65_536  # rollouts written lately: a late entry of one passes straight on
TRAIN_MODES = (None, "train")  # validation rollouts keep their own rewards: they measure the task's
# Adapter stats, each bumped once per group with the group's first rollout (so counted exactly once).
OUTCOME_STATS = {
    "judged": "judge/groups_judged",  # the judge scored it: its members' final rewards are the scores
    "failed": "judge/groups_failed",  # an error, a time-out, answers it could not read: own rewards
    "incomplete": "judge/groups_incomplete",  # not all its rollouts ended within the wait: own rewards
    "unjudged": "judge/groups_unjudged",  # none of its rollouts had a conversation to judge
}
RESCORED_STAT = "judge/rollouts_rescored"

Adapt = Callable[[RolloutForSamples], Adapted]
Write = Callable[[Sequence[Adapted], list[str]], Awaitable[None]]
DeadLetter = Callable[[str, str], Awaitable[None]]
GroupKey = Callable[[RolloutForSamples], str]
Record = Callable[[list[Span]], Awaitable[Any]]


@dataclass
class Group:
    key: str
    size: int
    since: float  # monotonic: when its first rollout came
    members: dict[str, RolloutForSamples] = field(default_factory=dict)
    entry_ids: dict[str, set[str]] = field(default_factory=dict)  # per rollout: its finished entries


class GroupStep:
    """Holds grouped train rollouts (`take`), judges each group once it is whole, and writes it.

    ``adapt`` turns one rollout into its records, ``write`` appends records and acknowledges entries
    in one step (the adapter's), ``dead_letter`` sets an entry aside with a reason, ``key`` names a
    rollout's group, ``record`` stores spans (the judge's)."""

    def __init__(self, judge: GroupJudge, adapt: Adapt, write: Write, dead_letter: DeadLetter, key: GroupKey,
                 record: Record) -> None:
        self.judge = judge
        self.wait_s = judge.config.wait_s
        self.adapt, self.write, self.dead_letter, self.key, self.record = adapt, write, dead_letter, key, record
        self.held: dict[str, Group] = {}  # by group key, still gathering
        self.busy: dict[str, Group] = {}  # by rollout id: being judged or written
        self.written: OrderedDict[str, None] = OrderedDict()
        self.tasks: set[asyncio.Task[None]] = set()

    def take(self, ready: dict[str, RolloutForSamples], entries: Sequence[RolloutFinished]) -> list[RolloutFinished]:
        """Take the grouped train rollouts out of ``ready`` (adapted rollouts by id) and hold them with
        their entries; returns the entries of the rest, for the caller to write and acknowledge.
        A group that is whole now is judged and written in a task of its own."""
        by_rollout: dict[str, list[str]] = {}
        for entry in entries:
            by_rollout.setdefault(entry.rollout_id, []).append(entry.entry_id)
        now = time.monotonic()
        for rid in [rid for rid, r in ready.items() if self._grouped(r)]:
            rollout = ready.pop(rid)
            busy = self.busy.get(rid)
            if busy is not None:  # a redelivery while its group is judged: acknowledged with it
                busy.entry_ids.setdefault(rid, set()).update(by_rollout.get(rid, ()))
                continue
            key = self.key(rollout)
            group = self.held.get(key)
            if group is None:
                group = self.held[key] = Group(key, rollout.metadata["group_size"], now)
            group.members[rid] = rollout
            group.entry_ids.setdefault(rid, set()).update(by_rollout.get(rid, ()))
            if len(group.members) >= group.size:
                self._start(self.held.pop(key), complete=True)
        return [e for e in entries if e.rollout_id in ready]

    def _grouped(self, rollout: RolloutForSamples) -> bool:
        size = rollout.metadata.get("group_size")
        return (rollout.mode in TRAIN_MODES and isinstance(size, int) and not isinstance(size, bool) and size >= 1
                and rollout.rollout_id not in self.written)

    def expire(self, now: float | None = None) -> int:
        """Write the groups held longer than the wait with their own rewards; how many."""
        now = time.monotonic() if now is None else now
        late = [key for key, g in self.held.items() if now - g.since >= self.wait_s]
        for key in late:
            group = self.held.pop(key)
            log.warning("group %s: %d of %d rollouts ended within %.0f s; written with their own rewards",
                        key, len(group.members), group.size, self.wait_s)
            self._start(group, complete=False)
        return len(late)

    async def watch(self, stop: asyncio.Event) -> None:
        """`expire` a few times per wait until ``stop``."""
        interval_s = min(1.0, self.wait_s / 4)
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), interval_s)
            except TimeoutError:
                self.expire()

    async def drain(self) -> None:
        """Write every held group as it is (own rewards) and wait for every group in flight."""
        for key in list(self.held):
            self._start(self.held.pop(key), complete=False)
        while self.tasks:
            await asyncio.gather(*self.tasks, return_exceptions=True)

    async def close(self) -> None:
        """Stop: groups in flight are cancelled and the held ones dropped, their entries left pending
        (another adapter, or this one restarted, takes them over once idle)."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self.held.clear()
        self.busy.clear()
        await self.judge.close()

    def _start(self, group: Group, complete: bool) -> None:
        for rid in group.members:
            self.busy[rid] = group
        task = asyncio.create_task(self._finish(group, complete), name=f"group-{group.key}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _finish(self, group: Group, complete: bool) -> None:
        """Judge a group (a whole one), then write its members' records and acknowledge their entries."""
        try:
            judged = await self.judge.rewards(group.key, list(group.members.values())) if complete else None
            rewards = judged.rewards if judged is not None else {}
            if judged is not None and judged.span is not None:
                await self._record(judged.span)
            adapted = await self._adapted(group, rewards)
            if adapted:
                stats: dict[str, Any] = adapted[0].stats
                stats[OUTCOME_STATS[judged.outcome if judged is not None else "incomplete"]] = 1
                if rewards:
                    stats[RESCORED_STAT] = len(rewards)
            entry_ids = [e for rid in group.members for e in group.entry_ids.get(rid, ())]
            await self.write(adapted, entry_ids)
            for rid in group.members:
                self.written[rid] = None
            while len(self.written) > WRITTEN_REMEMBERED:
                self.written.popitem(last=False)
        except asyncio.CancelledError:
            raise
        except Exception:  # Redis, most likely: the entries stay pending, and are taken over once idle
            log.exception("could not write group %s (%d rollouts); its entries stay pending", group.key,
                          len(group.members))
        finally:
            for rid in group.members:
                self.busy.pop(rid, None)

    async def _record(self, span: Span) -> None:
        """Store the judge's span in its rollout's trace; a failure costs the span, not the group."""
        try:
            await self.record([span])
        except Exception as e:
            log.warning("the judge's span for rollout %s was not stored: %s: %s", span.rollout_id, type(e).__name__, e)

    async def _adapted(self, group: Group, rewards: dict[str, float]) -> list[Adapted]:
        """Each member's records, with the judge's final reward where it has one. A member whose
        adapting fails is dead-lettered with the reason (as a batch's would be) and left out."""
        out = []
        for rid, rollout in sorted(group.members.items()):
            try:
                out.append(self.adapt(rollout._replace(reward=rewards[rid]) if rid in rewards else rollout))
            except Exception as e:
                reason = f"could not adapt rollout {rid}: {type(e).__name__}: {e}"
                log.exception("%s", reason)
                for entry_id in group.entry_ids.pop(rid, ()):
                    await self.dead_letter(entry_id, reason)
        return out
