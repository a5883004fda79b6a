"""gpu_check step f: the weight group (``FULMEN_WEIGHT_GROUP``: full versions broadcast into vLLM's
workers) on the device. vLLM is not in the device image today, so this checks the part that runs
without it: a Qwen2.5-0.5B-shaped version (bf16) sent the way the trainer's `WeightSender` sends it
(gloo, from its host copy) into the GPU weights of a model held by Fulmen's `WorkerExtension`, as a
vLLM worker holds it, in a thread of this process; every tensor's sha256 checked; the seconds and
GB/s of the transfer, twice (the first joins the group).

Not checked here: NCCL between the trainer's GPU weights and vLLM's (two processes on one GPU cannot
form an NCCL group: it needs a second GPU), and a real vLLM server (``vllm``: whether the image has it).
A dry run: the tiny shape, fp32, on the CPU.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import torch
from common import QWEN25_05B, TINY, build_on_device, chip, emit, log, parse

from fulmen.store.redis.embedded import free_port
from fulmen.versions.manifest import tensor_sha256
from fulmen.versions.transport import group
from fulmen.versions.transport.group import WorkerExtension

ROUNDS = 2


class DeviceWorker(WorkerExtension):
    """A worker as vLLM's looks to the extension: a model on the device, loaded from the arriving tensors."""

    def __init__(self, model: torch.nn.Module, device: str) -> None:
        self.params = dict(model.named_parameters())
        self.device = torch.device(device)

    def fulmen_load(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        with torch.no_grad():
            for name, tensor in weights:
                self.params[name].copy_(tensor)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def fulmen_worker_rank(self) -> int:
        return 0


def vllm_in_image() -> str:
    try:
        import vllm

        return f"importable ({vllm.__version__}): a server run is not built into this step yet"
    except Exception as e:  # any failure to import says the same: not usable here
        return f"not in the image ({type(e).__name__})"


def run(args: Any) -> dict[str, Any]:
    shape, dtype = (TINY, torch.float32) if args.dry_run else (QWEN25_05B, torch.bfloat16)
    receiver = build_on_device(shape, args.device, dtype, seed=1)
    state = {n: p.detach().to("cpu", copy=True) for n, p in build_on_device(shape, "cpu", dtype, seed=2).named_parameters()}
    checks = {n: tensor_sha256(t) for n, t in state.items()}  # every tensor, on the receiving side too
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    worker, port = DeviceWorker(receiver, args.device), free_port()
    out: dict[str, Any] = {}
    joined = threading.Thread(target=lambda: out.update(join=worker.fulmen_join("127.0.0.1", port, 2, "gpu-check",
                                                                                  "gloo", timeout_s=60)))
    started = time.perf_counter()
    joined.start()
    sender = group.join("127.0.0.1", port, 0, 2, "gloo", 60, name="gpu-check")
    joined.join(60)
    result: dict[str, Any] = {"chip": chip()[0], "vllm": vllm_in_image(), "bytes": nbytes, "backend": "gloo",
                              "receiver_device": args.device, "join_s": round(time.perf_counter() - started, 3),
                              "nccl": "not checked: one GPU (an NCCL group needs a second)"}
    for i in range(ROUNDS):
        received: dict[str, Any] = {}
        receiving = threading.Thread(target=lambda r=received: r.update(worker.fulmen_receive()))
        began = time.perf_counter()
        receiving.start()
        group.send_version(sender, f"v{i + 1}", state, checks)
        receiving.join(120)
        seconds = time.perf_counter() - began
        if received.get("tensors") != len(state):
            return result | {"error": f"round {i + 1}: the worker received {received}"}
        result[f"send_s_{i + 1}"] = round(seconds, 3)
        result[f"gb_per_s_{i + 1}"] = round(nbytes / seconds / 1e9, 2)
        log("round %d: %.1f MB in %.2f s (%.2f GB/s), %d tensors checked", i + 1, nbytes / 1e6, seconds,
            nbytes / seconds / 1e9, received["checked"])
    same = all(torch.equal(worker.params[n].detach().cpu(), t) for n, t in state.items())
    return result | ({"weights_equal": True} if same else {"error": "the device weights differ from those sent"})


def main() -> None:
    emit(run(parse(__doc__ or "")))


if __name__ == "__main__":
    main()
