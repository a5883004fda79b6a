"""The same codecs as a torch.distributed DDP communication hook (for ranks on a fast network).

`make_ddp_hook(name, **knobs)` gives ``(state, hook)``: in, one bucket's flat local gradients; out, a
future of their world-size average; the bucket buffer is modified in place. ``none`` / ``bf16``
divide before the all-reduce, the others use `mean_decoded`. More: docs/design/trainer.md.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations at runtime
# (`bucket: dist.GradBucket`, `-> torch.futures.Future[torch.Tensor]`), so they must be real objects.

import copy
import struct
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from fulmen.errors import InvalidInput
from fulmen_trainer.distributed.codecs.aggregate import mean_decoded
from fulmen_trainer.distributed.codecs.base import CodecState, make_codec

__all__ = ["DDPCodecState", "codec_hook", "make_ddp_hook"]


class DDPCodecState:
    """Knobs: ``codec`` (a `CodecState`), ``process_group`` (None = the default group), ``start_iter``.
    State: ``iter`` and the codec's own state. Statistics: `compression_stats` (the codec's)."""

    def __init__(
        self, codec: CodecState, process_group: dist.ProcessGroup | None = None, start_iter: int = 1,
        policy: Any = None,
    ) -> None:
        if not isinstance(codec, CodecState):
            raise InvalidInput(f"codec must be a CodecState, got {type(codec).__name__}")
        if not isinstance(start_iter, int) or start_iter < 0:
            raise InvalidInput(f"start_iter must be a non-negative int, got {start_iter!r}")
        self.codec = codec
        self.process_group = process_group
        self.start_iter = start_iter
        self.iter = 0
        self.policy = policy  # a SyncPolicy: the template of each bucket's own
        self.policies: dict[int, Any] = {}
        self.step = 0
        self.sent: list[tuple[bool, float]] = []  # (compressed, cosine) per bucket since the last stats

    def compression_stats(self, reset: bool = False) -> dict[str, float]:
        stats = self.codec.compression_stats(reset)
        if self.sent:
            stats["comm/cosine"] = sum(c for _, c in self.sent) / len(self.sent)
            stats["comm/uncompressed"] = sum(1.0 for compressed, _ in self.sent if not compressed) / len(self.sent)
        if reset:
            self.sent = []
        return stats

    def bucket_policy(self, index: int) -> Any:
        if index not in self.policies:
            self.policies[index] = copy.deepcopy(self.policy)
        return self.policies[index]

    def state_dict(self) -> dict[str, Any]:
        return {"iter": self.iter, "start_iter": self.start_iter, "codec": self.codec.state_dict(),
                "policies": {str(i): p.state_dict() for i, p in self.policies.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.iter = int(state["iter"])
        self.start_iter = int(state["start_iter"])
        self.codec.load_state_dict(state["codec"])
        if self.policy is not None:
            for index, policy in state.get("policies", {}).items():
                self.bucket_policy(int(index)).load_state_dict(policy)

    def _advance(self, bucket: dist.GradBucket) -> None:
        if bucket.is_last():
            self.iter += 1


def make_ddp_hook(
    codec_name: str, process_group: dist.ProcessGroup | None = None, start_iter: int = 1, **knobs: Any
) -> tuple["DDPCodecState", Callable[..., torch.futures.Future[torch.Tensor]]]:
    """A fresh ``(state, hook)`` pair for ``ddp_model.register_comm_hook(state, hook)``; ``knobs`` go to
    ``make_codec(codec_name, **knobs)``."""
    return DDPCodecState(make_codec(codec_name, **knobs), process_group, start_iter), codec_hook


def codec_hook(state: DDPCodecState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket``'s gradients over the group through ``state.codec``; see the module docstring."""
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world_size = dist.get_world_size(group)
    buffer = bucket.buffer()
    name = state.codec.name
    if state.iter < state.start_iter or name == "none":
        future = _allreduce_mean(buffer, buffer, group, world_size)
    elif state.policy is not None:
        future = _with_policy(state, bucket, buffer, group, world_size)
    elif name == "bf16":
        future = _allreduce_mean(buffer, buffer.to(torch.bfloat16), group, world_size)
    else:
        chunks = state.codec.encode(
            buffer, name=f"bucket{bucket.index()}", step=state.iter, rank=dist.get_rank(group)
        )
        future = _allgather_mean(buffer, chunks, group, world_size)
    state._advance(bucket)
    return future


def _with_policy(
    state: DDPCodecState, bucket: dist.GradBucket, buffer: torch.Tensor, group: Any, world_size: int
) -> torch.futures.Future[torch.Tensor]:
    """One bucket under its sync policy (see the module docstring)."""
    from fulmen_trainer.distributed.codecs.aggregate import sum_decoded
    from fulmen_trainer.distributed.codecs.base import with_density

    policy = state.bucket_policy(bucket.index())
    norm = float(buffer.norm())
    decision = policy.decide(state.step, norm, getattr(state.codec, "density", None))
    flags = torch.tensor([float(not decision.compress), float(decision.flush)], device=buffer.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)  # every rank calls the same collective
    name = f"bucket{bucket.index()}"
    uncompressed, flush = (bool(f > 0) for f in flags.tolist())
    if uncompressed:
        residual = state.codec.flush(name) if flush else None
        if residual is not None:
            buffer.add_(residual.view_as(buffer).to(buffer.device, buffer.dtype))
        policy.observe(norm, None)
        state.sent.append((False, 1.0))
        return _allreduce_mean(buffer, buffer, group, world_size)
    true = buffer.detach().to("cpu", torch.float32, copy=True).view(-1)
    with with_density(state.codec, decision.density):
        chunks = state.codec.encode(buffer, name=name, step=state.iter, rank=dist.get_rank(group))
    sent = sum_decoded([chunks]).view(-1)
    cos = float(torch.nn.functional.cosine_similarity(sent, true, dim=0)) if true.any() else 1.0
    policy.observe(norm, cos)
    state.sent.append((True, cos))
    return _allgather_mean(buffer, chunks, group, world_size)


def _allreduce_mean(
    buffer: torch.Tensor, wire: torch.Tensor, group: Any, world_size: int
) -> torch.futures.Future[torch.Tensor]:
    # Divide before the all-reduce, as allreduce_hook does: a bf16 sum of world_size values stays in range.
    wire.div_(world_size)
    work = dist.all_reduce(wire, group=group, async_op=True)

    def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.wait()
        return buffer if wire is buffer else buffer.copy_(wire)

    return work.get_future().then(done)


def _allgather_mean(
    buffer: torch.Tensor, chunks: list[bytes], group: Any, world_size: int
) -> torch.futures.Future[torch.Tensor]:
    # One blob per rank: u32 chunk count, u32 length per chunk, then the chunks back to back.
    blob = struct.pack(f"<I{len(chunks)}I", len(chunks), *(len(c) for c in chunks)) + b"".join(chunks)
    device = buffer.device
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([len(blob)], dtype=torch.int64, device=device), group=group)
    lengths = [int(n) for n in torch.cat(sizes).tolist()]
    longest = max(lengths)
    staged = torch.zeros(longest, dtype=torch.uint8)
    staged.numpy()[: len(blob)] = np.frombuffer(blob, dtype=np.uint8)
    mine = staged.to(device)
    gathered = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world_size)]
    work = dist.all_gather(gathered, mine, group=group, async_op=True)

    def done(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.wait()
        blobs = torch.stack(gathered).cpu().numpy()
        lists = [_split_blob(row.tobytes()[:n]) for row, n in zip(blobs, lengths, strict=True)]
        mean = mean_decoded(lists)
        return buffer.copy_(mean.view(-1).view_as(buffer))

    return work.get_future().then(done)


def _split_blob(blob: bytes) -> list[bytes]:
    (count,) = struct.unpack_from("<I", blob)
    lengths = struct.unpack_from(f"<{count}I", blob, 4)
    position = 4 + 4 * count
    chunks = []
    for length in lengths:
        chunks.append(blob[position : position + length])
        position += length
    return chunks
