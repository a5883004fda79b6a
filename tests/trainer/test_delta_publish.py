"""publish_format=delta (issue 16, items 1-2): the trainer publishes a full version, then deltas, and a
full one again every keyframe_every; the proxy's torch backend applies each delta onto the weights it
serves, and a proxy that starts late rebuilds a delta version from its chain — both end bit for bit
on the trainer's weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from fulmen import keys as k
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import Sample
from fulmen.settings import TrainerSettings, load_settings
from fulmen.store import RedisStore
from fulmen.versions.manifest import DELTA, FULL, tensor_sha256
from fulmen.versions.model_version import fetch_full_version, fetch_version
from fulmen_llm_proxy.backends.torch.backend import TorchBackend
from fulmen_llm_proxy.following import ModelFollower
from fulmen_trainer.trainer import Trainer

STEPS = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _group(name: str) -> list[Sample]:
    out = []
    for i, reward in enumerate([1.0, 0.0, 1.0, 0.0]):
        prompt, response = [1, 5 + i, 9, 12], [20 + int(reward), 21, 2]
        out.append(Sample(f"{name}{i}.1/t0", "triplet", f"{name}{i}", f"{name}{i}.1", name, 0, prompt, response,
                          [-1.5, -2.0, -0.5], [1, 1, 1], reward, reward, "base", mode="train", group_size=4))
    return out


async def _train(store: RedisStore, tiny: Path, tmp_path: Path) -> Trainer:
    await store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    for name in "abcd"[:STEPS]:
        for sample in _group(name):
            await store.redis.xadd(store.keys.samples, {"m": sample.to_wire()})
    settings = load_settings(TrainerSettings, model_dir=tiny, groups_per_step=1, checkpoint_dir=tmp_path / "ck",
                             metrics_file=tmp_path / "m.jsonl", max_steps=STEPS, experiment=store.experiment,
                             learning_rate=1e-5, dtype="bfloat16", device="cpu", publish_format="delta",
                             keyframe_every=3, keep_versions=10)
    trainer = Trainer(store, settings)
    await trainer.setup()
    await asyncio.wait_for(trainer.run(asyncio.Event()), 120)
    return trainer


def _same_bits(served: dict[str, torch.Tensor], published: dict[str, torch.Tensor]) -> bool:
    return all(tensor_sha256(served[n].to(t.dtype)) == tensor_sha256(t) for n, t in published.items())


async def test_deltas_between_keyframes_end_on_the_trainers_weights(real_store: RedisStore, tiny: Path,
                                                                   tmp_path: Path) -> None:
    trainer = await _train(real_store, tiny, tmp_path)
    assert trainer.policy is not None
    final = trainer.policy.published_state()
    assert {t.dtype for t in final.values()} == {torch.bfloat16}
    manifests = [(await fetch_version(real_store, f"v{i}")).manifest for i in range(1, STEPS + 1)]
    assert [(m.format, m.base_version) for m in manifests] == [
        (FULL, None), (DELTA, "v1"), (DELTA, "v2"), (FULL, None)]
    delta_bytes = (await real_store.resources.get_resources("policy", 3)).resources["llm"]["weights"]["bytes"]
    full_bytes = (await real_store.resources.get_resources("policy", 1)).resources["llm"]["weights"]["bytes"]
    assert delta_bytes < full_bytes / 2  # at an RL learning rate most bf16 elements keep their bits

    # a proxy that follows every version: v1 whole, v2 and v3 applied onto what it serves, v4 whole
    backend = TorchBackend(tiny)
    await backend.start()
    outcomes: list[tuple[str, str]] = []
    follower = ModelFollower(real_store, backend, lambda v, outcome: outcomes.append((v, outcome)))
    partial_loads = []
    load = backend.engine.load_weights

    async def spy(state, version, **kw):  # type: ignore[no-untyped-def]
        partial_loads.append((version, kw.get("partial", False), len(state)))
        return await load(state, version, **kw)

    backend.engine.load_weights = spy  # type: ignore[method-assign]
    served_v3 = None
    for update in await real_store.resources.query_resources():
        await follower.consider(update)
        if backend.model_version == "v3":
            served_v3 = {n: t.clone() for n, t in backend.current_weights().items()}
    assert outcomes == [(f"v{i}", "loaded") for i in range(1, STEPS + 1)]
    assert [(v, partial) for v, partial, _ in partial_loads] == [("v1", False), ("v2", True), ("v3", True), ("v4", False)]
    assert _same_bits(backend.current_weights(), final)
    await backend.close()

    # a proxy that starts when v3 (a delta) is the newest: it rebuilds v3 from v1 + v2 + v3
    v3 = await fetch_full_version(real_store, "v3")
    assert v3.manifest is not None and v3.manifest.format == FULL
    assert served_v3 is not None and _same_bits(served_v3, v3.state)
    late = TorchBackend(tiny)
    await late.start()
    follower = ModelFollower(real_store, late, lambda v, outcome: None)
    await follower.consider(await real_store.resources.get_resources("policy", 3))
    assert late.model_version == "v3" and _same_bits(late.current_weights(), v3.state)
    await late.close()
