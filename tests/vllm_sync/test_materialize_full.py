"""vllm-sync writes a full version's published blob as the folder's weights file: what vLLM then
reads holds exactly the trainer's tensors, and a corrupt chunk or file leaves no folder behind."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fulmen.errors import RecordError
from fulmen.store import RedisStore
from fulmen.versions.delta import encode_delta
from fulmen.versions.manifest import DELTA, Manifest, describe_all
from fulmen.versions.model_version import llm_resource, publish_model_version
from fulmen.versions.transport.folder import FolderTransport
from fulmen.versions.transport.redis import RedisTransport
from fulmen_vllm_sync.materialize import materialize_full


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(40, 16, generator=g).to(torch.bfloat16),
            "layer.0.weight": torch.randn(16, 16, generator=g), "layer.0.bias": torch.randn(16, generator=g)}


def _model_dir(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"the base weights: never copied into a version's folder")
    return model


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[n].dtype == b[n].dtype and a[n].view(torch.uint8).equal(
        b[n].contiguous().view(torch.uint8)) for n in a)


@pytest.mark.parametrize("shared", [False, True])
async def test_full_version_becomes_the_folder_bit_for_bit(real_store: RedisStore, tmp_path: Path, shared: bool) -> None:
    weights = _weights(0)
    update = await publish_model_version(real_store, weights, model="m",
                                         transport=FolderTransport(tmp_path / "shared") if shared else RedisTransport(chunk_bytes=700))
    folder = await materialize_full(real_store, "v1", llm_resource(update)["weights"],  # type: ignore[index]
                                    _model_dir(tmp_path), tmp_path / "sync")
    assert folder == tmp_path / "sync" / "v1"
    assert (folder / "config.json").exists()
    assert _equal(load_file(str(folder / "model.safetensors")), weights)


@pytest.mark.parametrize("shared", [False, True])
async def test_a_corrupt_version_leaves_no_folder(real_store: RedisStore, tmp_path: Path, shared: bool) -> None:
    update = await publish_model_version(real_store, _weights(1), model="m",
                                         transport=FolderTransport(tmp_path / "shared") if shared else RedisTransport(chunk_bytes=700))
    entry = llm_resource(update)["weights"]  # type: ignore[index]
    if shared:
        path = Path(entry["path"])
        raw = bytearray(path.read_bytes())
        raw[-3] ^= 1
        path.write_bytes(bytes(raw))
    else:
        key = entry["stream"]
        entries = await real_store.redis.xrange(key)
        await real_store.redis.delete(key)
        for n, (entry_id, fields) in enumerate(entries, start=1):
            data = fields[b"d"] if n < len(entries) else bytes([fields[b"d"][0] ^ 1]) + fields[b"d"][1:]
            await real_store.redis.xadd(key, {"m": fields[b"m"], "d": data}, id=entry_id.decode())
    with pytest.raises(RecordError, match="corrupt"):
        await materialize_full(real_store, "v1", entry, _model_dir(tmp_path), tmp_path / "sync")
    assert not (tmp_path / "sync" / "v1").exists()
    assert [p.name for p in (tmp_path / "sync").iterdir()] == []


async def test_a_delta_is_left_to_the_caller(real_store: RedisStore, tmp_path: Path) -> None:
    """A blob whose manifest is not a full version's (a delta published without its format in the
    resource) is not written as a folder: its bytes are not the model's weights."""
    old, new = _weights(2), _weights(3)
    await publish_model_version(real_store, old, model="m")
    manifest = Manifest(DELTA, "v1", describe_all(new))
    update = await publish_model_version(real_store, encode_delta(old, new), model="m", manifest=manifest,
                                         weights_format={"format": DELTA, "base_version": "v1"})
    entry = {k: v for k, v in llm_resource(update)["weights"].items() if k != "format"}  # type: ignore[index]
    assert await materialize_full(real_store, "v2", entry, _model_dir(tmp_path), tmp_path / "sync") is None
    assert not (tmp_path / "sync" / "v2").exists()


@pytest.mark.parametrize("shared", [False, True])
async def test_a_dropped_folders_file_takes_a_later_version(real_store: RedisStore, tmp_path: Path, shared: bool) -> None:
    """Folders past ``keep`` leave their weights file for the next version to be written over (its
    pages cached): each folder still holds exactly its version's tensors."""
    import os

    sync, inodes = tmp_path / "sync", {}
    for n in range(1, 6):
        weights = _weights(10 + n)
        update = await publish_model_version(real_store, weights, model="m",
                                             transport=FolderTransport(tmp_path / "shared") if shared else RedisTransport(chunk_bytes=700))
        folder = await materialize_full(real_store, f"v{n}", llm_resource(update)["weights"],  # type: ignore[index]
                                        _model_dir(tmp_path / f"m{n}"), sync, keep=2)
        assert folder is not None and _equal(load_file(str(folder / "model.safetensors")), weights)
        inodes[n] = os.stat(folder / "model.safetensors").st_ino
    assert sorted(p.name for p in sync.iterdir() if not p.name.startswith(".")) == ["v4", "v5"]
    assert (inodes[4], inodes[5]) == (inodes[1], inodes[2])  # v1's and v2's files, written over
