"""Model version formats (issue 16, item 1): every version carries a manifest (per tensor dtype, shape,
sha256); a delta holds only the elements whose bits changed, rebuilds the next version bit for bit,
and refuses to apply onto weights that are not its base; a chain of deltas is rebuilt from the store."""

from __future__ import annotations

import pytest
import torch

from fulmen.errors import InvalidInput, NotFound, RecordError
from fulmen.store import RedisStore
from fulmen.versions.delta import IDX, VAL, apply_delta, encode_delta
from fulmen.versions.manifest import DELTA, FULL, Manifest, describe_all, tensor_sha256
from fulmen.versions.model_version import fetch_full_version, fetch_version, publish_model_version
from fulmen.versions.retention import retain_versions, stored_versions


def _weights(seed: int = 0, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(64, 32, generator=g).to(dtype), "b.weight": torch.randn(16, generator=g).to(dtype),
            "steps": torch.tensor([3, 4], dtype=torch.int64)}


def _step(state: dict[str, torch.Tensor], lr: float, seed: int) -> dict[str, torch.Tensor]:
    """An update as a trainer makes it: fp32 master weights moved a little, then rounded to the dtype."""
    g = torch.Generator().manual_seed(seed)
    return {n: (t.float() + lr * torch.randn(t.shape, generator=g)).to(t.dtype) if t.is_floating_point() else t
            for n, t in state.items()}


def _delta(previous: dict[str, torch.Tensor], current: dict[str, torch.Tensor], base: str) -> tuple[dict, Manifest]:
    return encode_delta(previous, current), Manifest(DELTA, base, describe_all(current))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_delta_rebuilds_the_next_version_bit_for_bit(dtype: torch.dtype) -> None:
    old = _weights(dtype=dtype)
    new = _step(old, 1e-3, seed=1)
    delta, manifest = _delta(old, new, "v1")
    assert "steps" not in delta and not any(k.startswith("steps") for k in delta)  # unchanged: left out
    changed = apply_delta(delta, manifest, old.__getitem__, "v2")
    rebuilt = {**old, **changed}
    assert all(torch.equal(rebuilt[n].view(-1).view(torch.uint8) if rebuilt[n].is_floating_point() else rebuilt[n],
                           new[n].view(-1).view(torch.uint8) if new[n].is_floating_point() else new[n]) for n in new)
    assert torch.equal(old["a.weight"], _weights(dtype=dtype)["a.weight"])  # the base is never modified
    if dtype == torch.bfloat16:  # a small step keeps most bf16 elements' bits: the delta is sparse
        assert "a.weight" + IDX in delta and delta["a.weight" + IDX].numel() < 0.5 * new["a.weight"].numel()


def test_a_big_change_is_sent_whole_and_nothing_changed_is_an_empty_delta() -> None:
    old = _weights(dtype=torch.float32)
    new = _step(old, 1.0, seed=2)  # every fp32 element changes
    delta = encode_delta(old, new)
    assert set(delta) == {"a.weight", "b.weight"} and torch.equal(delta["a.weight"], new["a.weight"])
    assert encode_delta(old, old) == {}
    assert encode_delta({}, old).keys() == old.keys()  # nothing to compare against: every tensor whole


def test_a_delta_applied_onto_other_weights_is_refused() -> None:
    old = _weights()
    new = _step(old, 1e-3, seed=3)
    delta, manifest = _delta(old, new, "v1")
    assert "a.weight" + IDX in delta  # sparse: rebuilt from the base
    other = _weights(seed=9)
    with pytest.raises(RecordError, match="manifest's sha256"):
        apply_delta(delta, manifest, other.__getitem__, "v2")
    broken = {**delta, "a.weight" + VAL: delta["a.weight" + VAL] + 1}
    with pytest.raises(RecordError, match=r"a\.weight"):
        apply_delta(broken, manifest, old.__getitem__, "v2")


def test_the_manifest_describes_every_tensor() -> None:
    state = _weights()
    manifest = Manifest(FULL, None, describe_all(state))
    again = Manifest.from_json(manifest.to_json(), "v1")
    assert again == manifest
    assert again.tensors["a.weight"].dtype == "bfloat16" and again.tensors["a.weight"].shape == (64, 32)
    assert again.tensors["steps"].sha256 == tensor_sha256(state["steps"])
    for bad in ('{"format": "zip", "tensors": {}}', '{"format": "delta", "tensors": {}}', "[1]", '{"tensors": 3}'):
        with pytest.raises(RecordError):
            Manifest.from_json(bad, "v1")


async def test_a_published_version_carries_its_manifest(real_store: RedisStore) -> None:
    state = _weights()
    await publish_model_version(real_store, state, model="m")
    found = await fetch_version(real_store, "v1")
    assert found.manifest is not None and found.manifest.format == FULL and found.manifest.base_version is None
    assert found.manifest.tensors == describe_all(state)


async def test_a_chain_of_deltas_is_rebuilt_from_the_store_and_retention_keeps_it(real_store: RedisStore) -> None:
    versions = [_weights()]
    await publish_model_version(real_store, versions[0], model="m", model_version="v1")
    for i in range(2, 6):
        versions.append(_step(versions[-1], 1e-3, seed=i))
        delta, manifest = _delta(versions[-2], versions[-1], f"v{i - 1}")
        await publish_model_version(real_store, delta, model="m", model_version=f"v{i}", manifest=manifest,
                                    weights_format={"format": DELTA, "base_version": f"v{i - 1}"})
    stored = await fetch_version(real_store, "v5")
    assert stored.manifest is not None and stored.manifest.format == DELTA and stored.manifest.base_version == "v4"
    full = await fetch_full_version(real_store, "v5")
    assert full.manifest is not None and full.manifest.format == FULL
    assert all(tensor_sha256(full.state[n]) == tensor_sha256(versions[-1][n]) for n in versions[-1])
    # keep 1: v5 stays, and so does every version it is rebuilt from
    assert await retain_versions(real_store, 1) == []
    assert await stored_versions(real_store) == ["v1", "v2", "v3", "v4", "v5"]
    # a full version cuts the chain: everything before it may go
    await publish_model_version(real_store, versions[-1], model="m", model_version="v6")
    assert await retain_versions(real_store, 1) == ["v1", "v2", "v3", "v4", "v5"]
    assert await stored_versions(real_store) == ["v6"]
    assert not await real_store.redis.hlen(real_store.keys.version_bases)


async def test_a_delta_whose_base_is_gone_says_so(real_store: RedisStore) -> None:
    old, new = _weights(), _step(_weights(), 1e-3, seed=1)
    await publish_model_version(real_store, old, model="m", model_version="v1")
    delta, manifest = _delta(old, new, "v1")
    await publish_model_version(real_store, delta, model="m", model_version="v2", manifest=manifest,
                                weights_format={"format": DELTA, "base_version": "v1"})
    await real_store.redis.delete(real_store.keys.weights("v1"))
    with pytest.raises(NotFound, match="v2 is a delta on v1, whose weights are gone"):
        await fetch_full_version(real_store, "v2")


async def test_a_delta_without_its_manifest_is_refused(real_store: RedisStore) -> None:
    with pytest.raises(InvalidInput, match="needs its manifest"):
        await publish_model_version(real_store, _weights(), model="m", weights_format={"format": DELTA, "base_version": "v1"})


def test_a_blob_is_standard_safetensors_read_back_without_copies() -> None:
    """The blob Fulmen writes loads with the safetensors library itself; read back, its tensors equal
    the originals (every dtype, an empty and a 0-d tensor) and view the blob's buffer."""
    from safetensors.torch import load

    from fulmen.versions.blobs import deserialize, serialize

    state = {"w": torch.randn(3, 5).to(torch.bfloat16), "d": torch.randn(4, dtype=torch.float64),
             "i": torch.arange(7, dtype=torch.int32), "b": torch.tensor([True, False]), "u": torch.arange(3, dtype=torch.uint8),
             "h": torch.randn(2, 2).half(), "empty": torch.zeros(0, 4), "scalar": torch.tensor(2.5)}
    parts = serialize(state, Manifest(FULL, None, describe_all(state)))
    blob = parts.joined()
    assert b"".join(parts.chunks(7)) == blob and {len(c) for c in list(parts.chunks(7))[:-1]} == {7}
    assert {n: t.dtype for n, t in load(bytes(blob)).items()} == {n: t.dtype for n, t in state.items()}
    found = deserialize("v1", blob, None)
    assert found.manifest is not None and found.manifest.tensors == describe_all(state)
    for name, tensor in state.items():
        assert torch.equal(found.state[name], tensor), name
    import ctypes

    start = ctypes.addressof((ctypes.c_char * len(blob)).from_buffer(blob))
    for name in ("w", "d", "i"):  # views of the blob's own buffer: no copy was made
        assert start <= found.state[name].data_ptr() < start + len(blob), name


def test_a_blob_is_written_from_the_tensors_own_memory() -> None:
    """Serialising copies nothing: every part after the header is a view of a tensor's storage."""
    from fulmen.versions.blobs import serialize

    state = {"a": torch.randn(64, 32), "b": torch.randn(16).to(torch.bfloat16)}
    blob = serialize(state, Manifest(FULL, None, describe_all(state)))
    addresses = sorted(int(torch.frombuffer(part, dtype=torch.uint8).data_ptr()) for part in blob.parts[1:])
    assert addresses == sorted(t.data_ptr() for t in state.values())


@pytest.mark.parametrize("header", [b"[1]", b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 99]}}',
                                    b'{"w": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}', b"{bad"])
def test_a_malformed_blob_is_refused_with_the_reason(header: bytes) -> None:
    import struct

    from fulmen.versions.blobs import deserialize

    with pytest.raises(RecordError, match="v1"):
        deserialize("v1", struct.pack("<Q", len(header)) + header + bytes(16), None)
    with pytest.raises(RecordError, match="v1"):
        deserialize("v1", struct.pack("<Q", 10**9) + header, None)
