"""Training samples (adapter -> trainer) and the skip record of a rollout that yielded none."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fulmen import tokens
from fulmen.codec import (
    DEFAULT_MAX_RECORD_BYTES,
    pack_record,
    unpack_record,
)
from fulmen.errors import RecordError


@dataclass(frozen=True, slots=True)
class Sample:
    """One training sample on the samples stream: a (prompt, response, reward) triplet of one LLM call,
    or a whole multi-turn trajectory (``shape`` says which).

    Token ids, log-probabilities and the mask are packed arrays on the wire (`fulmen.tokens`);
    `from_wire` gives lists, and a producer may hand the packed bytes straight in (the adapter does). A trajectory's ``response_token_ids`` hold everything after its first prompt: the model's own
    tokens (``response_mask`` 1, with their log-probabilities) and the tokens the environment added
    between turns (mask 0, log-probability 0.0). A triplet's mask is all ones."""

    sample_id: str  # "<attempt_id>/t<turn>" or "<attempt_id>/traj<first turn>": unique, stable
    shape: str  # "triplet" | "trajectory"
    rollout_id: str
    attempt_id: str
    group_key: str  # the task: GRPO groups the samples of one task
    turn_index: int  # triplet: the LLM call's index in the attempt; trajectory: its first turn
    prompt_token_ids: list[int]
    response_token_ids: list[int]
    response_logprobs: list[float]
    response_mask: list[int]
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

    def to_wire(self, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
        return pack_sample({name: getattr(self, name) for name in self.__slots__}, max_bytes)

    @classmethod
    def from_wire(cls, data: bytes | None, max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> Sample:
        d = unpack_record(data, "sample", max_bytes, required=("sample_id", "shape", "rollout_id"))
        del d["v"], d["kind"]
        try:
            for name in _TOKEN_FIELDS:
                d[name] = tokens.ids(d[name])
            d["response_logprobs"] = tokens.floats(d["response_logprobs"])
            d["response_mask"] = tokens.mask(d["response_mask"])
            return cls(**d)
        except (TypeError, KeyError) as e:
            raise RecordError(f"sample record does not fit: {e!r}") from None


_TOKEN_FIELDS = ("prompt_token_ids", "response_token_ids")


def pack_sample(fields: dict[str, Any], max_bytes: int = DEFAULT_MAX_RECORD_BYTES) -> bytes:
    """The wire form of a `Sample` from its fields (every field of `Sample`, by name, in its order),
    without building the object: the adapter writes thousands a second and needs only the bytes.
    Token ids, log-probabilities and the mask may be lists or packed bytes (bytes pass through).
    ``fields`` is consumed: its arrays are replaced by their packed form."""
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
class SampleSkip:
    """A terminal rollout that yielded no sample, and why; the trainer counts it towards its group's
    completeness (a group is complete when all its rollouts are terminal)."""

    rollout_id: str
    attempt_id: str | None
    group_key: str
    status: str  # the rollout's terminal status
    reason: str  # e.g. "failed", "no LLM call", "no reward", "malformed span: ..."
    mode: str | None = None
    group_size: int | None = None

    def to_wire(self) -> bytes:
        return pack_record("sample_skip", {name: getattr(self, name) for name in self.__slots__})

    @classmethod
    def from_wire(cls, data: bytes | None) -> SampleSkip:
        d = unpack_record(data, "sample_skip", required=("rollout_id", "group_key", "reason"))
        del d["v"], d["kind"]
        try:
            return cls(**d)
        except TypeError as e:
            raise RecordError(f"sample_skip record does not fit: {e}") from None
