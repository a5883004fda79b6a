"""One settings object per process. Precedence: CLI flag > environment > default, checked in one place.

Every service reads its part of this one object, so a FULMEN_* variable meant for one service is
known to all (honcho gives every process the same environment). Environment names: ``REDIS_URL`` (secrets such as the Redis password live only there, never in a flag
or a log line) and ``FULMEN_<FIELD>`` for every field below; the CLI flags carry the same names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from pydantic import AliasChoices, Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from fulmen.codec import DEFAULT_MAX_RECORD_BYTES
from fulmen.embedded import DEFAULT_PORT
from fulmen.errors import InvalidInput
from fulmen.keys import check_experiment


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="FULMEN_", extra="forbid", frozen=True)

    redis_url: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("REDIS_URL", "redis_url"),
        description="Redis to use (redis://, rediss:// for TLS, user:password@ for ACL). Unset: the embedded one.",
    )
    experiment: str = Field("default", description="Experiment name; several share one Redis in isolation.")
    data_dir: Path = Field(
        Path(".fulmen"), description="Where the embedded Redis keeps its AOF (under redis/)."
    )
    redis_port: int = Field(DEFAULT_PORT, ge=1, le=65535, description="Port of the embedded Redis.")
    redis_wait_s: float = Field(
        60.0, ge=0, description="How long to wait for Redis to come up before giving up."
    )
    max_record_bytes: int = Field(DEFAULT_MAX_RECORD_BYTES, ge=1024, description="Size limit of one record.")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING or ERROR.")

    # --- runner ---------------------------------------------------------------------------------
    agent: str | None = Field(None, description="The agent to run, as module:function or module:Class.")
    concurrency: int = Field(8, ge=1, le=4096, description="Rollouts one runner process runs at once.")
    grace_s: float = Field(
        3.0, ge=0, description="On SIGTERM, how long in-flight rollouts may run on before they are released."
    )
    llm_base_url: str | None = Field(
        None, description="OpenAI-compatible base URL for agents; unset: the proxies registered in the store."
    )

    # --- llm proxy ------------------------------------------------------------------------------
    proxy_host: str = Field("127.0.0.1", description="Address the LLM proxy listens on.")
    proxy_port: int | None = Field(
        None, ge=0, le=65535, description="Port of the LLM proxy (unset: $PORT from honcho, else 8000)."
    )
    proxy_public_url: str | None = Field(
        None, description="Base URL the proxy registers for runners (unset: http://<host>:<port>)."
    )
    proxy_backend: str = Field("torch", description="torch (in-process HF model), vllm, or openai (upstream).")
    model_dir: Path | None = Field(None, description="Hugging Face model folder for the torch backend.")
    model_name: str | None = Field(None, description="Model name the proxy serves (default: the folder's name).")
    upstream_urls: str | None = Field(
        None, description="Comma-separated base URLs of upstream vllm/openai servers (sticky by rollout)."
    )
    proxy_api_keys: SecretStr | None = Field(
        None, description="Comma-separated bearer keys the proxy accepts (unset: no auth)."
    )
    upstream_api_key: SecretStr | None = Field(None, description="Bearer key for the upstream server.")
    max_request_bytes: int = Field(1 << 20, ge=1024, description="Largest request body the proxy accepts.")
    max_batch: int = Field(16, ge=1, le=1024, description="Most requests the torch backend decodes together.")

    # --- adapter --------------------------------------------------------------------------------
    llm_call_match: str | None = Field(
        None, description="Regex on span names that marks LLM calls (default: the proxy's llm_call spans)."
    )
    agent_match: str | None = Field(None, description="Regex: only LLM calls under a span whose name matches.")
    trajectories: bool = Field(True, description="Also join multi-turn calls into trajectory samples.")

    # --- trainer --------------------------------------------------------------------------------
    algorithm: str = Field("grpo", description="grpo, ppo, reinforce or sft.")
    learning_rate: float = Field(1e-4, ge=0, description="AdamW learning rate (0: a no-training baseline).")
    lr_warmup_steps: int = Field(0, ge=0, description="Steps of linear learning-rate warm-up.")
    lr_decay_steps: int | None = Field(None, ge=1, description="Steps of linear decay to lr_final after warm-up.")
    lr_final: float | None = Field(None, ge=0, description="Learning rate at the end of the decay.")
    groups_per_step: int = Field(8, ge=1, description="Complete task groups in one optimizer step.")
    group_size: int | None = Field(None, ge=1, description="Rollouts per task when samples do not say.")
    sample_shape: str = Field("triplet", description="Train on triplet (per call) or trajectory samples.")
    reward_source: str = Field("final", description="final (the rollout's last reward) or matched (per call).")
    max_staleness: int | None = Field(None, ge=0, description="Model versions a sample may lag (unset: any).")
    stale_policy: str = Field("drop", description="drop or downweight samples beyond max_staleness.")
    clip_eps: float = Field(0.2, gt=0, description="PPO clip range.")
    ppo_epochs: int = Field(1, ge=1, description="Optimizer updates per batch (PPO-clip passes over it).")
    tis_cap: float = Field(2.0, gt=0, description="Cap of the truncated importance weight for stale samples.")
    kl_coef: float = Field(0.0, ge=0, description="KL penalty to the initial (reference) model.")
    ent_coef: float = Field(0.0, ge=0, description="Entropy bonus.")
    loss_aggregation: str = Field("token", description="token or sequence mean of the per-token loss.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    micro_batch: int = Field(64, ge=1, description="Sequences per forward/backward pass (memory bound).")
    sft_min_reward: float | None = Field(None, description="sft: train only on samples with reward >= this.")
    publish_every: int = Field(1, ge=1, description="Publish a model version every K steps.")
    checkpoint_every: int = Field(1, ge=1, description="Checkpoint every K steps.")
    checkpoint_dir: Path = Field(Path(".fulmen/checkpoints"), description="Where the trainer checkpoints.")
    metrics_file: Path = Field(Path(".fulmen/trainer-metrics.jsonl"), description="Per-step metrics, JSON lines.")
    weights_dir: Path | None = Field(None, description="Shared folder for model versions (unset: via Redis).")
    max_steps: int | None = Field(None, ge=1, description="Stop after this many steps (unset: run until stopped).")
    torch_threads: int | None = Field(None, ge=1, description="torch CPU threads for the trainer.")
    seed: int = Field(0, description="Random seed.")
    # --- algorithm ------------------------------------------------------------------------------
    train_data: Path | None = Field(None, description="Training tasks: JSON lines, or a datasets folder.")
    val_data: Path | None = Field(None, description="Validation tasks (held out).")
    n_samples: int = Field(8, ge=1, description="Rollouts per task (the GRPO group).")
    max_inflight: int = Field(256, ge=1, description="Most train rollouts enqueued and unfinished.")
    staleness: int = Field(0, ge=0, description="Model versions a rollout may lag (0: synchronous).")
    epochs: int | None = Field(None, ge=1, description="Passes over the training tasks (unset: until total_steps).")
    total_steps: int | None = Field(None, ge=1, description="End the run when the trainer reaches this version.")
    rollout_unresponsive_s: float = Field(
        30.0, gt=0, description="A train rollout's attempt silent this long is ended by the watchdog and retried."
    )
    rollout_max_attempts: int = Field(
        3, ge=1, description="Attempts per train rollout (retried when unresponsive or timed out)."
    )
    critic_base_url: str | None = Field(None, description="APO's critic: an OpenAI-compatible base URL.")
    critic_model: str | None = Field(None, description="APO's critic model name.")
    critic_api_key: SecretStr | None = Field(None, description="Bearer key for the critic (never logged).")
    val_every: int | None = Field(None, ge=1, description="Validate every V trainer versions (needs val_data).")
    val_timeout_s: float = Field(600.0, gt=0, description="How long a validation pass may take.")
    target_accuracy: float | None = Field(
        None, gt=0, le=1, description="End the run early once two validation passes in a row reach this accuracy."
    )
    metrics_port: int | None = Field(
        None, ge=0, le=65535,
        description="Port of this process's /healthz /readyz /metrics (unset: $PORT; neither: none; 0: any free port).",
    )
    world_size: int = Field(1, ge=1, le=256, description="Data-parallel trainer ranks (honcho -c trainer=R).")
    codec: str = Field("none", description="Gradient codec between ranks: none, bf16, topk, dgc, qsgd8, qsgd4.")
    codec_density: float = Field(0.01, gt=0, le=1, description="Kept fraction for topk and dgc.")
    rank_timeout_s: float = Field(10.0, gt=0, description="A rank silent this long is considered gone.")
    on_rank_loss: str = Field("continue", description="When a rank is gone: continue without it, or wait.")

    @property
    def embedded(self) -> bool:
        return self.redis_url is None

    def redis_url_value(self) -> str:
        """The URL to connect to, secret included (pass it to the client, never to a log)."""
        if self.redis_url is not None:
            return self.redis_url.get_secret_value()
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def __repr_args__(self) -> Any:  # SecretStr already masks the password; say so plainly
        for name, value in super().__repr_args__():
            secret = name in ("redis_url", "proxy_api_keys", "upstream_api_key", "critic_api_key")
            yield name, ("<set>" if secret and value is not None else value)


def load_settings(**overrides: Any) -> Settings:
    """Build the settings from flags (``overrides``; None means "not given") over the environment.

    Unknown ``FULMEN_*`` environment variables are errors: a typo must not be silently ignored."""
    known = {f"FULMEN_{name.upper()}" for name in Settings.model_fields if name != "redis_url"}
    unknown = sorted(name for name in os.environ if name.startswith("FULMEN_") and name not in known)
    if unknown:
        raise InvalidInput(f"unknown environment variables {unknown}; known: {sorted(known)}")
    given = {name: value for name, value in overrides.items() if value is not None}
    try:
        settings = Settings(**given)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors())
        raise InvalidInput(f"invalid settings: {problems}") from None
    check_experiment(settings.experiment)
    return settings
