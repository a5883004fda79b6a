"""The adapter's configuration from its settings (the re-tokeniser is built only when asked for; the
group judge only with a judge_url)."""

from __future__ import annotations

from fulmen.settings import AdapterSettings
from fulmen_adapter.judge import JudgeConfig
from fulmen_adapter.triplets import AdapterConfig


def adapter_config(settings: AdapterSettings) -> AdapterConfig:
    """The configuration an `AdapterSettings` asks for (ValueError with the reason if it cannot be: a
    bad regular expression, no tokenizer in ``tokenizer_dir``)."""
    retokenize = None
    if settings.tokenizer_dir is not None:
        from fulmen_adapter.retokenize import Retokenizer

        retokenize = Retokenizer(settings.tokenizer_dir)
    return AdapterConfig(settings.llm_call_match, settings.agent_match, settings.trajectories, retokenize)


def judge_config(settings: AdapterSettings) -> JudgeConfig | None:
    """The group judge the settings ask for: None without a judge_url (ValueError without its model)."""
    if not settings.judge_url:
        return None
    if not settings.judge_model:
        raise ValueError("judge_url is set but judge_model is not: name the judge's model (FULMEN_JUDGE_MODEL)")
    key = settings.judge_api_key.get_secret_value() if settings.judge_api_key is not None else None
    return JudgeConfig(settings.judge_url, settings.judge_model, key, settings.judge_rubric, settings.judge_mix,
                       settings.judge_wait_s, settings.judge_timeout_s, settings.judge_max_tokens)
