"""The trainer under torchrun (DDP on gloo): two ranks reach one rank's weights, the codec hook gives the
Redis rank path's weights, LoRA trains under DDP, and bad set-ups fail with what to do."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from procs import stop
from rank_procs import FULMEN, push, start_two_ranks, trainer_env
from safetensors.torch import load_file

from fulmen import keys as k
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import Sample
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import free_port

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))
STEPS = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _samples(groups: int) -> list[Sample]:
    """Groups of 4 with different lengths, so the two halves of a step hold different token counts."""
    out = []
    for g in range(groups):
        for i in range(4):
            prompt = [1, 5 + g % 9, 9 + i, 12][: 2 + (i + g) % 3]
            response = [20 + (i + g) % 5, 21 + i, 22, 2][: 2 + i % 3]
            reward = float((i + g) % 2)
            out.append(Sample(f"g{g}-r{i}.1/t0", "triplet", f"g{g}-r{i}", f"g{g}-r{i}.1", f"g{g}", 0, prompt,
                              response, [-1.0] * len(response), [1] * len(response), reward, reward, "base",
                              group_size=4))
    return out


def _env(redis_url: str, experiment: str, tiny: Path, out: Path, **extra: str) -> dict[str, str]:
    return trainer_env(redis_url, experiment, tiny, out, **{"FULMEN_DEVICE": "cpu", "OMP_NUM_THREADS": "1", **extra})


def _torchrun(env: dict[str, str], *args: str, timeout: float = 180) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        [TORCHRUN, "--no-python", "--nproc-per-node", "2", "--master-port", str(free_port()), FULMEN, "trainer",
         "--parallel", "ddp", "--max-steps", str(STEPS), *args],
        env=env, timeout=timeout, capture_output=True,
    )


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(str(folder / "rank-0" / f"step-{STEPS}" / "model" / "model.safetensors"))


async def _one_rank_reference(client: Any, redis_url: str, tiny: Path, tmp_path: Path, prefix: str,
                              **extra: str) -> tuple[RedisStore, RedisStore, list[Sample]]:
    """The same samples pushed for two experiments, "one" and "two" (named after ``prefix``); "one"
    trained STEPS steps by a single rank (its checkpoints and metrics in tmp_path/one): the reference
    the ranks of "two" must reach. The stores and the samples."""
    one, two = (RedisStore(client, f"{prefix}-{name}-{tmp_path.name[-8:]}") for name in ("one", "two"))
    samples = _samples(2 * STEPS)
    await push(one, samples)
    await push(two, samples)
    single = await asyncio.to_thread(subprocess.run, [FULMEN, "trainer", "--max-steps", str(STEPS)], timeout=120,
                                     env=_env(redis_url, one.experiment, tiny, tmp_path / "one", **extra))
    assert single.returncode == 0
    return one, two, samples


@pytest.mark.slow
async def test_two_ddp_ranks_reach_the_weights_of_one_rank(redis_url: str, tiny: Path, tmp_path: Path) -> None:
    """fp32, codec none: 2 ranks under torchrun end with one rank's weights (atol 1e-5); only rank 0
    reads samples and publishes; every sample is acknowledged once."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    _, two, samples = await _one_rank_reference(client, redis_url, tiny, tmp_path, "ddp")
    run = await asyncio.to_thread(_torchrun, _env(redis_url, two.experiment, tiny, tmp_path / "two"))
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    reference, got = _weights(tmp_path / "one" / "ck"), _weights(tmp_path / "two" / "ck")
    assert reference.keys() == got.keys()
    for name, tensor in reference.items():
        assert torch.allclose(got[name], tensor, atol=1e-5), name
    initial = load_file(str(tiny / "model.safetensors"))
    assert any(not torch.equal(got[n], initial[n]) for n in initial)  # it did train
    assert not (tmp_path / "two" / "ck" / "rank-1").exists()  # rank 0 checkpoints for all
    lines = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [line["comm/ranks"] for line in lines] == [2] * STEPS
    assert sorted(i for line in lines for i in line["sample_ids"]) == sorted(s.sample_id for s in samples)
    assert (await client.xpending(two.keys.samples, k.TRAINERS_GROUP))["pending"] == 0
    assert (await two.resources.get_latest_resources()).resources["llm"]["model_version"] == f"v{STEPS}"
    await client.aclose()


@pytest.mark.slow
async def test_the_ddp_codec_hook_gives_the_redis_rank_paths_weights(redis_url: str, tiny: Path,
                                                                   tmp_path: Path) -> None:
    """top-k 10% with error feedback: torchrun + DDP hook and two Redis ranks train the same batches to
    the same weights (one gradient bucket, so both paths encode the same flat gradient)."""
    import redis.asyncio as aioredis

    client = aioredis.from_url(redis_url)
    ddp, ranks = (RedisStore(client, f"hook-{name}-{tmp_path.name[-8:]}") for name in ("ddp", "redis"))
    samples = _samples(2 * STEPS)
    codec = {"FULMEN_CODEC": "topk", "FULMEN_CODEC_DENSITY": "0.1"}
    await push(ddp, samples)
    run = await asyncio.to_thread(_torchrun, _env(redis_url, ddp.experiment, tiny, tmp_path / "ddp", **codec,
                                                  FULMEN_DDP_BUCKET_MB="1000"))
    assert run.returncode == 0, run.stderr.decode()[-3000:]

    env = _env(redis_url, ranks.experiment, tiny, tmp_path / "redis", **codec, FULMEN_WORLD_SIZE="2")
    procs: list[subprocess.Popen[bytes]] = []
    try:
        leader, _ = await start_two_ranks(ranks, env, procs, "--max-steps", str(STEPS))
        await push(ranks, samples)
        assert await asyncio.to_thread(leader.wait, 120) == 0
    finally:
        stop(procs)
    lines = [json.loads(x) for x in (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert all(line["comm/ratio"] > 3 for line in lines)  # the hook really compressed
    reference, got = _weights(tmp_path / "redis" / "ck"), _weights(tmp_path / "ddp" / "ck")
    for name, tensor in reference.items():
        assert torch.allclose(got[name], tensor, atol=1e-6), name
    await client.aclose()


@pytest.mark.slow
async def test_lora_trains_under_ddp_like_on_one_rank(redis_url: str, tiny: Path, tmp_path: Path) -> None:
    """LoRA: only the adapter crosses DDP; 2 ranks publish the adapter one rank reaches (atol 1e-5)."""
    import redis.asyncio as aioredis

    from fulmen.versions.model_version import fetch_model_version

    client = aioredis.from_url(redis_url)
    lora = {"FULMEN_LORA_RANK": "4"}
    one, two, _ = await _one_rank_reference(client, redis_url, tiny, tmp_path, "ddp-lora", **lora)
    run = await asyncio.to_thread(_torchrun, _env(redis_url, two.experiment, tiny, tmp_path / "two", **lora))
    assert run.returncode == 0, run.stderr.decode()[-3000:]
    reference = await fetch_model_version(one, f"v{STEPS}")
    got = await fetch_model_version(two, f"v{STEPS}")
    assert reference.keys() == got.keys() and all(".lora_" in n for n in got)
    gaps = {name: float((got[name] - tensor).abs().max()) for name, tensor in reference.items()}
    assert max(gaps.values()) < 1e-5, sorted(gaps.items(), key=lambda x: -x[1])[:5]
    assert any(bool(t.abs().max() > 0) for n, t in got.items() if ".lora_B." in n)
    await client.aclose()


def test_ddp_outside_torchrun_and_redis_inside_it_fail_with_what_to_do(tiny: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in _env("redis://127.0.0.1:1", "x", tiny, tmp_path).items()
           if k not in ("RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID")}
    alone = subprocess.run([FULMEN, "trainer", "--parallel", "ddp"], env=env, capture_output=True, timeout=60)
    assert alone.returncode == 2 and b"runs under torchrun" in alone.stderr
    inside = subprocess.run([FULMEN, "trainer"], env={**env, "RANK": "0", "WORLD_SIZE": "2"}, capture_output=True,
                            timeout=60)
    assert inside.returncode == 2 and b"add --parallel ddp" in inside.stderr
    unknown = subprocess.run([FULMEN, "trainer", "--parallel", "fsdp9"], env=env, capture_output=True, timeout=60)
    assert unknown.returncode == 2 and b"--parallel" in unknown.stderr and b"'fsdp9'" in unknown.stderr
    assert all(choice in unknown.stderr for choice in (b"'redis'", b"'ddp'", b"'fsdp'"))
    unknown = subprocess.run([FULMEN, "trainer"], env={**env, "FULMEN_PARALLEL": "fsdp9"}, capture_output=True, timeout=60)
    assert unknown.returncode == 2 and b"parallel (FULMEN_PARALLEL)" in unknown.stderr and b"got 'fsdp9'" in unknown.stderr
    assert all(choice in unknown.stderr for choice in (b"'redis'", b"'ddp'", b"'fsdp'"))


@pytest.mark.slow
async def test_two_fsdp_ranks_train_like_one_and_resume_from_their_shards(redis_url: str, tiny: Path,
                                                                          tmp_path: Path) -> None:
    """FSDP2 on CPU/gloo: 2 ranks stop after 2 steps (sharded checkpoint: a shard per rank), resume for
    the third, and publish the weights one rank reaches in 3 steps (atol 1e-5)."""
    import redis.asyncio as aioredis

    from fulmen.versions.model_version import fetch_model_version

    client = aioredis.from_url(redis_url)
    one, two, _ = await _one_rank_reference(client, redis_url, tiny, tmp_path, "fsdp")
    env = _env(redis_url, two.experiment, tiny, tmp_path / "two")

    def fsdp(steps: int) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(
            [TORCHRUN, "--no-python", "--nproc-per-node", "2", "--master-port", str(free_port()), FULMEN, "trainer",
             "--parallel", "fsdp", "--max-steps", str(steps)], env=env, timeout=180, capture_output=True)

    first = await asyncio.to_thread(fsdp, STEPS - 1)
    assert first.returncode == 0, first.stderr.decode()[-3000:]
    saved = tmp_path / "two" / "ck" / "rank-0" / f"step-{STEPS - 1}"
    assert sorted(p.name for p in saved.glob("shard-*")) == ["shard-0.safetensors", "shard-1.safetensors"]
    again = await asyncio.to_thread(fsdp, STEPS)
    assert again.returncode == 0, again.stderr.decode()[-3000:]
    assert b"resumed from" in again.stderr
    reference = await fetch_model_version(one, f"v{STEPS}")
    got = await fetch_model_version(two, f"v{STEPS}")
    assert reference.keys() == got.keys()
    gaps = {name: float((got[name] - tensor).abs().max()) for name, tensor in reference.items()}
    assert max(gaps.values()) < 1e-5, sorted(gaps.items(), key=lambda x: -x[1])[:5]
    lines = [json.loads(x) for x in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    assert (await client.xpending(two.keys.samples, k.TRAINERS_GROUP))["pending"] == 0
    await client.aclose()
