"""A full or LoRA version written into the shared folder while its manifest is hashed (issue 16).

The file begins with its header, and the header holds every tensor's sha256 (the manifest), so the
usual order is: hash every tensor, then write the file — two passes over the weights one after the
other. But the header's length does not depend on the hashes (64 hex digits each), so
`write_file_hashing` writes the header with placeholder hashes, then every tensor's bytes in order
while a pool hashes them, then the real header over the placeholder one. The file is the same, byte
for byte, as `fulmen.version_blobs.write_file` writes; what a reader checks is the same. A reader
that expects the version (`fulmen.version_file_follow`) learns the layout from the placeholder header
and hashes each tensor as soon as the file holds it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulmen.version_blobs import Blob, blob_sha256, claimed_file, serialize, write_all
from fulmen.version_manifest import Manifest, TensorEntry, describe_all, dtype_name

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
