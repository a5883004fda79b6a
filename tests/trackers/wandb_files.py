"""The records of W&B's offline run files (``run-<id>.wandb``): a LevelDB-style log of protobuf
``Record``s (W&B's own Python reader left the SDK when its core moved to Go)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
HEADER = 7  # per chunk: crc32 (4), length (2), type (1); the file opens with 7 bytes of its own
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def chunks(data: bytes) -> Iterator[bytes]:
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        if BLOCK - pos % BLOCK < HEADER:  # a block's tail too short for a header is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        body = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == FULL:
            yield body
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            yield pending + body


def records(path: Path) -> Iterator[Any]:
    from wandb.proto import wandb_internal_pb2

    for body in chunks(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(body)
        yield record


def history(path: Path) -> list[dict[str, Any]]:
    """The rows the run logged, in order, each a dict of its values."""
    return [{item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            for r in records(path) if r.WhichOneof("record_type") == "history"]


def run_ids(path: Path) -> list[str]:
    return [r.run.run_id for r in records(path) if r.WhichOneof("record_type") == "run"]


def config(path: Path) -> dict[str, Any]:
    """The run's config as its updates left it."""
    values: dict[str, Any] = {}
    for r in records(path):
        kind = r.WhichOneof("record_type")
        if kind in ("run", "config"):
            items = r.run.config.update if kind == "run" else r.config.update
            values.update({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
    return values
