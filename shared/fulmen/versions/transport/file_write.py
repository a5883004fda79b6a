"""A full or LoRA version written into the shared folder while its manifest is hashed.

`write_file_hashing` writes placeholder hashes first; the file equals `fulmen.versions.blobs.write_file`'s.
Why: docs/design/model-versions.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulmen.versions.blobs import Blob, blob_sha256, claimed_file, serialize, write_all
from fulmen.versions.manifest import Manifest, TensorEntry, describe_all, dtype_name

if TYPE_CHECKING:
    import torch

PLACEHOLDER_SHA256 = "0" * 64


def write_file_hashing(shared_dir: Path, version: str, state_dict: Mapping[str, torch.Tensor],
                       fmt: str) -> tuple[dict[str, Any], Manifest]:
    """Write ``state_dict`` as ``<shared_dir>/<version>/model.safetensors`` with a ``fmt`` manifest
    (full or LoRA) computed meanwhile; the weights entry and the manifest. VersionTaken if the folder
    exists; InvalidInput (nothing written) for what `serialize` refuses."""
    placeholder = Manifest(fmt, None, {
        name: TensorEntry(dtype_name(t), tuple(t.shape), PLACEHOLDER_SHA256) for name, t in state_dict.items()})
    blob = serialize(state_dict, placeholder)  # checks every tensor before anything is written
    with claimed_file(shared_dir, version, len(blob)) as (path, f), ThreadPoolExecutor(1) as pool:
        hashing = pool.submit(describe_all, state_dict)
        for part in blob.parts:
            write_all(f, part)
        manifest = Manifest(fmt, None, hashing.result())
        final = Blob(_with_manifest(blob.header, placeholder, manifest), blob.parts[1:])
        f.seek(0)
        write_all(f, final.header)
    return {"path": str(path.resolve()), "sha256": blob_sha256(final, manifest), "bytes": len(final)}, manifest


def _with_manifest(header: bytes, placeholder: Manifest, manifest: Manifest) -> bytes:
    """``header`` with ``manifest`` in place of ``placeholder`` (the same length: only hashes differ),
    as the header's JSON holds it (a string, escaped as `serialize` escapes it)."""
    old, new = (json.dumps(m.to_json())[1:-1].encode() for m in (placeholder, manifest))
    if len(old) != len(new) or header.count(old) != 1:
        raise RuntimeError("the manifest changed the header's layout")  # cannot happen: only hashes differ
    return header.replace(old, new)
