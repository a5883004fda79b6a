"""The codec interface, the registry of codecs by name, and the statistics every codec keeps.

A codec is a state object (knobs, internal state, statistics, as ``PowerSGDState``); decoding needs
no state. ``state_dict`` keeps knobs, residuals, momenta, generator and warm-up; not statistics.
More: docs/design/trainer.md.
"""

from __future__ import annotations

import contextlib
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np
import torch

from fulmen.codec import DEFAULT_MAX_RECORD_BYTES
from fulmen.errors import InvalidInput, RecordError
from fulmen_trainer.distributed.codecs.framing import FORMAT_VERSION, Payload, frame

log = logging.getLogger(__name__)

@dataclass(slots=True)
class CodecStats:
    """Counters since the last reset. Raw bytes are the fp32 size of the gradients; wire bytes are the
    framed chunks exactly as they go on the wire (headers included)."""

    encode_calls: int = 0
    elements: int = 0
    selected: int = 0
    raw_bytes: int = 0
    wire_bytes: int = 0
    chunks: int = 0
    encode_s: float = 0.0
    decode_calls: int = 0
    decode_s: float = 0.0

    def as_metrics(self) -> dict[str, float]:
        return {
            "comm/encode_calls": self.encode_calls,
            "comm/raw_bytes": self.raw_bytes,
            "comm/wire_bytes": self.wire_bytes,
            "comm/chunks": self.chunks,
            "comm/compression_ratio": self.raw_bytes / self.wire_bytes if self.wire_bytes else 0.0,
            "comm/density": self.selected / self.elements if self.elements else 0.0,
            "comm/encode_s": self.encode_s,
            "comm/decode_calls": self.decode_calls,
            "comm/decode_s": self.decode_s,
        }


def as_flat_fp32(grad: torch.Tensor) -> torch.Tensor:
    """A contiguous 1-D float32 CPU view of ``grad`` (a copy only when it is not already one)."""
    if not isinstance(grad, torch.Tensor):
        raise InvalidInput(f"a gradient must be a torch.Tensor, got {type(grad).__name__}")
    if not grad.is_floating_point():
        raise InvalidInput(f"a gradient must be a floating-point tensor, got {grad.dtype}")
    return grad.detach().to(device="cpu", dtype=torch.float32).contiguous().view(-1)


class CodecState(ABC):
    """Base of every codec. Subclasses set ``name`` (by `register_codec`) and implement ``_compress``
    and ``decompress``.

    ``encode`` contract: ``grad`` is any-shaped floating tensor (converted to contiguous fp32 on CPU,
    a copy only if needed); it is never modified. The gradient is encoded as the caller gives it:
    nothing is divided by the world size here (see `fulmen_trainer.distributed.codecs.aggregate`). Error-feedback
    state for ``name`` is updated in place.
    """

    name: ClassVar[str] = ""
    sparse: ClassVar[bool] = False  # payload is (indices, values): aggregate with a sparse add
    lossless: ClassVar[bool] = False

    def __init__(self, *, seed: int = 0, max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> None:
        # --- knobs
        if not isinstance(seed, int) or seed < 0:
            raise InvalidInput(f"seed must be a non-negative int, got {seed!r}")
        if max_record_bytes < 64 * 1024:
            raise InvalidInput(f"max_record_bytes must be at least 64 KiB, got {max_record_bytes}")
        self.seed = seed
        self.max_record_bytes = max_record_bytes
        # --- internal state
        self._rng: np.random.Generator | None = None  # created at the first encode: needs the rank
        # --- statistics
        self.stats = CodecStats()

    # -- knobs ----------------------------------------------------------------------------------

    def knobs(self) -> dict[str, Any]:
        """The constructor arguments, as plain values (`make_codec(name, **knobs())` rebuilds it)."""
        return {"seed": self.seed, "max_record_bytes": self.max_record_bytes}

    # -- encode ---------------------------------------------------------------------------------

    def encode(self, grad: torch.Tensor, *, name: str = "grad", step: int = 0, rank: int = 0) -> list[bytes]:
        """Compress ``grad`` and frame it: a list of msgpack records, each under ``max_record_bytes``.

        ``name`` keys the error-feedback state (one residual per name); ``step`` and ``rank`` go in the
        headers (and ``step`` drives schedules such as DGC's density warm-up).
        """
        t0 = time.perf_counter()
        flat = as_flat_fp32(grad)
        rng = self._generator(rank)
        payload = self._compress(flat, name, step, rng)
        chunks = frame(
            payload,
            codec=self.name,
            step=step,
            rank=rank,
            name=name,
            shape=list(grad.shape),
            dtype=str(grad.dtype).removeprefix("torch."),
            max_record_bytes=self.max_record_bytes,
        )
        s = self.stats
        s.encode_s += time.perf_counter() - t0
        s.encode_calls += 1
        s.elements += flat.numel()
        s.selected += flat.numel() if payload.selected is None else payload.selected
        s.raw_bytes += flat.numel() * 4
        s.wire_bytes += sum(len(c) for c in chunks)
        s.chunks += len(chunks)
        return chunks

    @abstractmethod
    def _compress(self, flat: torch.Tensor, name: str, step: int, rng: np.random.Generator) -> Payload:
        """Compress a contiguous 1-D fp32 CPU tensor (never modified); update the state of ``name``."""

    @classmethod
    @abstractmethod
    def decompress(cls, payload: memoryview, meta: dict[str, Any], numel: int) -> Any:
        """Payload bytes → a dense fp32 numpy array of ``numel`` elements, or for sparse codecs an
        ``(indices int64, values float32)`` pair of unique indices. Raises RecordError on a payload
        that does not fit ``meta`` and ``numel``."""

    def reset(self, name: str | None = None) -> None:
        """Forget the error-feedback state of ``name`` (all when None); codecs without any ignore it."""
        return None

    def flush(self, name: str) -> torch.Tensor | None:
        """What error feedback still holds back for ``name`` (an fp32 vector), cleared; None if nothing
        (a full sync sends it with the gradient)."""
        return None

    # -- statistics -----------------------------------------------------------------------------

    def compression_stats(self, reset: bool = False) -> dict[str, float]:
        """Counters since the last reset as ``comm/*`` metrics (ratio = raw fp32 bytes / wire bytes,
        headers included); ``reset=True`` starts a new period (call it once per step)."""
        metrics = self.stats.as_metrics()
        if reset:
            self.stats = CodecStats()
        return metrics

    # -- checkpoints ----------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume (copies: later encodes do not change a saved checkpoint). Tensors
        (fp32, CPU) only under ``residuals`` and ``momenta`` (name → tensor), fit for safetensors;
        everything else is plain values that msgpack and JSON can hold (the generator's 128-bit state
        as decimal strings). Save it with the model and optimizer."""
        return {
            "codec": self.name,
            "format": FORMAT_VERSION,
            "knobs": self.knobs(),
            "rng": None if self._rng is None else _rng_state(self._rng),
            **self._extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` saved. A state of another codec, or with other knobs, is refused."""
        if state.get("codec") != self.name:
            raise InvalidInput(f"state_dict is for codec {state.get('codec')!r}, not {self.name!r}")
        if state.get("format") != FORMAT_VERSION:
            raise InvalidInput(f"state_dict has format {state.get('format')!r}, expected {FORMAT_VERSION}")
        if state.get("knobs") != self.knobs():
            raise InvalidInput(
                f"state_dict knobs {state.get('knobs')!r} differ from this codec's {self.knobs()!r}"
            )
        self._rng = None if state.get("rng") is None else _rng_from_state(state["rng"])
        self._load_extra_state(state)

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        return None

    # -- internals ------------------------------------------------------------------------------

    def _generator(self, rank: int) -> np.random.Generator:
        # One stream per (seed, rank): ranks draw independent noise (so quantisation noise averages
        # out over ranks), and the DDP hook and the Redis path draw the same numbers for one rank.
        if self._rng is None:
            self._rng = np.random.default_rng([self.seed, rank])
        return self._rng

    def __repr__(self) -> str:
        knobs = ", ".join(f"{k}={v!r}" for k, v in self.knobs().items())
        return f"{type(self).__name__}({knobs})"


def _rng_state(rng: np.random.Generator) -> dict[str, Any]:
    # PCG64's state and increment are 128-bit ints: msgpack cannot hold them, so they travel as text.
    state = rng.bit_generator.state
    return {
        "bit_generator": state["bit_generator"],
        "state": str(state["state"]["state"]),
        "inc": str(state["state"]["inc"]),
        "has_uint32": int(state["has_uint32"]),
        "uinteger": int(state["uinteger"]),
    }


def _rng_from_state(saved: dict[str, Any]) -> np.random.Generator:
    if saved.get("bit_generator") != "PCG64":
        raise InvalidInput(f"state_dict has a {saved.get('bit_generator')!r} generator state, expected PCG64")
    rng = np.random.Generator(np.random.PCG64())
    rng.bit_generator.state = {
        "bit_generator": "PCG64",
        "state": {"state": int(saved["state"]), "inc": int(saved["inc"])},
        "has_uint32": int(saved["has_uint32"]),
        "uinteger": int(saved["uinteger"]),
    }
    return rng


_CODECS: dict[str, type[CodecState]] = {}
C = TypeVar("C", bound=type[CodecState])


def register_codec(name: str) -> Callable[[C], C]:
    """Class decorator: make a codec available as ``make_codec(name, ...)`` and to decoders."""

    def decorator(cls: C) -> C:
        if name in _CODECS:
            raise ValueError(f"codec {name!r} is already registered by {_CODECS[name].__name__}")
        cls.name = name
        _CODECS[name] = cls
        return cls

    return decorator


def codec_class(name: str) -> type[CodecState]:
    try:
        return _CODECS[name]
    except KeyError:
        raise RecordError(f"unknown codec {name!r}; this Fulmen knows {sorted(_CODECS)}") from None


def make_codec(name: str, **knobs: Any) -> CodecState:
    """A new codec state by registered name, e.g. ``make_codec("dgc", density=0.01)``."""
    if name not in _CODECS:
        raise InvalidInput(f"unknown codec {name!r}; choose one of {sorted(_CODECS)}")
    return _CODECS[name](**knobs)


def available_codecs() -> list[str]:
    return sorted(_CODECS)


def check_section(payload: memoryview, offset: int, nbytes: int, what: str) -> memoryview:
    """The ``nbytes`` at ``offset`` of ``payload``, or RecordError when the payload is too short."""
    if offset + nbytes > payload.nbytes:
        raise RecordError(
            f"payload is {payload.nbytes} bytes, too short for its {what} ({offset + nbytes} needed)"
        )
    return payload[offset : offset + nbytes]


def check_end(payload: memoryview, offset: int) -> None:
    if offset != payload.nbytes:
        raise RecordError(f"payload is {payload.nbytes} bytes, expected {offset} from its header")


@contextlib.contextmanager
def with_density(state: Any, density: float | None) -> Iterator[None]:
    """A sparse codec encodes at ``density`` for one call; its own knob (checkpointed) stays as set."""
    own = getattr(state, "density", None)
    if density is None or own is None:
        yield
        return
    state.density = density
    try:
        yield
    finally:
        state.density = own
