"""A model whose greedy output is scripted: deterministic text (tool-call tags, malformed JSON...)
through the real torch backend and engine, for tests of what the proxy makes of a model's output.

`ScriptedModel` wraps the engine's Hugging Face model: every forward pass runs the real model, then,
when the request's last user message is a key of ``scripts``, raises the logit of the script's next
token far above the others (the script ends with the end-of-sequence token). The engine, the
backend, the parser and the recording are the production ones; only the choice of tokens is steered.
Requests are scripted one at a time (one row in the batch), as the tests send them.
"""

from __future__ import annotations

from typing import Any

USER, EOS = "<|user|>", "<eos>"
BOOST = 1e4


class ScriptedModel:
    def __init__(self, model: Any, tokenizer: Any, scripts: dict[str, str]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.scripts = {
            key: [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
            for key, text in scripts.items()
        }
        self.pending: list[int] = []

    def __getattr__(self, name: str) -> Any:  # config, state_dict...: the real model's
        return getattr(self.model, name)

    def __call__(self, **inputs: Any) -> Any:
        out = self.model(**inputs)
        ids = inputs["input_ids"]
        if ids.shape[1] > 1:  # a prefill: a new request, scripted by its last user message
            text = self.tokenizer.decode(ids[-1].tolist())
            user = text.rsplit(USER, 1)[-1].split(EOS, 1)[0] if USER in text else None
            self.pending = list(self.scripts.get(user, ())) if user is not None else []
        if self.pending:
            out.logits[:, -1, self.pending.pop(0)] += BOOST
        return out


def script(proxy: Any, scripts: dict[str, str]) -> None:
    """Steer the torch-backend proxy's model (an in-process `RunningProxy`) by ``scripts``."""
    engine = proxy.app.service.backend.engine
    model = engine.model.model if isinstance(engine.model, ScriptedModel) else engine.model
    engine.model = ScriptedModel(model, engine.tokenizer, scripts)
