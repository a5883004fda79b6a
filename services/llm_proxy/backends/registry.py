"""Which backend serves the proxy: a registry from a backend's name to its class, and the builder.

The registry names each class as a ``"module:attribute"`` string resolved on use, so this module
imports no backend: the torch backend pulls in torch (too heavy for ``fulmen --help``), and the
backends depend on `fulmen_llm_proxy.backends.base` only, never on this module.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from fulmen_llm_proxy.backends.base import Backend

if TYPE_CHECKING:
    from fulmen.settings import ProxySettings

BACKENDS: dict[str, str] = {
    "torch": "fulmen_llm_proxy.backends.torch.backend:TorchBackend",
    "vllm": "fulmen_llm_proxy.backends.upstream.vllm:VllmBackend",
    "openai": "fulmen_llm_proxy.backends.upstream.openai:OpenAIBackend",
    "anthropic": "fulmen_llm_proxy.backends.upstream.anthropic:AnthropicBackend",
}
LOCAL_BACKENDS = frozenset({"torch"})  # serve a model folder in this process; the others an upstream


def backend_class(name: str) -> Callable[..., Backend]:
    """The class registered under ``name`` (imports its module now); local backends take a model
    folder, the others a list of upstream URLs."""
    target = BACKENDS.get(name)
    if target is None:
        raise ValueError(f"proxy backend {name!r} unknown: use {_choices()}")
    module, _, attribute = target.partition(":")
    cls: Callable[..., Backend] = getattr(importlib.import_module(module), attribute)
    return cls


def make_backend(settings: ProxySettings) -> Backend:
    """The backend the settings ask for (imports torch only for the torch backend)."""
    kind = settings.proxy_backend
    cls = backend_class(kind)
    if kind in LOCAL_BACKENDS:
        if settings.model_dir is None:
            raise ValueError(f"the {kind} backend needs --model-dir (FULMEN_MODEL_DIR)")
        return cls(settings.model_dir, model_name=settings.model_name, max_batch=settings.max_batch,
                   device=settings.device, dtype=settings.dtype, default_max_tokens=settings.default_max_tokens)
    urls = [u.strip() for u in (settings.upstream_urls or "").split(",") if u.strip()]
    if not urls:
        raise ValueError(f"the {kind} backend needs --upstream-urls (FULMEN_UPSTREAM_URLS)")
    from fulmen_llm_proxy.backends.upstream.policy import UpstreamPolicy

    key = settings.upstream_api_key.get_secret_value() if settings.upstream_api_key else None
    # Anthropic requires max_tokens on every call; a chat call may leave it out
    extra = {"default_max_tokens": settings.upstream_max_tokens} if kind == "anthropic" else {}
    return cls(urls, model_name=settings.model_name, api_key=key, policy=UpstreamPolicy.from_settings(settings),
               **extra)  # fmt: skip


def _choices() -> str:
    *rest, last = BACKENDS
    return f"{', '.join(rest)} or {last}"
