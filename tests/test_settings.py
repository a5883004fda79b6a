"""Settings precedence and secret handling."""

from __future__ import annotations

from typing import get_args

import pytest

from fulmen.errors import InvalidInput
from fulmen.settings import (
    AlgorithmSettings,
    ApoSettings,
    CommonSettings,
    DemoSettings,
    ProxySettings,
    RunnerSettings,
    TrainerSettings,
    VllmSyncSettings,
    env_name,
    known_env_names,
    load_settings,
)
from fulmen.settings.base import field_group
from fulmen.settings.services import SERVICE_SETTINGS
from fulmen.store.redis.connection import redact


def test_flag_over_environment_over_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """A flag beats the environment, which beats the default."""
    monkeypatch.delenv("FULMEN_EXPERIMENT", raising=False)
    assert load_settings().experiment == "default"
    monkeypatch.setenv("FULMEN_EXPERIMENT", "from-env")
    assert load_settings().experiment == "from-env"
    assert load_settings(experiment="from-flag").experiment == "from-flag"
    assert load_settings(experiment=None).experiment == "from-env"  # None means "flag not given"


def test_embedded_default_and_redis_url(monkeypatch: pytest.MonkeyPatch) -> None:
    """No REDIS_URL selects the embedded server; REDIS_URL selects any other."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    monkeypatch.setenv("FULMEN_REDIS_PORT", "7001")
    settings = load_settings()
    assert settings.embedded and settings.redis_url_value() == "redis://127.0.0.1:7001/0"
    monkeypatch.setenv("REDIS_URL", "rediss://alice:s3cret@db.example:6380/2")
    settings = load_settings()
    assert not settings.embedded and settings.redis_url_value() == "rediss://alice:s3cret@db.example:6380/2"


def test_password_never_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Neither repr nor str of the settings, nor a redacted URL, shows the password."""
    monkeypatch.setenv("REDIS_URL", "redis://alice:s3cret@db:6379/0")
    settings = load_settings()
    assert "s3cret" not in repr(settings) and "s3cret" not in str(settings)
    assert redact(settings.redis_url_value()) == "redis://alice:***@db:6379/0"
    assert redact("redis://localhost:6379/0") == "redis://localhost:6379/0"


def test_invalid_values_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bad values and unknown names are refused with the name in the message."""
    with pytest.raises(InvalidInput, match="redis_port"):
        load_settings(redis_port=0)
    with pytest.raises(InvalidInput, match="experiment name"):
        load_settings(experiment="has space")
    for above in (".", "..", "..."):  # each would name a folder outside the experiment's own
        with pytest.raises(InvalidInput, match="not only dots"):
            load_settings(experiment=above)
    assert load_settings(experiment="v1.2..3").experiment == "v1.2..3"
    monkeypatch.setenv("FULMEN_REDIS_URL", "redis://x")  # the URL is REDIS_URL, nothing else
    with pytest.raises(InvalidInput, match="FULMEN_REDIS_URL"):
        load_settings()


def test_each_service_reads_only_its_own_fields() -> None:
    """A service's class holds the common base and its own fields, not another service's."""
    assert "concurrency" in RunnerSettings.model_fields and "learning_rate" not in RunnerSettings.model_fields
    assert "learning_rate" in TrainerSettings.model_fields and "concurrency" not in TrainerSettings.model_fields
    for cls in (RunnerSettings, TrainerSettings, ProxySettings, AlgorithmSettings):
        assert set(CommonSettings.model_fields) <= set(cls.model_fields)


def test_a_field_two_services_read_is_defined_once() -> None:
    """groups_per_step (trainer and algorithm) has one definition: same default, bounds, description."""
    trainer, algorithm = TrainerSettings.model_fields, AlgorithmSettings.model_fields
    declared_in = [c.__name__ for c in (*TrainerSettings.__mro__, *AlgorithmSettings.__mro__)
                   if "groups_per_step" in vars(c).get("__annotations__", {})]
    assert set(declared_in) == {"TrainingRunSettings"}
    assert repr(trainer["groups_per_step"]) == repr(algorithm["groups_per_step"])
    assert DemoSettings.model_fields["total_steps"].description == algorithm["total_steps"].description
    assert (DemoSettings().total_steps, AlgorithmSettings().total_steps) == (300, None)


def test_another_services_variable_is_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """honcho gives every process the same .env: the trainer's variables do not stop the runner."""
    monkeypatch.setenv("FULMEN_LEARNING_RATE", "0.5")
    monkeypatch.setenv("FULMEN_CONCURRENCY", "3")
    assert load_settings(RunnerSettings).concurrency == 3
    assert load_settings(TrainerSettings).learning_rate == 0.5
    assert "FULMEN_LEARNING_RATE" in known_env_names()
    monkeypatch.setenv("FULMEN_LEARNING_RAT", "0.5")
    with pytest.raises(InvalidInput, match="FULMEN_LEARNING_RAT"):
        load_settings(RunnerSettings)


def test_secrets_never_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    """API keys are SecretStr: repr says they are set, never what they are."""
    monkeypatch.setenv("FULMEN_PROXY_API_KEYS", "k-123,k-456")
    monkeypatch.setenv("FULMEN_CRITIC_API_KEY", "c-789")
    proxy, apo = load_settings(ProxySettings), load_settings(ApoSettings)
    assert proxy.proxy_api_keys is not None and proxy.proxy_api_keys.get_secret_value() == "k-123,k-456"
    for text in (repr(proxy), str(proxy), repr(apo), str(apo)):
        assert "k-123" not in text and "c-789" not in text
    assert "proxy_api_keys='<set>'" in repr(proxy)


def test_each_experiment_checkpoints_and_logs_metrics_in_its_own_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """A second experiment on one host never resumes the first one's checkpoint nor appends to its
    metrics; a folder or file the user names is kept as named."""
    for name in ("FULMEN_CHECKPOINT_DIR", "FULMEN_METRICS_FILE", "FULMEN_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    a, b = load_settings(TrainerSettings, experiment="a"), load_settings(TrainerSettings, experiment="b")
    assert a.checkpoint_dir != b.checkpoint_dir and a.metrics_file != b.metrics_file
    assert (str(a.checkpoint_dir), str(a.metrics_file)) == (".fulmen/checkpoints/a", ".fulmen/run/a/trainer-metrics.jsonl")
    assert load_settings(AlgorithmSettings, experiment="a").metrics_file == a.metrics_file  # both sides agree
    monkeypatch.setenv("FULMEN_CHECKPOINT_DIR", "/ckpt")
    assert str(load_settings(TrainerSettings, experiment="a", metrics_file="m.jsonl").checkpoint_dir) == "/ckpt"
    assert str(load_settings(TrainerSettings, experiment="a", metrics_file="m.jsonl").metrics_file) == "m.jsonl"


def test_each_experiment_syncs_vllm_versions_in_its_own_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two experiments' vllm-syncs on one host write (and delete) versions in folders of their own,
    under the data folder; a folder the user names is kept as named."""
    for name in ("FULMEN_SYNC_DIR", "FULMEN_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    a, b = load_settings(VllmSyncSettings, experiment="a"), load_settings(VllmSyncSettings, experiment="b")
    assert (str(a.sync_dir), str(b.sync_dir)) == (".fulmen/vllm-sync/a", ".fulmen/vllm-sync/b")
    assert str(load_settings(VllmSyncSettings, experiment="a", data_dir="/data").sync_dir) == "/data/vllm-sync/a"
    assert str(load_settings(VllmSyncSettings, experiment="a", sync_dir="/sync").sync_dir) == "/sync"
    monkeypatch.setenv("FULMEN_SYNC_DIR", "/shared/sync")
    assert str(load_settings(VllmSyncSettings, experiment="b").sync_dir) == "/shared/sync"


CHOICES = {
    TrainerSettings: ("algorithm", "sample_shape", "reward_source", "stale_policy", "loss_aggregation", "publish_dtype",
                      "publish_format", "reference_dtype", "reference_device", "parallel", "codec", "on_rank_loss",
                      "dtype"),
    ProxySettings: ("proxy_backend", "dtype"),
    VllmSyncSettings: ("pause_mode", "lora_loading"),
    DemoSettings: ("task",),
    CommonSettings: ("log_level",),
}


@pytest.mark.parametrize(("cls", "field"), [(cls, f) for cls, fields in CHOICES.items() for f in fields])
def test_a_bad_choice_fails_at_load_naming_the_allowed_values(
    monkeypatch: pytest.MonkeyPatch, cls: type[CommonSettings], field: str
) -> None:
    """Every choice is a Literal: a value outside it fails at load with the field, the value and the choices."""
    allowed = get_args(cls.model_fields[field].annotation)
    assert allowed and cls.model_fields[field].default in allowed
    monkeypatch.setenv(env_name(field), "bogus")
    with pytest.raises(InvalidInput) as raised:
        load_settings(cls)
    message = str(raised.value)
    assert f"{field} ({env_name(field)})" in message and "got 'bogus'" in message.lower()
    assert all(repr(choice) in message for choice in allowed), message
    monkeypatch.setenv(env_name(field), str(allowed[-1]))
    assert getattr(load_settings(cls), field) == allowed[-1]


def test_the_device_is_checked_by_its_pattern(monkeypatch: pytest.MonkeyPatch) -> None:
    """device is open-ended (cuda:N) but still checked at load: auto, cpu, cuda, cuda:N and nothing else."""
    for good in ("auto", "cpu", "cuda", "cuda:3"):
        assert load_settings(TrainerSettings, device=good).device == good
    for bad in ("tpu", "cuda:", "cuda:x", "CPU"):
        with pytest.raises(InvalidInput, match=f"device .*got '{bad}'"):
            load_settings(ProxySettings, device=bad)


def test_the_log_level_is_read_in_any_case(monkeypatch: pytest.MonkeyPatch) -> None:
    """FULMEN_LOG_LEVEL=debug is DEBUG, as logging reads it."""
    monkeypatch.setenv("FULMEN_LOG_LEVEL", "debug")
    assert load_settings().log_level == "DEBUG"


def test_a_secret_bad_value_is_not_echoed() -> None:
    """A validation error never prints a secret field's value."""
    with pytest.raises(InvalidInput) as raised:
        load_settings(ProxySettings, proxy_api_keys=["k-123"])
    assert "proxy_api_keys" in str(raised.value) and "k-123" not in str(raised.value)


def test_the_choices_are_what_the_services_register() -> None:
    """Each Literal lists exactly the names its registry knows (codecs, objectives, backends, ...)."""
    from fulmen.devices import DTYPES
    from fulmen.records.samples import SHAPES
    from fulmen_llm_proxy.backends.registry import BACKENDS
    from fulmen_trainer.distributed import codecs
    from fulmen_trainer.objectives import algorithms
    from fulmen_vllm_sync.admin import PAUSE_MODES
    from fulmen_vllm_sync.sync import LORA_LOADINGS

    def allowed(cls: type[CommonSettings], field: str) -> set[str]:
        return set(get_args(cls.model_fields[field].annotation))

    assert allowed(TrainerSettings, "codec") == set(codecs.available_codecs())
    assert allowed(TrainerSettings, "algorithm") == set(algorithms())
    assert allowed(TrainerSettings, "dtype") == allowed(TrainerSettings, "reference_dtype") == set(DTYPES)
    assert allowed(TrainerSettings, "publish_dtype") == {"auto", *DTYPES}
    assert allowed(TrainerSettings, "sample_shape") == set(SHAPES)
    assert allowed(ProxySettings, "proxy_backend") == set(BACKENDS)
    assert allowed(VllmSyncSettings, "pause_mode") == set(PAUSE_MODES)
    assert allowed(VllmSyncSettings, "lora_loading") == set(LORA_LOADINGS)


def _every_field() -> list[tuple[type[CommonSettings], str]]:
    return [(cls, name) for cls in (CommonSettings, *SERVICE_SETTINGS) for name in cls.model_fields]


def test_every_setting_has_a_description() -> None:
    """Every field of every service's class has a description: it is the --help text and the reference."""
    missing = [f"{cls.__name__}.{name}" for cls, name in _every_field() if not cls.model_fields[name].description]
    assert not missing, f"settings without a description: {missing}"


def test_every_setting_belongs_to_a_group() -> None:
    """Every field names its component (metadata only: the attribute and the variable stay flat)."""
    missing = [f"{cls.__name__}.{name}" for cls, name in _every_field() if field_group(cls, name) == "general"]
    assert not missing, f"settings without a group: {missing}"
    assert field_group(TrainerSettings, "learning_rate") == "optimizer" and env_name("learning_rate") == "FULMEN_LEARNING_RATE"
    assert load_settings(TrainerSettings, learning_rate=0.5).learning_rate == 0.5  # still settings.learning_rate
    assert {field_group(TrainerSettings, f) for f in ("lora_rank", "publish_format", "checkpoint_every", "parallel", "codec")} \
        == {"lora", "publishing", "checkpoints", "parallelism", "codec"}


@pytest.mark.parametrize(("command", "panels"), [
    ("trainer", ("Optimizer", "LoRA", "Publishing", "Checkpoints", "Parallelism", "Codec")),
    ("llm-proxy", ("Server", "Backend", "Upstream policy", "Limits")),
])
def test_a_commands_help_shows_its_settings_by_group(command: str, panels: tuple[str, ...]) -> None:
    """`fulmen trainer --help` puts each option in its group's panel (optimizer, LoRA, publishing, ...)."""
    from typer.testing import CliRunner

    from fulmen.cli.main import _add_service_commands, app

    _add_service_commands()
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    titles = [line.split("─ ", 1)[1].split(" ─")[0] for line in result.output.splitlines() if line.startswith("╭─ ")]
    assert set(panels) <= set(titles), titles
    first = result.output.split(f"╭─ {panels[0]}")[1].split("╰")[0]
    assert ("--learning-rate" if command == "trainer" else "--proxy-host") in first
