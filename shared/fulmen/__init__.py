"""Fulmen: train any AI agent with RL, prompt optimisation and SFT, over Redis Streams.

For agent authors: ``@fulmen.rollout``, ``fulmen.Agent``, ``fulmen.emit_reward`` and friends (the SDK,
in `fulmen.sdk`). For services: `fulmen.store` holds the store; `fulmen.records` every message record;
`fulmen.keys` every Redis key.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# The SDK is imported on first use, so `import fulmen.keys` in a service stays cheap.
_SDK = {
    "rollout": "fulmen.sdk.agent",
    "prompt_rollout": "fulmen.sdk.agent",
    "Agent": "fulmen.sdk.agent",
    "LitAgent": "fulmen.sdk.agent",
    "Hook": "fulmen.sdk.hooks",
    "LLM": "fulmen.sdk.resources",
    "PromptTemplate": "fulmen.sdk.resources",
    "emit_reward": "fulmen.sdk.emit",
    "emit_message": "fulmen.sdk.emit",
    "emit_object": "fulmen.sdk.emit",
    "emit_exception": "fulmen.sdk.emit",
    "operation": "fulmen.sdk.emit",
}
__all__ = ["__version__", *_SDK]


def __getattr__(name: str) -> Any:
    if name in _SDK:
        import importlib

        module = importlib.import_module(_SDK[name])
        value = getattr(module, "Agent" if name == "LitAgent" else name)
        globals()[name] = value  # kept: the next `fulmen.emit_reward` is a plain attribute, not an import
        return value
    raise AttributeError(f"module 'fulmen' has no attribute {name!r}")
