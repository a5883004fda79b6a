"""The ``torch`` backend: a Hugging Face causal LM in this process, batched by `TorchEngine`.

Tool calls: `fulmen_llm_proxy.backends.tool_calls`; ``n > 1``: `fulmen_llm_proxy.backends.torch.choices`; the engine:
`fulmen_llm_proxy.backends.torch.engine`. Prompts, stop strings and why: docs/design/proxy.md.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from fulmen.errors import InvalidInput, RetryableError
from fulmen_llm_proxy.api import formatting
from fulmen_llm_proxy.api.parsing import single_prompt
from fulmen_llm_proxy.backends import tool_calls
from fulmen_llm_proxy.backends.base import Call, Result
from fulmen_llm_proxy.backends.tool_calls import ContentGate, ToolPlan
from fulmen_llm_proxy.backends.torch.choices import (
    apply_tools,
    as_choice,
    choice_seed,
    final_chunks,
    full_body,
    merged,
)
from fulmen_llm_proxy.backends.torch.engine import (
    DEFAULT_MAX_BATCH,
    GenerationStream,
    SamplingParams,
    TorchEngine,
)
from fulmen_llm_proxy.errors import ProxyError, bad_request

DEFAULT_MAX_TOKENS = 256  # a call without max_tokens: `ProxySettings.default_max_tokens`
# OpenAI accepts top_p = 0 and the engine needs top_p > 0: a nucleus this small keeps only the
# likeliest token, which is what 0 asks for.
MIN_TOP_P = 1e-9


class TorchBackend:
    system = "torch"

    def __init__(
        self, model_dir: str | Path, *, model_name: str | None = None, max_batch: int = DEFAULT_MAX_BATCH,
        device: str = "cpu", dtype: str = "float32", default_max_tokens: int = DEFAULT_MAX_TOKENS,
    ) -> None:
        from fulmen.devices import resolve_device, resolve_dtype

        self.device = str(resolve_device(device))  # a bad setting fails at start, with what to use
        resolve_dtype(dtype)
        # bf16 on a GPU; a CPU computes in fp32 whatever the setting (bf16 products are slow there)
        self.dtype = dtype if self.device.startswith("cuda") else "float32"
        self.model_dir = Path(model_dir)
        self.name = model_name or self.model_dir.resolve().name
        self.max_batch = max_batch
        self.default_max_tokens = default_max_tokens
        self.engine: Any = None  # a TorchEngine once started (loading the model takes seconds)
        self.b: Any = None  # a second engine, for B of an A/B test (`fulmen.serving.ab`)
        self.split = 0.0

    @property
    def model_names(self) -> list[str]:
        return [self.name]

    @property
    def model_version(self) -> str:
        return self.engine.model_version if self.engine is not None else ""

    async def start(self) -> None:
        # Loading runs in a thread so the event loop (and the lifespan) stays responsive.
        self.engine = await asyncio.to_thread(TorchEngine, self.model_dir, max_batch=self.max_batch,
                                              device=self.device, dtype=self.dtype)
        await self.engine.start()

    async def close(self) -> None:
        if self.engine is not None:
            await self.engine.close()
        if self.b is not None:
            await self.b.close()

    def ready(self) -> bool:
        return self.engine is not None

    async def load_weights(
        self, state_dict: dict[str, Any], model_version: str, weights_format: Mapping[str, Any] | None = None
    ) -> bool:
        from fulmen.versions.lora import LORA_FORMAT
        from fulmen.versions.manifest import DELTA

        fmt = (weights_format or {}).get("format")
        if fmt not in (None, "full", LORA_FORMAT, DELTA):
            raise InvalidInput(f"model version {model_version}: weights format {fmt!r} is not one this backend loads")
        lora = weights_format.get("lora") if weights_format and fmt == LORA_FORMAT else None
        await self.engine.load_weights(state_dict, model_version, lora=lora or ({} if fmt == LORA_FORMAT else None),
                                       partial=fmt == DELTA)
        return True

    @property
    def b_version(self) -> str:
        return self.b.model_version if self.b is not None else ""

    async def serve_b(self, state_dict: dict[str, Any] | None, model_version: str,
                      weights_format: Mapping[str, Any] | None, split: float) -> None:
        """Serve ``model_version`` to the ``split`` fraction of rollouts `fulmen.serving.ab.arm_of` sends to B,
        from a second engine; ``state_dict`` None ends the test (the engine and its memory go)."""
        from fulmen.versions.lora import LORA_FORMAT

        if state_dict is None:
            b, self.b, self.split = self.b, None, 0.0
            if b is not None:
                await b.close()
            return
        if self.b is None:
            self.b = await asyncio.to_thread(TorchEngine, self.model_dir, max_batch=self.max_batch,
                                             device=self.device, dtype=self.dtype)
            await self.b.start()
        fmt = (weights_format or {}).get("format")
        lora = (weights_format or {}).get("lora") or {} if fmt == LORA_FORMAT else None
        await self.b.load_weights(state_dict, model_version, lora=lora)
        self.split = split

    def _engine_for(self, call: Call) -> Any:
        from fulmen.serving.ab import arm_of

        b = self.b
        return b if b is not None and arm_of(call.rollout_id, self.split) == "b" else self.engine

    def current_weights(self) -> Mapping[str, Any] | None:
        return self.engine.model.state_dict() if self.engine is not None else None

    # --- prompts ------------------------------------------------------------------------------------

    def prompt_ids(self, call: Call, tools: ToolPlan | None = None) -> list[int]:
        tokenizer = self.engine.tokenizer
        if call.operation == "chat":
            try:
                text = tokenizer.apply_chat_template(
                    call.messages, tools=tools.rendered if tools else None, add_generation_prompt=True,
                    tokenize=False,
                )  # fmt: skip
            except Exception as e:  # jinja's TemplateError, a missing key in a message, ...
                raise bad_request(f"messages do not fit the chat template: {e}", "messages") from None
            return list(tokenizer.encode(text, add_special_tokens=False))
        prompt = single_prompt(call.body.get("prompt"))
        if isinstance(prompt, str):
            return list(tokenizer.encode(prompt))
        return list(prompt)

    def _open(self, call: Call, prompt: list[int], index: int) -> GenerationStream:
        stop_ids = call.body.get("stop_token_ids") or ()
        if not isinstance(stop_ids, list | tuple) or not all(isinstance(t, int) for t in stop_ids):
            raise bad_request("stop_token_ids must be a list of token ids", "stop_token_ids")
        try:
            params = SamplingParams(
                max_tokens=self._max_tokens(call), temperature=call.temperature,
                top_p=call.top_p if call.top_p > 0 else MIN_TOP_P, seed=choice_seed(call.seed, index),
                stop_token_ids=tuple(stop_ids),
            )  # fmt: skip
            return self._engine_for(call).stream(prompt, params)
        except InvalidInput as e:
            code = "context_length_exceeded" if "context" in str(e) else None
            raise bad_request(str(e), "messages" if call.operation == "chat" else "prompt", code) from None
        except RetryableError as e:
            raise _engine_closed(e) from None

    def _max_tokens(self, call: Call) -> int:
        return call.max_tokens or self.default_max_tokens

    def token_strings(self, call: Call, token_ids: list[int]) -> list[str]:
        if call.tokens_as_ids:
            return [f"token_id:{t}" for t in token_ids]
        return self.engine.tokenizer.batch_decode([[t] for t in token_ids])

    def _prepare(self, call: Call, result: Result) -> tuple[ToolPlan | None, list[int], list[Result]]:
        """The call's tool plan, prompt ids and one Result per choice (``result`` first)."""
        tools = tool_calls.plan(call.body) if call.operation == "chat" else None
        prompt = self.prompt_ids(call, tools)
        result.response_id = formatting.response_id(call)
        result.more = [Result() for _ in range(call.n - 1)]
        choices = [result, *result.more]
        for r in choices:
            r.response_id, r.response_model, r.prompt_token_ids, r.fidelity = result.response_id, call.model, prompt, "exact"
        return tools, prompt, choices

    # --- serving ------------------------------------------------------------------------------------

    async def complete(self, call: Call, result: Result) -> dict[str, Any]:
        tools, prompt, choices = self._prepare(call, result)

        async def collect(index: int) -> None:
            async for _ in self._generate(call, choices[index], prompt, index):
                pass
            if tools is not None:
                choices[index].extra["tool_error"] = apply_tools(choices[index], tools)

        if len(choices) == 1:
            await collect(0)
        else:
            async with asyncio.TaskGroup() as group:  # one failing choice cancels the others
                for i in range(len(choices)):
                    group.create_task(collect(i))
        return full_body(self, call, choices)

    async def stream(self, call: Call, result: Result) -> AsyncIterator[dict[str, Any]]:
        tools, prompt, choices = self._prepare(call, result)
        head = formatting.StreamHead(call, result.response_id, int(time.time()))
        offsets = [0] * len(choices)
        texts = [""] * len(choices)
        gates = [ContentGate() for _ in choices] if tools is not None else None
        first = True
        started = [False] * len(choices)
        async for index, (text, token_id, logprob) in merged(self._generate, call, choices, prompt):
            tokens = self.token_strings(call, [token_id])
            # the app reads the version for the response's head at the first chunk, whichever choice
            result.model_version = result.model_version or choices[index].model_version
            if gates is not None:
                texts[index] += text
                text = gates[index].feed(texts[index])
            body = formatting.chunk(
                head, text=text, token_ids=[token_id], tokens=tokens, logprobs=[logprob], finish_reason=None,
                prompt_ids=prompt if first else None, text_offset=offsets[index],
            )  # fmt: skip
            yield as_choice(body, index, not started[index])
            first, started[index] = False, True
            offsets[index] += len(tokens[0])
        for index, choice in enumerate(choices):
            delta: dict[str, Any] = {}
            if tools is not None and gates is not None:
                choice.extra["tool_error"] = apply_tools(choice, tools)
                rest = gates[index].rest(choice.text)
                if rest:
                    delta["content"] = rest
                if choice.tool_calls:
                    delta["tool_calls"] = tool_calls.stream_deltas(choice.tool_calls)
            # The finish reason travels in a chunk of its own, as OpenAI sends it.
            body = formatting.chunk(
                head, text="", token_ids=[], tokens=[], logprobs=[], finish_reason=choice.finish_reason,
                text_offset=offsets[index],
            )  # fmt: skip
            for piece in final_chunks(as_choice(body, index, not started[index]), delta, choice):
                yield piece
        if call.include_usage:
            yield formatting.usage_chunk(head, len(prompt), sum(c.output_tokens or 0 for c in choices))

    async def _generate(
        self, call: Call, result: Result, prompt: list[int], index: int = 0
    ) -> AsyncIterator[tuple[str, int, float]]:
        """Each generated token of choice ``index`` as (new text, token id, logprob); fills ``result``."""
        stream = self._open(call, prompt, index)
        tokenizer = self.engine.tokenizer
        token_ids: list[int] = []
        logprobs: list[float] = []
        result.token_ids, result.logprobs = token_ids, logprobs
        stops = call.stop
        decoded = ""  # text of every token so far
        sent = 0  # characters of `decoded` already given out
        finish = "length"
        incremental = call.stream or bool(stops)  # else no text is needed before the end
        try:
            async with stream as s:
                async for step in s:
                    result.model_version = s.model_version or ""
                    token_ids.append(step.token_id)
                    logprobs.append(step.logprob)
                    if step.finish_reason is not None:
                        finish = step.finish_reason
                    if not incremental:
                        continue  # decoded once at the end
                    decoded = tokenizer.decode(token_ids, skip_special_tokens=True)
                    cut = _stop_at(decoded, stops, sent) if stops else -1
                    if cut >= 0:
                        decoded, finish = decoded[:cut], "stop"
                        yield decoded[sent:], step.token_id, step.logprob
                        sent = len(decoded)
                        break  # leaving the block cancels the request in the engine
                    # Hold back an incomplete UTF-8 character and a possible stop-string start.
                    ready = len(decoded) - (1 if decoded.endswith("\ufffd") else 0)
                    if stops:
                        ready = min(ready, len(decoded) - _partial_stop(decoded, stops))
                    ready = max(ready, sent)
                    if step.finish_reason is not None:
                        ready = len(decoded)
                    yield decoded[sent:ready], step.token_id, step.logprob
                    sent = ready
        except InvalidInput as e:
            raise bad_request(str(e)) from None
        except RetryableError as e:
            raise _engine_closed(e) from None
        result.text = decoded if incremental else tokenizer.decode(token_ids, skip_special_tokens=True)
        result.finish_reason = finish
        if finish == "length":  # the engine also ends an answer where the model's context ends
            result.truncated_by = "max_tokens" if len(token_ids) >= self._max_tokens(call) else "context_length"
        result.input_tokens = len(prompt)
        result.output_tokens = len(token_ids)


def _engine_closed(error: RetryableError) -> ProxyError:
    """The engine stopped (the proxy is shutting down): retryable on another proxy."""
    return ProxyError(503, str(error), code="engine_closed")


def _stop_at(text: str, stops: list[str], sent: int) -> int:
    """Where the first stop string in ``text`` starts (searching from what may be new), or -1."""
    best = -1
    for stop in stops:
        i = text.find(stop, max(0, sent - len(stop)))
        if i >= 0 and (best < 0 or i < best):
            best = i
    return best


def _partial_stop(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest
