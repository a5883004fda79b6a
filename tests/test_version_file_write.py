"""A shared-folder version hashed while it is written (`fulmen.versions.transport.file_write`) is the very file
the hash-then-write path produces, and what that path refuses it refuses before writing anything."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fulmen.errors import InvalidInput
from fulmen.versions.blobs import VersionTaken, blob_sha256, read_file, serialize, write_file
from fulmen.versions.manifest import FULL, LORA, Manifest, describe_all
from fulmen.versions.transport.file_write import write_file_hashing
from fulmen.versions.transport.stream import check_whole


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(64, 16, generator=g)
    return {
        "model.embed": embed, "lm_head": embed,  # tied
        "model.layers.0.w": torch.randn(32, 48, generator=g).to(torch.bfloat16),
        "model.layers.0.t": torch.randn(5, 7, generator=g).t(),  # not contiguous
        "model.layers.0.ñ": torch.arange(10, dtype=torch.int64),  # a name JSON escapes
        "model.empty": torch.empty(0, 3),
    }


@pytest.mark.parametrize("fmt", [FULL, LORA])
def test_the_file_is_the_one_hash_then_write_produces(tmp_path: Path, fmt: str) -> None:
    state = _state()
    weights, manifest = write_file_hashing(tmp_path / "a", "v1", state, fmt)
    expected_manifest = Manifest(fmt, None, describe_all(state))
    blob = serialize(state, expected_manifest)
    expected = write_file(tmp_path / "b", "v1", blob, blob_sha256(blob, expected_manifest))
    assert manifest == expected_manifest
    assert Path(weights["path"]).read_bytes() == Path(expected["path"]).read_bytes()
    assert (weights["sha256"], weights["bytes"]) == (expected["sha256"], expected["bytes"])
    assert not list((tmp_path / "a" / "v1").glob("*.partial"))
    assert check_whole("v1", read_file(Path(weights["path"])), weights["sha256"]) == "manifest"


def test_refused_weights_leave_nothing_and_a_taken_name_is_refused(tmp_path: Path) -> None:
    broken = {**_state(), "model.layers.0.w": torch.tensor([1.0, float("nan")])}
    with pytest.raises(InvalidInput, match="NaN"):
        write_file_hashing(tmp_path, "v1", broken, FULL)
    assert not (tmp_path / "v1").exists()
    write_file_hashing(tmp_path, "v1", _state(), FULL)
    with pytest.raises(VersionTaken):
        write_file_hashing(tmp_path, "v1", _state(), FULL)
