"""Gradient synchronisation policies, on both rank paths: periodic full sync, density by phase and
adapted to the cosine, and the anomaly fallback (a NaN never reaches the weights or the residual)."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from fulmen.errors import InvalidInput
from fulmen_trainer.distributed.codecs import DDPCodecState, codec_hook, make_codec
from fulmen_trainer.distributed.gradients import RankCodec
from fulmen_trainer.distributed.sync_policy import SyncPolicy, parse_schedule

N = 10_000


def _grad(step: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(N, generator=torch.Generator().manual_seed(step)) * scale


def _sent_density(codec: RankCodec, chunks: list[bytes]) -> float:
    return float((codec.decode(chunks) != 0).float().mean())


def test_full_sync_sends_the_gradient_and_the_residual_uncompressed_every_k_steps() -> None:
    codec = RankCodec("topk", SyncPolicy(full_sync_every=3), density=0.01)
    held_back = torch.zeros(N)
    for step in (1, 2):
        grad = _grad(step)
        sent = codec.decode(codec.encode(grad, step, 0))
        assert float((sent != 0).float().mean()) < 0.05  # compressed steps
        held_back += grad - sent
    grad = _grad(3)
    sent = codec.decode(codec.encode(grad, 3, 0))
    assert codec.last.flush and not codec.last.compress
    assert torch.allclose(sent, grad + held_back, atol=1e-5)  # everything error feedback held back
    assert codec.state.residuals == {}  # and nothing is held back any more
    off = RankCodec("topk", SyncPolicy(), density=0.01)
    for step in (1, 2, 3):
        chunks = off.encode(_grad(step), step, 0)
    assert _sent_density(off, chunks) == pytest.approx(0.01)  # without the policy step 3 is compressed


def test_density_follows_the_schedule_by_phase() -> None:
    codec = RankCodec("topk", SyncPolicy(schedule=parse_schedule("2:0.5,4:0.1,0.01")), density=0.2)
    got = [_sent_density(codec, codec.encode(_grad(step), step, 0)) for step in range(1, 7)]
    assert got == pytest.approx([0.5, 0.5, 0.1, 0.1, 0.01, 0.01], abs=1e-3)
    assert codec.state.density == 0.2  # the knob (checkpointed) is untouched
    plain = RankCodec("topk", None, density=0.2)
    assert _sent_density(plain, plain.encode(_grad(1), 1, 0)) == pytest.approx(0.2)
    with pytest.raises(ValueError, match="increasing steps"):
        parse_schedule("5:0.1,3:0.2,0.1")
    with pytest.raises(ValueError, match=r"must be in \(0, 1\]"):
        parse_schedule("5:0,0.1")


def test_adaptive_density_grows_while_the_cosine_is_below_target() -> None:
    codec = RankCodec("topk", SyncPolicy(adaptive=True, target_cosine=0.95), density=0.01)
    densities = []
    for step in range(1, 6):
        grad = _grad(step)
        chunks = codec.encode(grad, step, 0)
        densities.append(_sent_density(codec, chunks))
        codec.observe(float(grad.norm()), float(torch.cosine_similarity(codec.decode(chunks), grad, dim=0)))
    assert densities == sorted(densities) and densities[-1] > 3 * densities[0]
    fixed = RankCodec("topk", SyncPolicy(adaptive=False, target_cosine=0.95), density=0.01)
    for step in range(1, 6):
        grad = _grad(step)
        chunks = fixed.encode(grad, step, 0)
        fixed.observe(float(grad.norm()), 0.1)
    assert _sent_density(fixed, chunks) == pytest.approx(0.01)


def test_a_nan_or_exploding_gradient_goes_uncompressed_and_leaves_error_feedback_clean(caplog) -> None:
    codec = RankCodec("topk", SyncPolicy(anomaly_factor=10), density=0.01)
    for step in range(1, 7):
        grad = _grad(step)
        codec.encode(grad, step, 0)
        codec.observe(float(grad.norm()), 0.5)
    residual = codec.state.residuals["grads"].copy()
    poisoned = _grad(7)
    poisoned[5] = math.nan
    with caplog.at_level(logging.WARNING):
        sent = codec.decode(codec.encode(poisoned, 7, 0))
    assert not codec.last.compress and "not finite" in caplog.text
    assert torch.isnan(sent[5]) and bool(torch.isfinite(torch.from_numpy(codec.state.residuals["grads"])).all())
    assert (codec.state.residuals["grads"] == residual).all()
    huge = _grad(8, scale=1000.0)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(codec.decode(codec.encode(huge, 8, 0)), huge)
    assert "median" in caplog.text and codec.last.reason == "exploding gradient"
    # switched off (no policy), the codec refuses the step after the NaN went into its residual
    off = RankCodec("topk", None, density=0.01)
    with pytest.raises(InvalidInput, match="non-finite"):
        off.encode(poisoned, 7, 0)
    assert not bool(torch.isfinite(torch.from_numpy(off.state.residuals["grads"])).all())


def test_the_sync_policy_is_checkpointed_with_the_codec() -> None:
    codec = RankCodec("topk", SyncPolicy(adaptive=True), density=0.01)
    codec.encode(_grad(1), 1, 0)
    codec.observe(3.0, 0.1)
    again = RankCodec("topk", SyncPolicy(adaptive=True), density=0.01)
    again.load_state_dict(codec.state_dict())
    assert again.policy is not None and again.policy.norms == [3.0] and again.policy.factor == 1.5


# --- the DDP hook ----------------------------------------------------------------------------------


def _ddp_worker(rank: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Linear(100, 50, bias=False)
    ddp = DistributedDataParallel(model)
    state = DDPCodecState(make_codec("topk", density=0.01, seed=3), start_iter=0,
                          policy=SyncPolicy(full_sync_every=3))
    ddp.register_comm_hook(state, codec_hook)
    out = {}
    for step in range(1, 5):
        state.step = step
        ddp.zero_grad()
        x = torch.randn(4, 100, generator=torch.Generator().manual_seed(10 * rank + step))
        loss = ddp(x).pow(2).sum()
        if step == 4 and rank == 1:
            loss = loss * math.nan  # only rank 1's gradient is NaN: both ranks must agree to send it raw
        loss.backward()
        out[f"grad{step}"] = model.weight.grad.clone()
        out[f"residual{step}"] = torch.from_numpy(state.codec.residuals.get("bucket0", torch.zeros(1).numpy()).copy())
        stats = state.compression_stats(reset=True)
        out[f"uncompressed{step}"] = torch.tensor(stats.get("comm/uncompressed", -1.0))
    save_file(out, str(Path(out_dir) / f"rank{rank}.safetensors"))
    dist.barrier()
    dist.destroy_process_group()


def test_under_ddp_the_ranks_agree_on_full_syncs_and_on_one_ranks_nan(tmp_path: Path) -> None:
    mp.start_processes(_ddp_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    ranks = [load_file(str(tmp_path / f"rank{r}.safetensors")) for r in range(2)]
    for step in range(1, 5):
        assert torch.equal(ranks[0][f"grad{step}"], ranks[1][f"grad{step}"]) or step == 4
    assert [float(ranks[0][f"uncompressed{s}"]) for s in range(1, 5)] == [0.0, 0.0, 1.0, 1.0]
    assert [float(ranks[1][f"uncompressed{s}"]) for s in range(1, 5)] == [0.0, 0.0, 1.0, 1.0]
    for r in range(2):
        assert ranks[r]["residual3"].numel() == 1  # the full sync of step 3 flushed the residual
        assert bool(torch.isnan(ranks[r]["grad4"]).all())  # a NaN on any rank reaches every rank's sum...
        assert bool(torch.isfinite(ranks[r]["residual4"]).all())  # ...but never a residual
