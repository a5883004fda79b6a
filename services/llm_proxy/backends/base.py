"""What every backend (torch, vllm, openai, anthropic) takes and gives back: a `Call` in, a body and
a `Result` out.

A backend never touches the store; this module imports no backend (`fulmen_llm_proxy.backends.registry`
picks one by name). More: docs/design/proxy.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from fulmen.versions.model_version import BASE_VERSION

Operation = Literal["chat", "text_completion"]
Fidelity = Literal["exact", "text_only"]

# The version a backend reports before any trained version is loaded (its weights as they started).
BASE_MODEL_VERSION = BASE_VERSION.name


@dataclass(slots=True)
class Call:
    """One validated chat or text-completion request."""

    operation: Operation
    body: dict[str, Any]  # the request JSON as the agent sent it (upstream backends forward it)
    model: str
    stream: bool
    max_tokens: int | None
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    rollout_id: str = ""  # "" when unattributed
    attempt_id: str = ""
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:<id>"
    include_usage: bool = False  # stream_options.include_usage: a last chunk with usage
    call_key: str = ""  # the client's idempotency key ("" without one): a retry is the same call
    api: str = ""  # the API the agent called, when not OpenAI's: "openai.responses", "anthropic.messages"
    n: int = 1  # choices asked for: one sample each (torch backend; see `Result.more`)

    @property
    def messages(self) -> list[dict[str, Any]]:
        return self.body["messages"]

    @property
    def tools(self) -> list[dict[str, Any]] | None:
        return self.body.get("tools")


@dataclass(slots=True)
class Result:
    """What a backend learned while serving a call; the span is built from it."""

    model_version: str = ""
    fidelity: Fidelity = "exact"
    response_id: str = ""
    response_model: str = ""
    prompt_token_ids: list[int] | None = None  # None: the backend could not tell (text_only)
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    text: str = ""
    tool_calls: list[dict[str, Any]] | None = None
    finish_reason: str | None = None
    # with finish_reason "length": the limit that cut the answer, "max_tokens" or "context_length"
    # (None: the backend cannot tell; `fulmen_llm_proxy.recording` then infers it)
    truncated_by: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # choices 1..n-1 of an ``n > 1`` call, each a sample of its own (its span is its own too); this
    # Result is choice 0
    more: list[Result] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The assistant message (chat) as recorded in the span."""
        message: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


class Backend(Protocol):
    """A model server behind the proxy."""

    system: str  # gen_ai.system: torch | vllm | openai

    @property
    def model_names(self) -> list[str]:
        """Names this backend answers to (``/v1/models``); empty: whatever the upstream accepts."""
        ...

    @property
    def model_version(self) -> str:
        """The version a call starting now would be served by."""
        ...

    async def start(self) -> None: ...

    async def close(self) -> None: ...

    def ready(self) -> bool:
        """Loaded and able to serve (``/readyz``)."""
        ...

    async def complete(self, call: Call, result: Result) -> dict[str, Any]:
        """Serve a non-streaming call: the OpenAI response body; fills ``result``."""
        ...

    def stream(self, call: Call, result: Result) -> AsyncIterator[dict[str, Any]]:
        """Serve a streaming call: OpenAI chunk bodies in order; ``result`` is complete when the
        iterator ends. The first chunk carries the prompt token ids when the backend knows them."""
        ...

    async def load_weights(
        self, state_dict: dict[str, Any], model_version: str, weights_format: Mapping[str, Any] | None = None
    ) -> bool:
        """Swap in new weights between batches; False when this backend cannot (upstreams).
        ``weights_format``: the version's ``weights`` entry (``format: lora``: an adapter, `fulmen.versions.lora`;
        ``format: delta``: the tensors a delta changed, already rebuilt; the others stay)."""
        ...

    def current_weights(self) -> Mapping[str, Any] | None:
        """The tensors being served by name (a delta is applied onto them), None when not held here."""
        return None
