"""A full version by broadcast over a gloo group: the sender (rank 0) and a vLLM-like worker (rank 1,
`WorkerExtension` over a tiny model in a thread of this process), on a free port."""

from __future__ import annotations

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
    """Rank 0 sends a model's weights (a header, then the tensors); the worker loads them as they
    arrive and checks the sampled tensors' sha256: afterwards its weights are the sender's, bit for
    bit. Two groups share one rendezvous, each under its own name."""
    sender_model, worker_model = _tiny(tmp_path / "a", seed=1), _tiny(tmp_path / "b", seed=2)
    state = {n: p.detach() for n, p in sender_model.named_parameters()}
    assert any(not torch.equal(p, dict(worker_model.named_parameters())[n]) for n, p in state.items())
    store = group.serve_store(0, 30)
    worker, other = TinyWorker(worker_model), TinyWorker(_tiny(tmp_path / "c", seed=3))
    groups = {}
    for name, w in (("r1", worker), ("r2", other)):
        joined = _in_thread(w.fulmen_join, "127.0.0.1", store.port, world_size=2, name=name, timeout_s=30)
        groups[name] = group.join("127.0.0.1", store.port, 0, 2, "gloo", 30, name=name, store=store)
        joined["thread"].join(30)
        assert joined.get("value") == {"rank": 1, "world_size": 2}, joined

    checks = {n: tensor_sha256(state[n]) for n in group.sampled_names(group.specs_of(state), seed="v1")}
    received = _in_thread(worker.fulmen_receive)
    sent = group.send_version(groups["r1"], "v1", state, checks)
    received["thread"].join(30)
    assert received.get("value") == {"version": "v1", "tensors": len(state), "bytes": sent,
                                     "checked": len(checks)}, received
    got = dict(worker_model.named_parameters())
    assert all(torch.equal(got[n], t) for n, t in state.items())
    assert worker.loads == [list(state)] and other.loads == []  # one load, as the tensors arrived


def test_a_tensor_unlike_its_manifest_or_no_version_is_refused() -> None:
    """A check that fails names the tensor, once every tensor has arrived (the sender is not left
    waiting, and the group serves the next version); a sender with nothing to send says why; a worker
    that has not joined says to join first."""
    state = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(4)}
    worker = TinyWorker(torch.nn.ParameterDict({n: torch.nn.Parameter(torch.zeros_like(t)) for n, t in state.items()}))
    with pytest.raises(GroupError, match="fulmen_join first"):
        worker.fulmen_receive()
    port = free_port()
    joined = _in_thread(worker.fulmen_join, "127.0.0.1", port, world_size=2, timeout_s=30)
    sender = group.join("127.0.0.1", port, 0, 2, "gloo", timeout_s=30)
    joined["thread"].join(30)
    wrong = {"a": tensor_sha256(state["a"]), "b": tensor_sha256(torch.zeros(4))}
    received = _in_thread(worker.fulmen_receive)
    group.send_version(sender, "v2", state, wrong)
    received["thread"].join(30)
    assert isinstance(received.get("error"), GroupError), received
    assert "1 tensor(s) arrived unlike their manifest's sha256: b" in str(received["error"])
    assert worker.loads == [["a", "b"]]

    received = _in_thread(worker.fulmen_receive)
    group.send_refusal(sender, "the trainer holds no full version (a LoRA run)")
    received["thread"].join(30)
    assert "the sender sent no version: the trainer holds no full version (a LoRA run)" in str(received.get("error"))
    received = _in_thread(worker.fulmen_receive)  # still usable
    group.send_version(sender, "v3", state, {})
    received["thread"].join(30)
    assert received.get("value", {}).get("version") == "v3", received


def test_joining_a_sender_that_never_comes_times_out_with_a_clear_error() -> None:
    started = time.monotonic()
    with pytest.raises(GroupError, match=r"rank 1 of 2 could not join the weight group '' at 127.0.0.1:\d+ \(gloo\)"):
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
