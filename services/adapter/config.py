"""The adapter's configuration from its settings (the re-tokeniser is built only when asked for)."""

from __future__ import annotations

from fulmen.settings import AdapterSettings
from fulmen_adapter.triplets import AdapterConfig


def adapter_config(settings: AdapterSettings) -> AdapterConfig:
    """The configuration an `AdapterSettings` asks for (ValueError with the reason if it cannot be: a
    bad regular expression, no tokenizer in ``tokenizer_dir``)."""
    retokenize = None
    if settings.tokenizer_dir is not None:
        from fulmen_adapter.retokenize import Retokenizer

        retokenize = Retokenizer(settings.tokenizer_dir)
    return AdapterConfig(settings.llm_call_match, settings.agent_match, settings.trajectories, retokenize)
