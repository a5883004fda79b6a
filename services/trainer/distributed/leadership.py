"""The leader of the trainer ranks: a lease in Redis with a fencing epoch, the one write that makes a
step agreed, and the sample entries a new leader takes over.

The lease is a key with a TTL that the leader renews every heartbeat; each new lease takes the next
epoch of a counter. A step is agreed once its `AgreedStep` is on the agreed-steps stream, written by a
script that first checks the writer still holds its lease: a leader that lost it (paused past its TTL)
can never agree a step again. Who takes over, and from what: docs/design/trainer.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from fulmen import keys as k
from fulmen.errors import RecordError
from fulmen.records.ranks import AgreedStep
from fulmen.store import RedisStore
from fulmen.store.redis.stream import entry_id_text
from fulmen.store.samples import SampleEntry

log = logging.getLogger(__name__)

AGREED_MAXLEN = 10_000  # agreed steps kept (approximately): far more than a checkpoint interval
AGREED_PAGE = 100  # records per XREVRANGE when a new leader looks back
PENDING_PAGE = 1000  # pending entries per XPENDING when a new leader takes them over

# KEYS[1] = the lease, KEYS[2] = the epoch counter; ARGV[1] = "<rank>:<token>", ARGV[2] = TTL ms.
# Returns the new lease's epoch, or 0 if another process holds the lease.
_ACQUIRE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
local epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], epoch .. ':' .. ARGV[1], 'PX', ARGV[2])
return epoch
"""
# KEYS[1] = the lease; ARGV[1] = our lease's value, ARGV[2] = TTL ms. Returns 1 if the lease is still
# ours (renewed), 0 if it expired or another process took it: an expired lease is never taken back,
# since a rank may have taken over (and read the agreed steps) in between.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end
return 0
"""
# KEYS[1] = the lease, KEYS[2] = the agreed-steps stream; ARGV[1] = our lease's value, ARGV[2] = the
# AgreedStep record, ARGV[3] = the stream's cap. Returns 1 if the step is agreed (written), 0 if the
# lease is not ours (nothing written).
_AGREE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', 'm', ARGV[2])
return 1
"""
# KEYS[1] = the lease; ARGV[1] = our lease's value. Deletes it if still ours (a clean exit hands over
# at once instead of after the TTL). Returns 1 if deleted.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True, slots=True)
class Lease:
    """Who leads: the lease's epoch (its fencing token) and the leader's rank."""

    epoch: int
    rank: int

    @classmethod
    def parse(cls, value: bytes | str) -> Lease | None:
        text = value.decode() if isinstance(value, bytes) else value
        epoch, _, rest = text.partition(":")
        rank = rest.partition(":")[0]
        return cls(int(epoch), int(rank)) if epoch.isdigit() and rank.isdigit() else None


class Leadership:
    """This process's side of the lease: take it, renew it, agree steps under it, hand it back."""

    def __init__(self, store: RedisStore, token: str, ttl_s: float) -> None:
        self.store = store
        self.keys = store.keys
        self.token = token
        self.ttl_ms = int(ttl_s * 1000)
        self.value: str | None = None  # our lease's value while we hold one
        self.epoch = 0
        redis = store.redis
        self._acquire, self._renew = redis.register_script(_ACQUIRE), redis.register_script(_RENEW)
        self._agree, self._release = redis.register_script(_AGREE), redis.register_script(_RELEASE)

    async def holder(self) -> Lease | None:
        """The lease in force, or None (it expired, or nobody ever led)."""
        value = await self.store.redis.get(self.keys.trainer_leader)
        return Lease.parse(value) if value is not None else None

    async def acquire(self, rank: int) -> int | None:
        """Take the lease if nobody holds it: its epoch, or None."""
        epoch = int(await self._acquire(keys=[self.keys.trainer_leader, self.keys.trainer_leader_epoch],
                                        args=[f"{rank}:{self.token}", self.ttl_ms]))
        if not epoch:
            return None
        self.epoch, self.value = epoch, f"{epoch}:{rank}:{self.token}"
        log.info("trainer rank %d leads (lease epoch %d)", rank, epoch)
        return epoch

    async def renew(self) -> bool:
        """Keep the lease for another TTL; False once it is lost (we must step down)."""
        if self.value is None:
            return False
        if int(await self._renew(keys=[self.keys.trainer_leader], args=[self.value, self.ttl_ms])):
            return True
        log.error("lost the trainer leader's lease (epoch %d): stepping down", self.epoch)
        self.value = None
        return False

    async def agree(self, record: AgreedStep) -> bool:
        """Write ``record``, the step's commit, if we still hold the lease; False: refused, not agreed."""
        if self.value is None:
            return False
        return bool(await self._agree(keys=[self.keys.trainer_leader, self.keys.trainer_agreed],
                                      args=[self.value, record.to_wire(), AGREED_MAXLEN]))

    async def release(self) -> None:
        if self.value is not None:
            await self._release(keys=[self.keys.trainer_leader], args=[self.value])
            self.value = None

    async def agreed_back_to(self, lowest_step: int) -> list[AgreedStep]:
        """The agreed steps, newest first, back to the first whose step is ``lowest_step`` or lower."""
        out: list[AgreedStep] = []
        end = "+"
        while True:
            page = await self.store.redis.xrevrange(self.keys.trainer_agreed, max=end, count=AGREED_PAGE)
            for entry_id, fields in page:
                try:
                    out.append(AgreedStep.from_wire(fields.get(b"m")))
                except RecordError as e:
                    log.warning("skipping %s entry %s: %s", self.keys.trainer_agreed, entry_id_text(entry_id), e)
                    continue
                if out[-1].step <= lowest_step:
                    return out
            if len(page) < AGREED_PAGE:
                return out
            end = "(" + entry_id_text(page[-1][0])


async def claim_pending(store: RedisStore, consumer: str, *, min_idle_ms: int = 0,
                        others_only: bool = False) -> list[SampleEntry]:
    """Take every sample entry pending in the trainers' group (read by a leader, never acknowledged)
    for ``consumer``, oldest first, decoded; an entry deleted since is skipped. ``min_idle_ms`` and
    ``others_only``: only those idle that long in another consumer's hands (a deposed leader's)."""
    group = store.samples.group(k.TRAINERS_GROUP)
    out: list[SampleEntry] = []
    start = "-"
    while True:
        rows = await store.redis.xpending_range(store.keys.samples, k.TRAINERS_GROUP, min=start, max="+",
                                                count=PENDING_PAGE, idle=min_idle_ms or None)
        ids = [row["message_id"] for row in rows
               if not (others_only and _text(row["consumer"]) == consumer)]
        if ids:
            claimed = await store.redis.xclaim(store.keys.samples, k.TRAINERS_GROUP, consumer, min_idle_ms, ids)
            out += await group.decode_entries([c for c in claimed if c and c[0] is not None and c[1] is not None])
        if len(rows) < PENDING_PAGE:
            return out
        start = "(" + _text(rows[-1]["message_id"])


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
