"""A full version by broadcast over a gloo group: the sender (rank 0) and a vLLM-like worker (rank 1,
`WorkerExtension` over a tiny model in a thread of this process), on a free port."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.store.redis.embedded import free_port
from fulmen.versions.manifest import tensor_sha256
from fulmen.versions.transport import group
from fulmen.versions.transport.group import GroupError, TensorSpec, WorkerExtension


class TinyWorker(WorkerExtension):
    """A worker as vLLM's looks to the extension: weights loaded from an iterator, a rank."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.loads: list[list[str]] = []

    def fulmen_load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        params, names = dict(self.model.named_parameters()), []
        with torch.no_grad():
            for name, tensor in weights:
                params[name].copy_(tensor)
                names.append(name)
        self.loads.append(names)

    def fulmen_worker_rank(self) -> int:
        return 0


def _tiny(path: Path, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(build_tiny_model(path, seed=seed), dtype=torch.float32)


def _in_thread(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def go() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as e:  # the test reads it
            out["error"] = e

    out["thread"] = threading.Thread(target=go, daemon=True)
    out["thread"].start()
    return out


def test_a_version_arrives_by_broadcast_into_the_worker_s_weights(tmp_path: Path) -> None:
    """Rank 0 sends a model's weights; the worker loads them as they arrive and checks the sampled
    tensors' sha256: afterwards its weights are the sender's, bit for bit."""
    sender_model, worker_model = _tiny(tmp_path / "a", seed=1), _tiny(tmp_path / "b", seed=2)
    state = {n: p.detach() for n, p in sender_model.named_parameters()}
    assert any(not torch.equal(p, dict(worker_model.named_parameters())[n]) for n, p in state.items())
    worker, port = TinyWorker(worker_model), free_port()
    joined = _in_thread(worker.fulmen_join, "127.0.0.1", port, world_size=2, timeout_s=30)
    sender = group.join("127.0.0.1", port, 0, 2, "gloo", timeout_s=30)
    joined["thread"].join(30)
    assert joined.get("value") == {"rank": 1, "world_size": 2}, joined

    specs = group.specs_of(state)
    checks = {name: tensor_sha256(state[name]) for name in group.sampled_names(specs, seed="v1")}
    received = _in_thread(worker.fulmen_receive, [s.to_json() for s in specs], checks)
    sent = group.send(sender, state, specs)
    received["thread"].join(30)
    assert received.get("value") == {"tensors": len(specs), "bytes": sent, "checked": len(checks)}, received
    got = dict(worker_model.named_parameters())
    assert all(torch.equal(got[n], t) for n, t in state.items())
    assert worker.loads == [list(state)]  # one load, as the tensors arrived


def test_a_tensor_that_does_not_match_its_manifest_is_refused(tmp_path: Path) -> None:
    """A check that fails names the tensor, once every tensor has arrived (the JSON forms, as vLLM's
    /collective_rpc passes them); a worker that has not joined says to join first."""
    state = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    worker = TinyWorker(torch.nn.ParameterDict({n: torch.nn.Parameter(torch.zeros_like(t)) for n, t in state.items()}))
    with pytest.raises(GroupError, match="fulmen_join first"):
        worker.fulmen_receive([s.to_json() for s in group.specs_of(state)])
    port = free_port()
    joined = _in_thread(worker.fulmen_join, "127.0.0.1", port, world_size=2, timeout_s=30)
    sender = group.join("127.0.0.1", port, 0, 2, "gloo", timeout_s=30)
    joined["thread"].join(30)
    specs = group.specs_of(state)
    wrong = {"a": tensor_sha256(state["a"]), "b": tensor_sha256(torch.zeros(4))}
    received = _in_thread(worker.fulmen_receive, json.dumps([s.to_json() for s in specs]), json.dumps(wrong))
    group.send(sender, state, specs)
    received["thread"].join(30)
    assert isinstance(received.get("error"), GroupError), received
    assert "1 tensor(s) arrived unlike their manifest's sha256: b" in str(received["error"])
    assert worker.loads == [["a", "b"]]  # every tensor received: the sender is not left waiting


def test_joining_a_sender_that_never_comes_times_out_with_a_clear_error() -> None:
    started = time.monotonic()
    with pytest.raises(GroupError, match=r"rank 1 of 2 could not join the weight group at 127.0.0.1:\d+ \(gloo\)"):
        group.join("127.0.0.1", free_port(), 1, 2, "gloo", timeout_s=1.0)
    assert time.monotonic() - started < 30


def test_the_sampled_checks_are_the_largest_and_the_same_few_for_every_receiver() -> None:
    specs = [TensorSpec(f"t{i}", "float32", (i + 1,)) for i in range(20)]
    names = group.sampled_names(specs, 4, seed="v3")
    assert names[0] == "t19" and len(set(names)) == 4
    assert names == group.sampled_names(specs, 4, seed="v3") and names != group.sampled_names(specs, 4, seed="v4")
    assert group.sampled_names(specs, -1) == [s.name for s in specs] and group.sampled_names(specs, 0) == []
    assert TensorSpec.from_json(specs[3].to_json()) == specs[3]
    assert group.backend_for("cpu") == "gloo" and group.backend_for("cuda:1") == "nccl"
