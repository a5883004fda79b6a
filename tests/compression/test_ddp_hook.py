"""The DDP hook (gloo, 2 processes) averages exactly as encode → mean_decoded does in one process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fulmen_trainer.distributed.codecs import make_codec, make_ddp_hook, mean_decoded

WORLD = 2
ITERS = 3  # iteration 0 is the plain fp32 all-reduce (start_iter=1); 1 and 2 use the codec
CASES: dict[str, dict] = {
    "none": {},
    "bf16": {},
    "topk": {"density": 0.05},
    "dgc": {"density": 0.05, "warmup_steps": 2, "momentum": 0.9},
    "qsgd8": {"bucket_size": 128},
    "qsgd4": {"bucket_size": 128},
}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    # One parameter: one DDP bucket whose flat buffer is weight.grad.view(-1).
    return nn.Linear(300, 200, bias=False)


def local_grad(model: nn.Module, rank: int, iteration: int) -> None:
    g = torch.Generator().manual_seed(100 * rank + iteration)
    x = torch.randn(8, 300, generator=g)
    model(x).pow(2).sum().backward()


def worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    results = {}
    for codec, knobs in CASES.items():
        model = make_model()
        ddp = DistributedDataParallel(model)
        state, hook = make_ddp_hook(codec, start_iter=1, seed=11, **knobs)
        ddp.register_comm_hook(state, hook)
        for it in range(ITERS):
            ddp.zero_grad()
            local_grad(ddp, rank, it)
            results[f"{codec}/{it}"] = model.weight.grad.clone()
    save_file(results, str(Path(out_dir) / f"rank{rank}.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


def expected(codec: str, knobs: dict) -> list[torch.Tensor]:
    """What the Redis path gives: each rank encodes its local gradient, everyone averages the decodes."""
    codecs = [make_codec(codec, seed=11, **knobs) for _ in range(WORLD)]
    out = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in the workers: the matmul's summation order, hence its bits, depends on it
    try:
        return _expected(codecs, out)
    finally:
        torch.set_num_threads(threads)


def _expected(codecs: list, out: list[torch.Tensor]) -> list[torch.Tensor]:
    for it in range(ITERS):
        grads = []
        for rank in range(WORLD):
            model = make_model()
            local_grad(model, rank, it)
            grads.append(model.weight.grad.clone())
        if it == 0:
            out.append(sum(g / WORLD for g in grads))
            continue
        lists = [
            c.encode(g.view(-1), name="bucket0", step=it, rank=r)
            for r, (c, g) in enumerate(zip(codecs, grads, strict=True))
        ]
        out.append(mean_decoded(lists).view_as(grads[0]))
    return out


@pytest.fixture(scope="module")
def ddp_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, torch.Tensor]]:
    tmp = tmp_path_factory.mktemp("ddp")
    mp.spawn(worker, args=(str(tmp / "init"), str(tmp)), nprocs=WORLD, join=True)
    return [load_file(str(tmp / f"rank{r}.safetensors")) for r in range(WORLD)]


@pytest.mark.parametrize("codec", list(CASES))
def test_ddp_hook_matches_redis_path(codec: str, ddp_results: list[dict[str, torch.Tensor]]) -> None:
    """Both ranks get the same gradient, equal to the one-process encode/decode/average (bitwise;
    bf16 within bf16 precision, since its all-reduce sums in bf16)."""
    want = expected(codec, CASES[codec])
    for it in range(ITERS):
        got0, got1 = ddp_results[0][f"{codec}/{it}"], ddp_results[1][f"{codec}/{it}"]
        assert torch.equal(got0, got1), (codec, it)
        if codec == "bf16" and it > 0:
            assert torch.allclose(got0, want[it], rtol=2**-7, atol=1e-6 * float(want[it].abs().max())), it
        else:
            assert torch.equal(got0, want[it]), (codec, it)
