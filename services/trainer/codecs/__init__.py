"""Gradient codecs for data-parallel trainer ranks: codecs, chunk framing, aggregation, DDP hook.

Only the trainer sends gradients, so the codecs live beside it; the wire records they frame
(`fulmen.records.GradientChunk`, `GradientHeader`) live in `fulmen.records` with every other record.
Modules, lowest first (each imports only those above it): ``framing`` (payload ↔ chunks),
``base`` (the codec interface and registry), the codecs (``dense``, ``sparse``, ``dgc``, ``qsgd``),
``aggregate`` (decode and sum), ``ddp_hook``.

Codecs, by registered name (`make_codec(name, **knobs)`):

    none    fp32, lossless                                       1×
    bf16    bfloat16, round to nearest even                      2×
    topk    exact top-k by magnitude, error feedback             ~100× at density 0.01
    dgc     Deep Gradient Compression: sampled threshold,        ~100× at density 0.01
            momentum correction and masking, error feedback,
            density warm-up
    qsgd8   QSGD, 8-bit codes, a max-norm per bucket, unbiased   ~4×
    qsgd4   QSGD, 4-bit codes, two a byte, unbiased              ~8×

The Redis path, one step on one rank (the trainer does the XADD/XREAD):

    codec = make_codec("dgc", density=0.01, momentum=0.0)        # once; checkpoint codec.state_dict()
    flat = torch.cat([p.grad.view(-1) for p in params])          # one flat buffer (or one per bucket name)
    chunks = codec.encode(flat, name="grads", step=step, rank=rank)   # list[bytes], each <= 8 MiB
    ... XADD each chunk; the leader XREADs every rank's chunks for this step, its own included ...
    avg = mean_decoded([chunks_rank0, chunks_rank1, ...])        # fp32 sum in rank order / world size
    ... (the trainer pre-scales each rank's gradient by its token share and uses sum_decoded) ...
    torch._utils._unflatten_dense_tensors / a loop of p.grad.copy_(avg[o:o + n].view_as(p))
    optimizer.step()

Input: any float tensor (used as a flat fp32 vector; never modified). Output of decoding: fp32 with
the encoded shape. Error-feedback state is per ``name`` and updated in place by ``encode``; it is
in ``state_dict()``. Nobody divides by the world size before encoding; `mean_decoded` does after
summing. `make_ddp_hook` offers the same codecs to ``DistributedDataParallel.register_comm_hook``.
"""

from fulmen_trainer.codecs import dense, dgc, qsgd, sparse  # noqa: F401  (registers the codecs)
from fulmen_trainer.codecs.aggregate import DecodedGradient, decode, decode_parts, mean_decoded, sum_decoded
from fulmen_trainer.codecs.base import (
    CodecState,
    CodecStats,
    available_codecs,
    make_codec,
    register_codec,
    with_density,
)
from fulmen_trainer.codecs.ddp_hook import DDPCodecState, codec_hook, make_ddp_hook
from fulmen_trainer.codecs.dense import Bf16Codec, NoneCodec
from fulmen_trainer.codecs.dgc import DGCCodec
from fulmen_trainer.codecs.framing import FORMAT_VERSION, Payload, frame, parse_chunk, unframe
from fulmen_trainer.codecs.qsgd import QSGD4Codec, QSGD8Codec, QSGDCodec
from fulmen_trainer.codecs.sparse import BLOCK, SparseCodec, TopKCodec, pack_sparse, unpack_sparse

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
