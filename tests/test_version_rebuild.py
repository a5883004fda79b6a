"""Model versions whose chunks Redis lost, rebuilt from the trainer's checkpoint under their own name
(`fulmen.versions.rebuild`): the loss is simulated by deleting the chunk streams after a real trainer
published v1 and v2 and stopped (tests/rebuild_helpers.py). A rollback to an older lost version writes
it again chunk for chunk; a checkpoint whose bytes differ from the manifest is refused, saying so."""

from __future__ import annotations

from pathlib import Path

import pytest
from rebuild_helpers import stored_manifest, train_then_lose
from safetensors.torch import load_file, save_file

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.serving.rollback import rollback
from fulmen.store import RedisStore
from fulmen.versions.model_version import fetch_model_version
from fulmen.versions.rebuild import RebuildRefused, rebuild_version, weights_lost


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


async def test_rollback_to_an_older_lost_version_rebuilds_it_with_its_own_bytes(
        real_store: RedisStore, tiny_model: Path, tmp_path: Path) -> None:
    """`fulmen rollback v1` with v1's chunks lost writes them again, chunk for chunk, then serves v1."""
    published = await train_then_lose(real_store, tiny_model, tmp_path / "ck")
    assert await weights_lost(real_store, "v1") is not None
    update = await rollback(real_store, "v1", checkpoint_dir=tmp_path / "ck")
    assert update.resources["llm"]["model_version"] == "v1"
    assert await real_store.weights_redis.xrange(real_store.keys.weights("v1")) == published["v1"]
    state = await fetch_model_version(real_store, "v1")  # every tensor checked against the manifest
    assert set(state) == set((await stored_manifest(real_store, "v1")).tensors)
    assert await rebuild_version(real_store, "v1", tmp_path / "ck") is not None  # whole again: nothing to do


async def test_a_checkpoint_whose_bytes_differ_from_the_manifest_is_refused(
        real_store: RedisStore, tiny_model: Path, tmp_path: Path) -> None:
    """A checkpoint changed on disk is not published as v2: RebuildRefused names the tensor, nothing is written."""
    await train_then_lose(real_store, tiny_model, tmp_path / "ck")
    model_file = next((tmp_path / "ck" / "rank-0" / "step-2" / "model").glob("*.safetensors"))
    tensors = load_file(str(model_file))
    name = next(iter(tensors))
    tensors[name] = tensors[name] + 0.5
    save_file(tensors, str(model_file), metadata={"format": "pt"})
    with pytest.raises(RebuildRefused) as refused:
        await rebuild_version(real_store, "v2", tmp_path / "ck")
    print(refused.value)
    assert "no checkpoint holds its bytes" in str(refused.value) and f"{name} does not match" in str(refused.value)
    assert not await real_store.weights_redis.exists(real_store.keys.weights("v2"))
    with pytest.raises(RebuildRefused, match="no checkpoint of it"):
        await rebuild_version(real_store, "v1", tmp_path / "elsewhere")
