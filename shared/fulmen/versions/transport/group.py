"""A full version's tensors by broadcast over a torch process group: from a sender (rank 0) into the
workers of a vLLM server (ranks 1..), each tensor straight into the model's weights.

gloo between CPUs, NCCL between GPUs (`backend_for`). Only torch, the standard library and the manifest's
hash, so that vLLM's own venv imports it (with ``shared/`` on its PYTHONPATH): `WorkerExtension` is the server's ``--worker-extension-cls``, its methods
called over ``POST /collective_rpc``. How a swap drives it: docs/design/vllm-sync.md.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from fulmen.versions.manifest import tensor_sha256

PREFIX = "fulmen-weights"
SAMPLED_CHECKS = 8  # tensors whose sha256 the receivers check by default (the largest and a random few)


class GroupError(Exception):
    """The group could not be joined, or what arrived is not what was sent (the message says which)."""


@dataclass(frozen=True)
class TensorSpec:
    """One tensor as both sides iterate it: its name, dtype and shape (JSON: [name, dtype, shape])."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def to_json(self) -> list[Any]:
        return [self.name, self.dtype, list(self.shape)]

    @classmethod
    def from_json(cls, value: list[Any]) -> TensorSpec:
        name, dtype, shape = value
        return cls(str(name), str(dtype), tuple(int(n) for n in shape))

    def empty(self, device: torch.device | str) -> torch.Tensor:
        return torch.empty(self.shape, dtype=getattr(torch, self.dtype), device=device)


def specs_of(state: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in state.items()]


def backend_for(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def join(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    """This process's member of a group of ``world_size`` whose rank 0 listens at ``host:port`` (a
    TCPStore it serves). Apart from torch.distributed's default group, which vLLM's workers use for
    their own. Blocks until every rank has joined or ``timeout_s`` passed (GroupError)."""
    timeout = timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore(PREFIX, store)
        if backend == "gloo":
            return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()  # type: ignore[attr-defined]  # CUDA builds only
            options._timeout = timeout
            return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)  # type: ignore[attr-defined]
    except (RuntimeError, dist.DistStoreError) as e:
        raise GroupError(f"rank {rank} of {world_size} could not join the weight group at {host}:{port} "
                         f"({backend}) within {timeout_s} s: {e}") from None
    raise GroupError(f"weight group backend {backend!r} unknown; use gloo or nccl")


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def send(group: Any, state: Mapping[str, torch.Tensor], specs: Iterable[TensorSpec]) -> int:
    """Broadcast ``state``'s tensors in the order of ``specs`` (what the receivers were told); the bytes."""
    sent = 0
    for spec in specs:
        tensor = state[spec.name].detach().contiguous()
        broadcast(group, tensor)
        sent += tensor.numel() * tensor.element_size()
    return sent


def receive(group: Any, specs: Iterable[TensorSpec], device: torch.device | str) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors rank 0 broadcasts, in the order of ``specs``."""
    for spec in specs:
        tensor = spec.empty(device)
        broadcast(group, tensor)
        yield spec.name, tensor


def sampled_names(specs: list[TensorSpec], count: int = SAMPLED_CHECKS, seed: str = "") -> list[str]:
    """The tensors to check by sha256 when not all are: the largest, then a random few (seeded by the
    version, so every receiver of it checks the same ones); all of them when ``count`` < 0."""
    if count < 0 or count >= len(specs):
        return [s.name for s in specs]
    if count == 0:
        return []
    largest = max(specs, key=lambda s: _numel(s.shape))
    others = [s.name for s in specs if s.name != largest.name]
    return [largest.name, *random.Random(seed).sample(others, count - 1)]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class WorkerExtension:
    """Methods added to each vLLM worker (``--worker-extension-cls
    fulmen.versions.transport.group.WorkerExtension``), called by ``POST /collective_rpc`` on every
    worker at once; JSON in, JSON out."""

    fulmen_group: Any = None

    def fulmen_join(self, host: str, port: int, world_size: int, backend: str = "", rank_offset: int = 1,
                    timeout_s: float = 60.0) -> dict[str, Any]:
        """Join the sender's group as rank ``rank_offset`` + this worker's rank in the server."""
        if self.fulmen_group is not None:
            self.fulmen_leave()
        rank = rank_offset + self.fulmen_worker_rank()
        self.fulmen_group = join(host, port, rank, world_size, backend or backend_for(self.fulmen_device()), timeout_s)
        return {"rank": rank, "world_size": world_size}

    def fulmen_leave(self) -> None:
        self.fulmen_group = None  # the group's sockets close with it

    def fulmen_receive(self, specs: list[list[Any]] | str, checks: Mapping[str, str] | str | None = None
                       ) -> dict[str, Any]:
        """Receive every tensor of ``specs`` (in that order; a list or its JSON) straight into the
        model's weights, as they arrive (`fulmen_load`). The tensors named in ``checks`` (name → sha256)
        must match: a mismatch is a GroupError once every tensor has arrived (the group stays usable,
        the weights are then wrong, and the caller loads the version another way)."""
        if self.fulmen_group is None:
            raise GroupError("this worker has not joined a weight group (fulmen_join first)")
        wanted = [TensorSpec.from_json(v) for v in (json.loads(specs) if isinstance(specs, str) else specs)]
        expected = dict(json.loads(checks) if isinstance(checks, str) else checks or {})
        wrong: list[str] = []
        size = 0

        def arriving() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal size
            for name, tensor in receive(self.fulmen_group, wanted, self.fulmen_device()):
                if name in expected and tensor_sha256(tensor) != expected[name]:
                    wrong.append(name)
                size += tensor.numel() * tensor.element_size()
                yield name, tensor

        self.fulmen_load(arriving())
        if wrong:
            raise GroupError(f"{len(wrong)} tensor(s) arrived unlike their manifest's sha256: {', '.join(wrong[:5])}")
        return {"tensors": len(wanted), "bytes": size, "checked": len(expected)}

    # what vLLM's worker provides; a worker of another kind (a test's) overrides these
    def fulmen_load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """vLLM's in-place reload from an iterator (as ``reload_weights`` from a folder, less the folder)."""
        self.model_runner.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]

    def fulmen_device(self) -> torch.device:
        return torch.device(getattr(self, "device", "cpu"))

    def fulmen_worker_rank(self) -> int:
        from vllm.distributed.parallel_state import get_world_group  # inside vLLM's venv only

        return int(get_world_group().rank)
