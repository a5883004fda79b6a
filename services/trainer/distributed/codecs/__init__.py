"""Gradient codecs for data-parallel trainer ranks: codecs, chunk framing, aggregation, DDP hook.

Entry points `make_codec(name, **knobs)`, `sum_decoded` / `mean_decoded`, `make_ddp_hook`. Input any
float tensor (never modified), decoded output fp32; nobody divides by the world size before encoding.
The codecs, the Redis path step by step and the module layers: docs/design/trainer.md.
"""

from fulmen_trainer.distributed.codecs import dense, dgc, qsgd, sparse  # noqa: F401  (registers the codecs)
from fulmen_trainer.distributed.codecs.aggregate import (
    DecodedGradient,
    decode,
    decode_parts,
    mean_decoded,
    sum_decoded,
)
from fulmen_trainer.distributed.codecs.base import (
    CodecState,
    CodecStats,
    available_codecs,
    make_codec,
    register_codec,
    with_density,
)
from fulmen_trainer.distributed.codecs.ddp_hook import DDPCodecState, codec_hook, make_ddp_hook
from fulmen_trainer.distributed.codecs.dense import Bf16Codec, NoneCodec
from fulmen_trainer.distributed.codecs.dgc import DGCCodec
from fulmen_trainer.distributed.codecs.framing import FORMAT_VERSION, Payload, frame, parse_chunk, unframe
from fulmen_trainer.distributed.codecs.qsgd import QSGD4Codec, QSGD8Codec, QSGDCodec
from fulmen_trainer.distributed.codecs.sparse import BLOCK, SparseCodec, TopKCodec, pack_sparse, unpack_sparse

__all__ = [
    "BLOCK",
    "FORMAT_VERSION",
    "Bf16Codec",
    "CodecState",
    "CodecStats",
    "DDPCodecState",
    "DGCCodec",
    "DecodedGradient",
    "NoneCodec",
    "Payload",
    "QSGD4Codec",
    "QSGD8Codec",
    "QSGDCodec",
    "SparseCodec",
    "TopKCodec",
    "available_codecs",
    "codec_hook",
    "decode",
    "decode_parts",
    "frame",
    "make_codec",
    "make_ddp_hook",
    "mean_decoded",
    "pack_sparse",
    "parse_chunk",
    "register_codec",
    "sum_decoded",
    "unframe",
    "unpack_sparse",
    "with_density",
]
