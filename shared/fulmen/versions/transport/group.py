"""A full version's tensors by broadcast over a torch process group: from a sender (rank 0) into the
workers of a vLLM server (ranks 1..), each tensor straight into the model's weights.

gloo between CPUs, NCCL between GPUs (`backend_for`); a version travels as a header (its name, its
tensors, the sha256 to check), then its tensors. Only torch, the standard library and the manifest's
hash, so vLLM's venv imports it (``shared/`` on its PYTHONPATH): `WorkerExtension` is the server's
``--worker-extension-cls``, called over ``POST /collective_rpc``. The design: docs/design/vllm-sync.md.
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


def serve_store(port: int, timeout_s: float) -> Any:
    """The rendezvous that rank 0 serves on ``port`` (0: a free one; its ``port`` attribute says which),
    for any number of groups, each under its own name."""
    try:
        return dist.TCPStore("0.0.0.0", port, None, is_master=True, timeout=timedelta(seconds=timeout_s),
                             wait_for_workers=False)
    except (RuntimeError, dist.DistStoreError) as e:
        raise GroupError(f"the weight group's rendezvous cannot listen on port {port}: {e}") from None


def join(host: str, port: int, rank: int, world_size: int, backend: str, timeout_s: float, *, name: str = "",
         store: Any = None) -> Any:
    """This process's member ``rank`` of the group ``name`` of ``world_size`` members, met at the
    rendezvous on ``host:port`` (``store``: rank 0's own, from `serve_store`; else rank 0 serves one
    for this group alone). Apart from torch.distributed's default group, which vLLM's workers use for
    their own. Blocks until every member has joined or ``timeout_s`` passed (GroupError)."""
    timeout = timedelta(seconds=timeout_s)
    try:
        if store is None:
            store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout)
        prefixed = dist.PrefixStore(f"{PREFIX}/{name}", store)
        if backend == "gloo":
            return dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        if backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()  # type: ignore[attr-defined]  # CUDA builds only
            options._timeout = timeout
            return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)  # type: ignore[attr-defined]
    except (RuntimeError, dist.DistStoreError) as e:
        raise GroupError(f"rank {rank} of {world_size} could not join the weight group {name!r} at {host}:{port} "
                         f"({backend}) within {timeout_s} s: {e}") from None
    raise GroupError(f"weight group backend {backend!r} unknown; use gloo or nccl")


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def send_version(group: Any, version: str, state: Mapping[str, torch.Tensor], checks: Mapping[str, str]) -> int:
    """Broadcast a version: its header (name, [name, dtype, shape] per tensor, the sha256 to check),
    then each tensor in that order; the tensors' bytes."""
    specs = specs_of(state)
    _send_header(group, {"version": version, "specs": [s.to_json() for s in specs], "checks": dict(checks)})
    sent = 0
    for spec in specs:
        tensor = state[spec.name].detach().contiguous()
        broadcast(group, tensor)
        sent += tensor.numel() * tensor.element_size()
    return sent


def send_refusal(group: Any, reason: str) -> None:
    """Broadcast a header without a version: the receivers fail with ``reason`` and load otherwise."""
    _send_header(group, {"version": None, "reason": reason})


def _send_header(group: Any, header: dict[str, Any]) -> None:
    payload = json.dumps(header).encode()
    broadcast(group, torch.tensor([len(payload)], dtype=torch.int64))
    broadcast(group, torch.frombuffer(bytearray(payload), dtype=torch.uint8))


def receive_header(group: Any) -> dict[str, Any]:
    size = torch.zeros(1, dtype=torch.int64)
    broadcast(group, size)
    payload = torch.empty(int(size), dtype=torch.uint8)
    broadcast(group, payload)
    return dict(json.loads(payload.numpy().tobytes()))


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

    def fulmen_join(self, host: str, port: int, world_size: int, name: str = "", backend: str = "",
                    rank_offset: int = 1, timeout_s: float = 60.0) -> dict[str, Any]:
        """Join the sender's group ``name`` as rank ``rank_offset`` + this worker's rank in the server."""
        self.fulmen_group = None
        rank = rank_offset + self.fulmen_worker_rank()
        self.fulmen_group = join(host, port, rank, world_size, backend or backend_for(self.fulmen_device()),
                                 timeout_s, name=name)
        return {"rank": rank, "world_size": world_size}

    def fulmen_receive(self) -> dict[str, Any]:
        """Receive the version rank 0 sends (its header says which) straight into the model's weights,
        as they arrive (`fulmen_load`). The tensors the
        header lists to check must match their sha256: a mismatch is a GroupError once every tensor
        has arrived (the group stays usable, the weights are then wrong, and the caller loads the
        version another way)."""
        if self.fulmen_group is None:
            raise GroupError("this worker has not joined a weight group (fulmen_join first)")
        header = receive_header(self.fulmen_group)
        if header.get("version") is None:
            raise GroupError(f"the sender sent no version: {header.get('reason', 'no reason given')}")
        wanted = [TensorSpec.from_json(v) for v in header["specs"]]
        expected_sha = dict(header.get("checks") or {})
        wrong: list[str] = []
        size = 0

        def arriving() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal size
            for name, tensor in receive(self.fulmen_group, wanted, self.fulmen_device()):
                if name in expected_sha and tensor_sha256(tensor) != expected_sha[name]:
                    wrong.append(name)
                size += tensor.numel() * tensor.element_size()
                yield name, tensor

        stream = arriving()
        try:
            self.fulmen_load(stream)
        finally:
            left = sum(1 for _ in stream)  # the rest received all the same: the sender is never left waiting
        if left:
            raise GroupError(f"the loader took {len(wanted) - left} of the {len(wanted)} tensors sent")
        if wrong:
            raise GroupError(f"{len(wrong)} tensor(s) arrived unlike their manifest's sha256: {', '.join(wrong[:5])}")
        return {"version": header["version"], "tensors": len(wanted), "bytes": size, "checked": len(expected_sha)}

    def fulmen_workers(self) -> int:
        """This worker's rank in the server (one answer per worker: their count is the group's size less one)."""
        return self.fulmen_worker_rank()

    # what vLLM's worker provides; a worker of another kind (a test's) overrides these
    def fulmen_load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        """vLLM's in-place reload from an iterator (as ``reload_weights`` from a folder, less the folder)."""
        self.model_runner.reload_weights(weights_iterator=weights)  # type: ignore[attr-defined]

    def fulmen_device(self) -> torch.device:
        return torch.device(getattr(self, "device", "cpu"))

    def fulmen_worker_rank(self) -> int:
        from vllm.distributed.parallel_state import get_world_group  # inside vLLM's venv only

        return int(get_world_group().rank)
