"""Benchmark: what a span batch costs in Redis's memory and in the adapter's decompression, by zstd level
and by how the token ids are laid out, for two kinds of batch.

- ``bench``: one rollout of `adapter_throughput` (8 spans, 2 calls of 512 + 128 ids drawn uniformly
  under 32,000, repetitive message text), as that benchmark stores it.
- ``call``: one LLM call as the proxy stores it (one span a batch): a context of English text (this
  repository's docs) of ``--context`` tokens, ids drawn Zipf-like under 151,646 (a large vocabulary's
  frequent tokens have small ids), 128 response ids with their log-probabilities.

Layouts: ``int32`` (as stored before byte planes), ``narrow`` (2 bytes an id for the bench's vocabulary,
3 for the large one), ``planes`` (`fulmen.tokens.pack_ids`: the int32 bytes as four byte planes). The decompression is timed in
this process (`time.process_time`, best of 5).

    python bench/span_batch_codec.py [--context 4096]

Progress goes to stderr; the figures are ONE JSON object on the last line of stdout.
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import random
import sys
import time
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import zstandard

sys.path.insert(0, str(Path(__file__).parent))
from adapter_throughput import trace

from fulmen import tokens
from fulmen.telemetry import semconv

ROOT = Path(__file__).resolve().parents[1]
ID_KEYS = (semconv.PROMPT_TOKEN_IDS, semconv.RESPONSE_TOKEN_IDS)
LARGE_VOCAB = 151_646


def layout(packed: bytes, how: str, width: int) -> bytes:
    """Packed ids (`fulmen.tokens`, either form) laid out as ``how``."""
    ids = tokens.ids(packed)
    if how == "int32":
        return array("i", ids).tobytes()
    if how == "narrow":
        return b"".join(i.to_bytes(width, "little") for i in ids)
    return tokens.pack_ids(ids)  # planes


def bench_batch(rng: random.Random, how: str) -> bytes:
    records = []
    for span in trace("ro-1", "at-1", rng):
        attributes = {key: layout(value, how, 2) if key in ID_KEYS else value for key, value in span.attributes.items()}
        records.append(msgpack.packb([span.rollout_id, span.span_id, span.name, attributes], use_bin_type=True))
    return msgpack.packb(records, use_bin_type=True)


def call_batch(rng: random.Random, how: str, text: str, context: int, zipf: Callable[[int], list[int]]) -> bytes:
    start = rng.randrange(len(text) - 4 * context - 1024)
    attributes = {
        semconv.SPAN_KIND: semconv.KIND_LLM_CALL,
        semconv.PROMPT_TOKEN_IDS: layout(array("i", zipf(context)).tobytes(), how, 3),
        semconv.RESPONSE_TOKEN_IDS: layout(array("i", zipf(128)).tobytes(), how, 3),
        semconv.RESPONSE_LOGPROBS: array("f", [-rng.random() ** 3 for _ in range(128)]).tobytes(),
        semconv.REQUEST_JSON: json.dumps({"model": "policy", "messages": [
            {"role": "user", "content": text[start:start + 4 * context]}]}),
        semconv.RESPONSE_JSON: json.dumps({"role": "assistant", "content": text[start + 4 * context:][:512]}),
    }
    span = ["ro-1", "at-1", "c000000000000000", "chat policy", "a" * 32, None, 1.0, 2.0, attributes]
    return msgpack.packb([msgpack.packb(span, use_bin_type=True)], use_bin_type=True)


def zipf_sampler(rng: random.Random) -> Callable[[int], list[int]]:
    cumulative = list(itertools.accumulate(1 / (rank + 10) ** 1.1 for rank in range(LARGE_VOCAB)))
    total = cumulative[-1]
    return lambda n: [min(LARGE_VOCAB - 1, bisect.bisect(cumulative, rng.random() * total)) for _ in range(n)]


def measure(raws: list[bytes], level: int) -> dict[str, float]:
    blobs = [zstandard.ZstdCompressor(level=level).compress(raw) for raw in raws]
    decompressor, best = zstandard.ZstdDecompressor(), float("inf")
    for _ in range(5):
        start = time.process_time()
        for _ in range(10):
            for blob in blobs:
                decompressor.decompress(blob)
        best = min(best, (time.process_time() - start) / (10 * len(blobs)))
    return {"stored_bytes": round(sum(map(len, blobs)) / len(blobs)), "decompress_us": round(best * 1e6, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=4096, help="the call batch's context, in tokens")
    parser.add_argument("--batches", type=int, default=50)
    args = parser.parse_args()
    rng = random.Random(0)
    text = "".join(p.read_text() for p in sorted((ROOT / "docs").rglob("*.md")))
    zipf = zipf_sampler(rng)
    figures: dict[str, Any] = {}
    for kind in ("bench", "call"):
        for how in ("int32", "narrow", "planes"):
            raws = [bench_batch(rng, how) if kind == "bench" else call_batch(rng, how, text, args.context, zipf)
                    for _ in range(args.batches)]
            for level in (1, -1):
                figures[f"{kind}/{how}/level{level}"] = measure(raws, level)
                print(f"[span_batch_codec] {kind} {how} level {level}: {figures[f'{kind}/{how}/level{level}']}",
                      file=sys.stderr, flush=True)
    figures["context_tokens"] = args.context
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
