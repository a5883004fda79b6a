"""`fulmen export`: samples → a dataset that Hugging Face `datasets` loads directly (JSON lines).

Every line has every column, one type per column; written whole, atomically. The columns, and why
not Parquet: docs/design/store.md.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fulmen.archive.files import files_of, read_file, record_count
from fulmen.errors import RecordError
from fulmen.records import Sample, SampleSkip
from fulmen.store.samples import decode_sample

SHAPES = ("all", "triplet", "trajectory")


@dataclass
class ExportReport:
    rows: int = 0
    duplicates: int = 0
    skips: int = 0  # skip records (rollouts without samples)
    filtered: int = 0  # samples left out by --shape or --min-reward
    unreadable: int = 0  # records that are not samples


def archived_records(sources: Iterable[Path]) -> Iterator[bytes]:
    """The sample records of archive files (a directory's samples files, or single files)."""
    for source in sources:
        for path in files_of(source, "samples"):
            _header, records = read_file(path, "samples")
            for record in records:
                if isinstance(record, list | tuple) and len(record) == 2 and isinstance(record[1], bytes):
                    yield record[1]


def archived_count(sources: Iterable[Path]) -> int | None:
    """The sample records of `archived_records`' files, as their headers say (None: a file does not say)."""
    return record_count(path for source in sources for path in files_of(source, "samples"))


def row(sample: Sample, *, token_ids: bool = False) -> dict[str, Any]:
    """One dataset row of a sample (the columns of the module's docstring; ``token_ids``: the tokens too)."""
    tokens = {
        "prompt_token_ids": list(sample.prompt_token_ids),
        "response_token_ids": list(sample.response_token_ids),
        "response_mask": list(sample.response_mask),
    } if token_ids else {}
    return {
        "messages": [_message(m) for m in sample.messages],
        "reward": sample.final_reward,
        "turn_reward": sample.reward,
        "sample_id": sample.sample_id,
        "rollout_id": sample.rollout_id,
        "attempt_id": sample.attempt_id,
        "group_key": sample.group_key,
        "shape": sample.shape,
        "model_version": sample.model_version or "",
        "mode": sample.mode or "",
        "turn_index": sample.turn_index,
        "num_turns": sample.num_turns,
        **tokens,
    }


def _message(message: dict[str, Any]) -> dict[str, str]:
    content = message.get("content")
    if isinstance(content, list):  # content parts: their text, in order
        content = "".join(str(p.get("text") or "") if isinstance(p, dict) else str(p) for p in content)
    elif content is None:
        content = ""
    elif not isinstance(content, str):
        content = json.dumps(content, ensure_ascii=False)
    if not content and message.get("tool_calls"):
        content = json.dumps(message["tool_calls"], ensure_ascii=False)
    return {"role": str(message.get("role") or ""), "content": content}


def export(records: Iterable[bytes], out: Path, max_bytes: int, *, shape: str = "all",
           min_reward: float | None = None, token_ids: bool = False) -> ExportReport:
    """Write the dataset of ``records`` (sample-stream records) to ``out``; ``token_ids``: with the tokens."""
    if shape not in SHAPES:
        raise ValueError(f"shape {shape!r} is none of {SHAPES}")
    report = ExportReport()
    seen: set[str] = set()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{os.getpid()}-{out.name}")
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            for record in records:
                try:
                    sample = decode_sample(record, max_bytes)
                except RecordError:
                    report.unreadable += 1
                    continue
                if isinstance(sample, SampleSkip):
                    report.skips += 1
                    continue
                if sample.sample_id in seen:
                    report.duplicates += 1
                    continue
                seen.add(sample.sample_id)
                if (shape != "all" and sample.shape != shape) or (
                        min_reward is not None and (sample.final_reward is None or sample.final_reward < min_reward)):
                    report.filtered += 1
                    continue
                f.write(json.dumps(row(sample, token_ids=token_ids), ensure_ascii=False) + "\n")
                report.rows += 1
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        raise
    return report
