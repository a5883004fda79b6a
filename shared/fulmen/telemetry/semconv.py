"""Span names, attribute names and HTTP headers that the SDK, the runner, the proxy and the adapter share.

OpenTelemetry GenAI conventions (``gen_ai.*``) plus Fulmen's own (``fulmen.*``). More:
docs/design/telemetry.md.
"""

from __future__ import annotations

# --- binding: every span of an attempt carries these --------------------------------------------
ROLLOUT_ID = "fulmen.rollout_id"
ATTEMPT_ID = "fulmen.attempt_id"
SPAN_KIND = "fulmen.span_kind"  # llm_call | reward | message | object | exception | operation | rollout

# --- LLM calls (written by the proxy) -------------------------------------------------------------
KIND_LLM_CALL = "llm_call"
GEN_AI_OPERATION = "gen_ai.operation.name"  # "chat" | "text_completion"
GEN_AI_SYSTEM = "gen_ai.system"  # the backend: torch | vllm | openai
GEN_AI_REQUEST_MODEL = "gen_ai.request.model"
GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
GEN_AI_RESPONSE_ID = "gen_ai.response.id"
GEN_AI_TEMPERATURE = "gen_ai.request.temperature"
GEN_AI_TOP_P = "gen_ai.request.top_p"
GEN_AI_MAX_TOKENS = "gen_ai.request.max_tokens"
GEN_AI_SEED = "gen_ai.request.seed"
GEN_AI_FINISH_REASONS = "gen_ai.response.finish_reasons"
# With finish reason "length": the limit that cut the answer, one of TRUNCATED_BY_CAUSES.
TRUNCATED_BY = "fulmen.truncated_by"
TRUNCATED_BY_CAUSES = ("max_tokens", "context_length")
GEN_AI_INPUT_TOKENS = "gen_ai.usage.input_tokens"
GEN_AI_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
# Token ids and log-probabilities are packed arrays (int32 / float32 little-endian bytes, see
# fulmen.tokens; read them with tokens.ids / tokens.floats, which also accept plain lists).
PROMPT_TOKEN_IDS = "fulmen.prompt_token_ids"
RESPONSE_TOKEN_IDS = "fulmen.response_token_ids"
RESPONSE_LOGPROBS = "fulmen.response_logprobs"  # one per response token
MODEL_VERSION = "fulmen.model_version"  # the weights that produced the response
TOKEN_FIDELITY = "fulmen.token_fidelity"  # "exact" (ids from the engine) | "text_only" (openai backend)
REQUEST_JSON = "fulmen.request"  # the request body (messages or prompt, tools), JSON text
RESPONSE_JSON = "fulmen.response"  # the response message / text, JSON text
LATENCY_MS = "fulmen.latency_ms"
STREAM = "fulmen.stream"  # bool
# The client's idempotency key: one per logical call, the same on the client's retries of it. The
# proxy derives the span id from it (a retry is stored once) and the adapter keeps one call per key.
CALL_KEY = "fulmen.call_key"
# Choice i > 0 of an n > 1 call is a span of its own (its own sample): it carries its index, and its
# response id and call key are the call's with "#<i>" added (the adapter keeps one call per each).
CHOICE_INDEX = "fulmen.choice_index"
# Why the call was made, from the request's HEADER_PURPOSE: unset or PURPOSE_POLICY for the agent's
# own calls, PURPOSE_JUDGE for a judge's (fulmen.rewards.judge, the adapter's group judge). The adapter
# samples only policy calls: the others are stored with the rollout (its trace shows them) and counted.
CALL_PURPOSE = "fulmen.call_purpose"
PURPOSE_POLICY = "policy"
PURPOSE_JUDGE = "judge"

# --- what agents emit (fulmen.emit_*) -------------------------------------------------------------
KIND_REWARD = "reward"
REWARD_SPAN = "fulmen.reward"
REWARD = "fulmen.reward"  # the primary reward, float
REWARD_PRIMARY = "fulmen.reward.primary"  # name of the primary reward when several are emitted
REWARD_PREFIX = "fulmen.reward."  # + name: each named reward, float
KIND_MESSAGE = "message"
MESSAGE_SPAN = "fulmen.message"
MESSAGE = "fulmen.message"
KIND_OBJECT = "object"
OBJECT_SPAN = "fulmen.object"
OBJECT_JSON = "fulmen.object"
KIND_EXCEPTION = "exception"
EXCEPTION_SPAN = "fulmen.exception"
EXCEPTION_TYPE = "exception.type"  # OpenTelemetry's exception attributes
EXCEPTION_MESSAGE = "exception.message"
EXCEPTION_STACKTRACE = "exception.stacktrace"
KIND_OPERATION = "operation"
OPERATION_NAME = "fulmen.operation.name"
OPERATION_INPUT = "fulmen.operation.input"
OPERATION_OUTPUT = "fulmen.operation.output"
KIND_ROLLOUT = "rollout"
ROLLOUT_SPAN = "fulmen.rollout"  # the root span of an attempt, opened by the runner

# --- HTTP: attribution of a proxy request when the path prefix is not used -----------------------
HEADER_ROLLOUT_ID = "x-fulmen-rollout-id"
HEADER_ATTEMPT_ID = "x-fulmen-attempt-id"
HEADER_MODEL_VERSION = "x-fulmen-model-version"  # on every proxy response: the version that served it
HEADER_PURPOSE = "x-fulmen-purpose"  # on a request: the call's purpose (CALL_PURPOSE), when not the policy's
# One value per logical LLM call, repeated on its retries (the openai client generates one per call
# and sends it when its ``_idempotency_header`` names a header: the SDK's `LLM` clients do).
HEADER_IDEMPOTENCY_KEY = "idempotency-key"
# W3C trace context travels in the standard `traceparent` header.

# --- what stands in for a span the store refused (over the record size limit, or not encodable) ----
# Same attempt, span id, trace and parent: the rollout shows what is missing, its children keep a parent.
DROPPED_SPAN = "fulmen.dropped"
DROPPED_NAME = "fulmen.dropped.name"  # the dropped span's name
DROPPED_SIZE_BYTES = "fulmen.dropped.size_bytes"  # its encoded size (absent if it could not be encoded)
DROPPED_LIMIT_BYTES = "fulmen.dropped.limit_bytes"  # the store's record size limit
DROPPED_REASON = "fulmen.dropped.reason"  # the store's error


def attempt_path(rollout_id: str, attempt_id: str) -> str:
    """The path prefix that attributes proxy calls to an attempt (before ``/v1``)."""
    return f"/rollout/{rollout_id}/attempt/{attempt_id}"


def readable(attributes: dict[str, object]) -> dict[str, object]:
    """Attributes for people (JSON, tables): the packed token arrays as plain lists."""
    from fulmen import tokens

    out = dict(attributes)
    for name in (PROMPT_TOKEN_IDS, RESPONSE_TOKEN_IDS):
        if isinstance(out.get(name), bytes | bytearray):
            out[name] = tokens.ids(out[name])
    if isinstance(out.get(RESPONSE_LOGPROBS), bytes | bytearray):
        out[RESPONSE_LOGPROBS] = tokens.floats(out[RESPONSE_LOGPROBS])
    return out
