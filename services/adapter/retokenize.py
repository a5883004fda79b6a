"""Token ids for an LLM call recorded without them (a text-only teacher), made with the policy's
tokenizer and chat template, so the call can be an SFT sample (marked ``retokenized``, no logprobs).

How prompts and responses are rendered: docs/design/adapter.md.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fulmen_adapter.triplets import Skip


class Retokenizer:
    def __init__(self, tokenizer_dir: Path) -> None:
        from transformers import AutoTokenizer

        if not Path(tokenizer_dir).is_dir():
            raise ValueError(f"tokenizer_dir {tokenizer_dir} is not a folder: give the policy's model folder "
                             "(its tokenizer files and chat template)")
        # a local folder only: nothing is downloaded at run time
        try:
            self.tokenizer: Any = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
        except (OSError, ValueError) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ValueError(f"no tokenizer could be loaded from {tokenizer_dir} ({first})") from None
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"the tokenizer in {tokenizer_dir} has no chat template: chat calls cannot be re-tokenised")

    def __call__(self, request_json: str, response_json: str) -> tuple[list[int], list[int]]:
        """(prompt ids, response ids) of a recorded call; `Skip` when the recorded JSON cannot be used."""
        try:
            request = json.loads(request_json or "null")
            response = json.loads(response_json or "null")
        except ValueError:
            raise Skip("retokenize_failed", "a text-only call's recorded request or response is not JSON") from None
        if not isinstance(request, dict):
            raise Skip("retokenize_failed", "a text-only call has no recorded request to re-tokenise")
        if isinstance(request.get("messages"), list):
            return self._chat(request, response)
        if isinstance(request.get("prompt"), str):
            text = response.get("text") if isinstance(response, dict) else response
            if not isinstance(text, str) or not text:
                raise Skip("retokenize_failed", "a text-only completion call has no answer text")
            prompt = self.tokenizer(request["prompt"])["input_ids"]
            return list(prompt), list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        raise Skip("retokenize_failed", "a text-only call's request has neither messages nor a prompt")

    def _chat(self, request: dict[str, Any], response: Any) -> tuple[list[int], list[int]]:
        messages = request["messages"]
        tools = request.get("tools") or None
        if isinstance(response, dict) and response.get("role") == "assistant":
            answer = {k: v for k, v in response.items() if k in ("role", "content", "tool_calls") and v is not None}
        elif isinstance(response, str):
            answer = {"role": "assistant", "content": response}
        else:
            raise Skip("retokenize_failed", "a text-only chat call has no assistant message recorded")
        try:
            prompt = self._render(messages, tools, add_generation_prompt=True)
            whole = self._render([*messages, answer], tools, add_generation_prompt=False)
        except Exception as e:  # a template error on the user's messages must not stop the adapter
            raise Skip("retokenize_failed", f"the chat template cannot render a text-only call ({type(e).__name__}: {e})") from None
        if whole[: len(prompt)] != prompt or len(whole) == len(prompt):
            raise Skip("retokenize_failed", "the chat template renders the answered conversation with another prompt "
                                            "(it does not extend the generation prompt): cannot split prompt and answer")
        return prompt, whole[len(prompt):]

    def _render(self, messages: list[Any], tools: Any, add_generation_prompt: bool) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                                 tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # a BatchEncoding in some versions
            ids = ids["input_ids"]
        return [int(i) for i in ids]
