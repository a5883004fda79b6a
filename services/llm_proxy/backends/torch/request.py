"""What one generation request carries between the event loop and the torch engine's thread.

`SamplingParams` is validated when built (an `InvalidInput` names the bad field); `Request` is the
engine's own record of a submitted request: the event loop owns its queue, the engine thread the
rest. `TokenStep` is what the engine delivers per token, `Generation` a whole response.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass

from fulmen.errors import InvalidInput


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # makes one request's sampling reproducible, whatever it is batched with
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidInput(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidInput(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidInput(f"seed must be an integer or None, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(frozen=True)
class TokenStep:
    token_id: int
    logprob: float  # raw model logprob of token_id (before temperature / top-p)
    finish_reason: str | None  # "stop" | "length" on the last step, else None


@dataclass(frozen=True)
class Generation:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    model_version: str


class Request:
    """One request, shared by the event loop (its queue) and the engine thread (the rest)."""

    __slots__ = (
        "cancelled",
        "generated",
        "limit",
        "loop",
        "model_version",
        "params",
        "prompt",
        "queue",
        "rng",
    )

    def __init__(self, prompt: list[int], params: SamplingParams, limit: int) -> None:
        self.prompt = prompt
        self.params = params
        self.limit = limit  # tokens this request may generate: max_tokens capped by the context length
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[TokenStep | BaseException] = asyncio.Queue()
        self.model_version: str | None = None
        self.cancelled = False
        self.generated = 0
        # Each request owns its generator, drawn once per sampled token, so its draws depend on
        # its seed alone, never on its batch-mates.
        self.rng = random.Random(params.seed if params.seed is not None else random.getrandbits(63))
