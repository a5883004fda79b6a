"""Training samples (adapter -> trainer) and the skip record of a rollout that yielded none."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

from fulmen import tokens
from fulmen.codec import DEFAULT_MAX_RECORD_BYTES, pack_record
from fulmen.errors import RecordError
from fulmen.records.base import (
    Record,
    require,
    require_at_least,
    require_finite,
    require_nonempty,
    wire_codec,
)
from fulmen.records.spans import SpanView
from fulmen.records.status import RolloutStatus

SHAPES = ("triplet", "trajectory")


@dataclass(frozen=True, slots=True)
class Sample(Record):
    """One training sample on the samples stream: a (prompt, response, reward) triplet of one LLM call,
    or a whole multi-turn trajectory (``shape`` says which).

    Token ids, log-probabilities and the mask are packed arrays on the wire (`fulmen.tokens`);
    `from_wire` gives lists, and a producer may hand the packed bytes straight in (the adapter does). A trajectory's ``response_token_ids`` hold everything after its first prompt: the model's own
    tokens (``response_mask`` 1, with their log-probabilities) and the tokens the environment added
    between turns (mask 0, log-probability 0.0). A triplet's mask is all ones."""

    KIND: ClassVar[str] = "sample"

    sample_id: str  # "<attempt_id>/t<turn>" or "<attempt_id>/traj<first turn>": unique, stable
    shape: str  # "triplet" | "trajectory"
    rollout_id: str
    attempt_id: str
    group_key: str  # the task: GRPO groups the samples of one task
    turn_index: int  # triplet: the LLM call's index in the attempt; trajectory: its first turn
    prompt_token_ids: list[int] = field(metadata=wire_codec(tokens.pack_ids, tokens.ids))
    response_token_ids: list[int] = field(metadata=wire_codec(tokens.pack_ids, tokens.ids))
    response_logprobs: list[float] = field(metadata=wire_codec(tokens.pack_floats, tokens.floats))
    response_mask: list[int] = field(metadata=wire_codec(tokens.pack_mask, tokens.mask))
    reward: float | None  # the reward matched to this call (triplet) or the final one (trajectory)
    final_reward: float | None  # the attempt's last reward, for trajectory-level credit
    model_version: str | None
    mode: str | None = None  # train | val | test, from the rollout
    group_size: int | None = None  # rollouts in the group, when the algorithm said
    num_turns: int = 1
    # the last call's request body and response message as the proxy recorded them (JSON text, kept
    # as text: the adapter need not parse them; `messages`, `prompt_text`, `response_text` do, on demand)
    request_json: str = ""
    response_json: str = ""
    # token ids the adapter made from a text-only call's text with the policy's tokenizer (a teacher's
    # answer): no log-probabilities (zeros), for SFT only (`fulmen_adapter.retokenize`)
    retokenized: bool = False

    def check_wire(self) -> None:
        """Values a trainer can use: ids, a known shape, tokens to train on, finite numbers. Token ids
        are checked against the vocabulary by the trainer, the one reader that knows it."""
        require_nonempty(self, "sample_id", "rollout_id", "attempt_id", "group_key")
        require(self, self.shape in SHAPES, f"shape {self.shape!r} is none of {SHAPES}")
        require_at_least(self, 0, "turn_index")
        require_at_least(self, 1, "num_turns", "group_size")
        require_finite(self, "reward", "final_reward")
        prompt, response = self.prompt_token_ids, self.response_token_ids
        require(self, bool(prompt) and bool(response), "a sample needs prompt and response token ids")
        require(self, min(prompt) >= 0 and min(response) >= 0, "token ids must not be negative")
        n = len(response)
        require(self, len(self.response_logprobs) == n and len(self.response_mask) == n,
                f"{n} response tokens, {len(self.response_logprobs)} log-probabilities, "
                f"{len(self.response_mask)} mask values")
        # a sum is finite only if every term is (NaN and ±inf propagate), at C speed
        require(self, math.isfinite(sum(self.response_logprobs)), "a log-probability is not finite")
        require(self, min(self.response_mask) >= 0 and max(self.response_mask) <= 1, "mask values must be 0 or 1")

    @property
    def messages(self) -> list[dict[str, Any]]:
        """The OpenAI chat messages view: the request's messages, then the response (for SFT and APO)."""
        return _chat_view(self.request_json, self.response_json)[0]

    @property
    def prompt_text(self) -> str:
        return _chat_view(self.request_json, self.response_json)[1]

    @property
    def response_text(self) -> str:
        return _chat_view(self.request_json, self.response_json)[2]



_TOKEN_FIELDS = ("prompt_token_ids", "response_token_ids")


def pack_sample(fields: dict[str, Any], max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
    """The wire form of a `Sample` from its fields (every field of `Sample`, by name, in its order),
    without building the object: the adapter writes thousands a second and needs only the bytes.
    Token ids, log-probabilities and the mask may be lists or packed bytes (bytes pass through).
    ``fields`` is consumed: its arrays are replaced by their packed form. The same bytes as
    `Sample.to_wire`."""
    for name in _TOKEN_FIELDS:
        fields[name] = tokens.pack_ids(fields[name])
    fields["response_logprobs"] = tokens.pack_floats(fields["response_logprobs"])
    fields["response_mask"] = tokens.pack_mask(fields["response_mask"])
    return pack_record("sample", fields, max_bytes)


def _chat_view(request_json: str, response_json: str) -> tuple[list[dict[str, Any]], str, str]:
    """(messages, last user text, response text) from a chat or completion request and its response."""
    import json

    try:
        request = json.loads(request_json or "{}")
        response = json.loads(response_json or "null")
    except ValueError:
        return [], "", ""
    if isinstance(request, dict) and isinstance(request.get("messages"), list):
        messages = [m for m in request["messages"] if isinstance(m, dict)]
        prompt = next((str(m.get("content") or "") for m in reversed(messages) if m.get("role") == "user"), "")
    elif isinstance(request, dict) and isinstance(request.get("prompt"), str):
        prompt = request["prompt"]
        messages = [{"role": "user", "content": prompt}]
    else:
        messages, prompt = [], ""
    if isinstance(response, dict) and "role" in response:
        answer = response
    elif isinstance(response, dict) and isinstance(response.get("text"), str):
        answer = {"role": "assistant", "content": response["text"]}
    else:
        answer = {"role": "assistant", "content": response if isinstance(response, str) else ""}
    return [*messages, answer], prompt, str(answer.get("content") or "")


@dataclass(frozen=True, slots=True)
class SampleSkip(Record):
    """A terminal rollout that yielded no sample, and why; the trainer counts it towards its group's
    completeness (a group is complete when all its rollouts are terminal)."""

    KIND: ClassVar[str] = "sample_skip"

    rollout_id: str
    attempt_id: str | None
    group_key: str
    status: str  # the rollout's terminal status
    reason: str  # e.g. "failed", "no LLM call", "no reward", "malformed span: ..."
    mode: str | None = None
    group_size: int | None = None

    def check_wire(self) -> None:
        require_nonempty(self, "rollout_id", "group_key")
        require_at_least(self, 1, "group_size")


class RolloutForSamples(NamedTuple):
    """A finished rollout as the adapter reads it (`Samples.read_for_samples`); a tuple, which is
    cheaper to make than a frozen dataclass, and one is made per rollout adapted."""

    rollout_id: str
    status: RolloutStatus
    attempt_id: str | None
    mode: str | None
    metadata: dict[str, Any]
    input_blob: bytes  # msgpack; decoded only when the group key must be derived from the task
    spans: list[SpanView] | RecordError  # in sequence order; [] unless the rollout succeeded
    reward: float | None = None  # the final reward its runner stored with it
