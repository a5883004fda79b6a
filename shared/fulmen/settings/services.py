"""Each service's settings: the common base plus only the fields that service reads, each tagged with
its group. A field two services read is defined once, in a mixin both inherit (`TrainingRunSettings`).
Every class lives here, not in its service: each process must also accept the others' variables (one
``.env`` for all), so the unknown-name check needs every field, and `fulmen` imports no service."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator

from fulmen.settings.base import CommonSettings, with_default

# --- the choices: a value outside them fails at load, naming the allowed ones ----------------------

Dtype = Literal["float32", "bfloat16"]
# the recipes fulmen_trainer.objectives registers (docs/guides/recipes.md)
Algorithm = Literal["grpo", "dr_grpo", "dapo", "gspo", "rloo", "reinforce_pp", "ppo", "ppo_gae", "reinforce", "sft"]
SampleShape = Literal["triplet", "trajectory"]
RewardSource = Literal["final", "matched"]
StalePolicy = Literal["drop", "downweight"]
LossAggregation = Literal["token", "sequence"]
PublishDtype = Literal["auto", "float32", "bfloat16"]
PublishFormat = Literal["full", "delta"]
ReferenceDevice = Literal["same", "cpu"]
Parallel = Literal["redis", "ddp", "fsdp"]
Codec = Literal["none", "bf16", "topk", "dgc", "qsgd8", "qsgd4"]  # the codecs fulmen_trainer.distributed.codecs registers
OnRankLoss = Literal["continue", "wait"]
ProxyBackend = Literal["torch", "vllm", "openai", "anthropic"]  # fulmen_llm_proxy.backends.registry.BACKENDS
PauseMode = Literal["wait", "abort", "keep"]
LoraLoading = Literal["auto", "dynamic", "merge"]
DemoTask = Literal["arithmetic", "tools"]
# the experiment trackers fulmen.telemetry.trackers registers, for report_to (a comma-separated list of them, or none)
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio")
NO_TRACKER = "none"
# auto, cpu, cuda or cuda:N (open-ended, so a pattern rather than a list)
DEVICE_PATTERN = r"^(auto|cpu|cuda(:[0-9]+)?)$"

# --- fields two or more services read ------------------------------------------------------------


class ModelDirSettings(CommonSettings):
    model_dir: Path | None = Field(
        None, description="Hugging Face model folder (the policy).", json_schema_extra={"group": "model"}
    )


class ServedModelSettings(ModelDirSettings):
    model_name: str | None = Field(
        None,
        description="Model name the policy is served as (default: the folder's name).",
        json_schema_extra={"group": "model"},
    )


class TrainingRunSettings(CommonSettings):
    """What the trainer and the algorithm must agree on."""

    groups_per_step: int = Field(
        8, ge=1, description="Complete task groups in one optimizer step.", json_schema_extra={"group": "run"}
    )
    seed: int = Field(0, description="Random seed.", json_schema_extra={"group": "run"})
    metrics_file: Path = Field(
        Path(".fulmen/run/default/trainer-metrics.jsonl"),
        description="Per-step metrics, JSON lines (unset: <data_dir>/run/<experiment>/trainer-metrics.jsonl).",
        json_schema_extra={"group": "run"},
    )

    @model_validator(mode="after")
    def _per_experiment_metrics(self) -> TrainingRunSettings:
        """Each experiment its own metrics file, unless one is named: two runs never write one file."""
        if "metrics_file" not in self.model_fields_set:
            object.__setattr__(
                self, "metrics_file", self.data_dir / "run" / self.experiment / "trainer-metrics.jsonl"
            )
        return self


class CheckpointDirSettings(CommonSettings):
    """Where the trainer's checkpoints are: the trainer writes them; a proxy and vllm-sync that can read
    the folder (one host, or a shared volume) rebuild from them a model version whose weights Redis lost."""

    checkpoint_dir: Path = Field(
        Path(".fulmen/checkpoints/default"),
        description="Where the trainer checkpoints, and where a proxy or vllm-sync that can read it rebuilds "
        "a model version Redis lost from (unset: <data_dir>/checkpoints/<experiment>).",
        json_schema_extra={"group": "checkpoints"},
    )

    @model_validator(mode="after")
    def _per_experiment_checkpoints(self) -> CheckpointDirSettings:
        """Each experiment its own checkpoints, unless a folder is named: a new experiment never resumes
        another one's weights and step."""
        if "checkpoint_dir" not in self.model_fields_set:
            object.__setattr__(self, "checkpoint_dir", self.data_dir / "checkpoints" / self.experiment)
        return self


class WeightGroupSettings(CommonSettings):
    """Full versions sent to vLLM over a process group (the trainer's rank 0 to the server's workers),
    where vllm-sync asks for them: one switch for both."""

    weight_group: bool = Field(
        False,
        description="Send full versions to vLLM servers over a process group (gloo, NCCL on GPUs) instead of a "
        "folder they reload: the trainer serves it, vllm-sync asks for it; the server runs with "
        "--worker-extension-cls fulmen.versions.transport.group.WorkerExtension (docs/guides/vllm.md).",
        json_schema_extra={"group": "weight group"},
    )
    weight_group_timeout_s: float = Field(
        60.0,
        gt=0,
        description="How long joining a weight group, or one version sent over it, may take before it counts as "
        "failed (vllm-sync then loads the version from a folder).",
        json_schema_extra={"group": "weight group"},
    )


class RolloutPolicySettings(CommonSettings):
    """The retry policy of the rollouts the algorithm and the validation passes enqueue."""

    rollout_unresponsive_s: float = Field(
        30.0,
        gt=0,
        description="A train rollout's attempt silent this long is ended by the watchdog and retried.",
        json_schema_extra={"group": "rollouts"},
    )
    rollout_max_attempts: int = Field(
        3,
        ge=1,
        description="Attempts per train rollout (retried when unresponsive or timed out).",
        json_schema_extra={"group": "rollouts"},
    )


class TaskColumnsSettings(CommonSettings):
    """How a Hugging Face dataset's rows become tasks, for the training and the validation data alike."""

    task_columns: str | None = Field(
        None,
        description="Dataset only: task fields from columns, as FIELD=COLUMN pairs separated by commas "
        "(e.g. question=prompt,answer=solution); other columns stay as they are; =COLUMN: the task is that "
        "column's value (unset: the rows as they are).",
        json_schema_extra={"group": "data"},
    )


class ValidationSettings(RolloutPolicySettings, TaskColumnsSettings):
    val_data: Path | None = Field(
        None,
        description="Validation tasks (held out): JSON lines, a save_to_disk folder, a .parquet or an .arrow file.",
        json_schema_extra={"group": "validation"},
    )
    val_split: str | None = Field(
        None,
        description="The split of val_data when it is a DatasetDict folder (unset: train).",
        json_schema_extra={"group": "validation"},
    )
    val_timeout_s: float = Field(
        600.0,
        gt=0,
        description="How long a validation pass may take.",
        json_schema_extra={"group": "validation"},
    )
    val_samples: int = Field(
        1,
        ge=1,
        le=1024,
        description="Samples per validation task: 1 is one greedy answer; k > 1 samples each task k times and "
        "reports pass@1, pass@2, pass@4, ... pass@k (unbiased estimator) and maj@k (majority vote).",
        json_schema_extra={"group": "validation"},
    )
    val_temperature: float | None = Field(
        None,
        ge=0,
        description="Sampling temperature of a validation pass with val_samples > 1 (unset: the policy's "
        "sampling temperature, else 1.0).",
        json_schema_extra={"group": "validation"},
    )


class TrainDataSettings(TaskColumnsSettings):
    train_data: Path | None = Field(
        None,
        description="Training tasks: JSON lines, a save_to_disk folder, a .parquet or an .arrow file.",
        json_schema_extra={"group": "data"},
    )
    train_split: str | None = Field(
        None,
        description="The split of train_data when it is a DatasetDict folder (unset: train).",
        json_schema_extra={"group": "data"},
    )


class ProxyKeysSettings(CommonSettings):
    """The keys the proxy accepts: the proxy checks them, a runner sends the first (one .env for all)."""

    proxy_api_keys: SecretStr | None = Field(
        None,
        description="Comma-separated bearer keys the proxy accepts (unset: no auth).",
        json_schema_extra={"group": "auth"},
    )


# --- one class per service -----------------------------------------------------------------------


class RunnerSettings(ProxyKeysSettings):
    agent: str | None = Field(
        None,
        description="The agent to run, as module:function or module:Class.",
        json_schema_extra={"group": "agent"},
    )
    concurrency: int = Field(
        8,
        ge=1,
        le=4096,
        description="Rollouts one runner process runs at once.",
        json_schema_extra={"group": "agent"},
    )
    grace_s: float = Field(
        3.0,
        ge=0,
        description="On SIGTERM, how long in-flight rollouts may run on before they are released.",
        json_schema_extra={"group": "agent"},
    )
    llm_base_url: str | None = Field(
        None,
        description="OpenAI-compatible base URL for agents; unset: the proxies registered in the store.",
        json_schema_extra={"group": "llm"},
    )
    proxy_retry_s: float = Field(
        60.0,
        ge=0,
        description="How long a rollout whose LLM proxy cannot be reached waits for it to come back "
        "(probing its /readyz with jittered backoff, the attempt held and heartbeating) before the "
        "rollout fails naming the proxy; each re-run after such a wait leaves the rollout's max_attempts "
        "untouched. Above a proxy's restart (10-30 s with a model to load).",
        json_schema_extra={"group": "llm"},
    )
    proxy_api_key: SecretStr | None = Field(
        None,
        description="Bearer key agents send to the proxies and to llm_base_url (unset: the first of "
        "proxy_api_keys, else none).",
        json_schema_extra={"group": "llm"},
    )

    def proxy_key(self) -> str | None:
        """The key agents send: this runner's own, else the first key the proxies accept (never logged)."""
        if self.proxy_api_key is not None:
            return self.proxy_api_key.get_secret_value().strip() or None
        if self.proxy_api_keys is not None:
            keys = [key.strip() for key in self.proxy_api_keys.get_secret_value().split(",")]
            return next((key for key in keys if key), None)
        return None


class ComputeSettings(CommonSettings):
    """Where a model computes (the trainer, the proxy's torch backend): one pair of settings for both."""

    device: str = Field(
        "auto",
        pattern=DEVICE_PATTERN,
        description="auto (a GPU if there is one, else cpu), cpu, cuda or cuda:N.",
        json_schema_extra={"group": "compute"},
    )
    dtype: Dtype = Field(
        "float32",
        description="float32, or bfloat16: bf16 weights and compute on a GPU (fp32 compute on a CPU); "
        "the trainer keeps fp32 master weights.",
        json_schema_extra={"group": "compute"},
    )


class ProxySettings(ServedModelSettings, ProxyKeysSettings, ComputeSettings, CheckpointDirSettings):
    proxy_host: str = Field(
        "127.0.0.1", description="Address the LLM proxy listens on.", json_schema_extra={"group": "server"}
    )
    proxy_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of the LLM proxy (unset: $PORT from honcho, else 8000).",
        json_schema_extra={"group": "server"},
    )
    proxy_public_url: str | None = Field(
        None,
        description="Base URL the proxy registers for runners (unset: http://<host>:<port>).",
        json_schema_extra={"group": "server"},
    )
    proxy_backend: ProxyBackend = Field(
        "torch", description="torch (in-process HF model), vllm, openai (an OpenAI-compatible upstream) or "
        "anthropic (an Anthropic Messages upstream).", json_schema_extra={"group": "backend"},
    )  # fmt: skip
    upstream_urls: str | None = Field(
        None,
        description="Comma-separated base URLs of upstream vllm/openai/anthropic servers (sticky by rollout).",
        json_schema_extra={"group": "upstream"},
    )
    upstream_api_key: SecretStr | None = Field(
        None,
        description="Key for the upstream server: a bearer token (vllm, openai), x-api-key (anthropic).",
        json_schema_extra={"group": "upstream"},
    )
    upstream_max_tokens: int = Field(
        4096,
        ge=1,
        description="max_tokens sent to an anthropic upstream when a call sets none (Anthropic requires it).",
        json_schema_extra={"group": "upstream"},
    )
    # Calls to upstreams (vllm, openai, anthropic): retries, rate limit, cache (`fulmen_llm_proxy.backends.upstream.policy`).
    upstream_max_attempts: int = Field(
        3,
        ge=1,
        le=20,
        description="Sends of one upstream call at most, on 429, 5xx and timeouts (1: no retry).",
        json_schema_extra={"group": "upstream policy"},
    )
    upstream_backoff_s: float = Field(
        0.5,
        ge=0,
        description="First retry's backoff; doubled per retry, jittered, capped by upstream_backoff_max_s.",
        json_schema_extra={"group": "upstream policy"},
    )
    upstream_backoff_max_s: float = Field(
        20.0,
        ge=0,
        description="Longest backoff between two retries.",
        json_schema_extra={"group": "upstream policy"},
    )
    upstream_budget_s: float = Field(
        120.0,
        gt=0,
        description="Most time one call spends on attempts, backoffs and rate-limit waits together.",
        json_schema_extra={"group": "upstream policy"},
    )
    upstream_load_wait_s: float = Field(
        120.0,
        ge=0,
        description="How long a call waits while every upstream replica loads a model version, before a 503 "
        "(0: answer 503 at once). The call is then served by the new version, and recorded as such.",
        json_schema_extra={"group": "upstream policy"},
    )
    upstream_timeout_s: float = Field(
        300.0,
        gt=0,
        description="One attempt's wait for the upstream's reply (streaming: for its first bytes).",
        json_schema_extra={"group": "upstream policy"},
    )
    upstream_rpm: int | None = Field(
        None,
        ge=1,
        description="Requests per minute to each upstream URL (unset: no limit).",
        json_schema_extra={"group": "limits"},
    )
    upstream_tpm: int | None = Field(
        None,
        ge=1,
        description="Tokens per minute to each upstream URL, estimated then settled by usage (unset: no limit).",
        json_schema_extra={"group": "limits"},
    )
    upstream_cache_entries: int = Field(
        0,
        ge=0,
        description="Temperature-0 responses of the openai and anthropic backends cached in the proxy, LRU (0: no cache).",
        json_schema_extra={"group": "upstream policy"},
    )
    max_request_bytes: int = Field(
        1 << 20,
        ge=1024,
        description="Largest request body the proxy accepts.",
        json_schema_extra={"group": "limits"},
    )
    max_batch: int = Field(
        16,
        ge=1,
        le=1024,
        description="Most requests the torch backend decodes together.",
        json_schema_extra={"group": "backend"},
    )
    default_max_tokens: int = Field(
        256, ge=1, description="Tokens the torch backend generates at most when a call sets no max_tokens (an "
        "answer also ends at the model's context length); a cut answer finishes with 'length', and its span "
        "and the log say which limit cut it.", json_schema_extra={"group": "backend"},
    )  # fmt: skip
    weights_dir: Path | None = Field(
        None,
        description="The trainer's shared folder for model versions, if it uses one: the torch backend reads "
        "the next version there while it is written (else from the folder of the last version announced).",
        json_schema_extra={"group": "publishing"},
    )


class AdapterSettings(CommonSettings):
    llm_call_match: str | None = Field(
        None,
        description="Regex on span names that marks LLM calls (default: the proxy's llm_call spans).",
        json_schema_extra={"group": "matching"},
    )
    agent_match: str | None = Field(
        None,
        description="Regex: only LLM calls under a span whose name matches.",
        json_schema_extra={"group": "matching"},
    )
    trajectories: bool = Field(
        True,
        description="Also join multi-turn calls into trajectory samples.",
        json_schema_extra={"group": "samples"},
    )
    tokenizer_dir: Path | None = Field(
        None,
        description="The policy's model folder: LLM calls answered without token ids (a text-only teacher upstream) "
        "are tokenised with its tokenizer and chat template into samples marked retokenized, for SFT (unset: skipped).",
        json_schema_extra={"group": "samples"},
    )
    judge_url: str | None = Field(
        None,
        description="Base URL (.../v1) of an OpenAI-compatible server whose model rescores each train group once "
        "all its rollouts end, before their samples are written (unset: no judge; docs/guides/rewards.md).",
        json_schema_extra={"group": "judge"},
    )
    judge_model: str | None = Field(
        None, description="The judge's model name (required with judge_url).", json_schema_extra={"group": "judge"}
    )
    judge_api_key: SecretStr | None = Field(
        None, description="Bearer key for judge_url (never logged).", json_schema_extra={"group": "judge"}
    )
    judge_rubric: str | None = Field(
        None,
        description="What the judge scores by (unset: fulmen.rewards.DEFAULT_RUBRIC).",
        json_schema_extra={"group": "judge"},
    )
    judge_mix: float = Field(
        1.0,
        ge=0,
        le=1,
        description="The judge's share of the final reward: mix * judge + (1 - mix) * the agent's own (1: replaced).",
        json_schema_extra={"group": "judge"},
    )
    judge_wait_s: float = Field(
        120.0,
        gt=0,
        description="Longest wait for a group's last rollout after its first one ended; then its samples are "
        "written with their own rewards.",
        json_schema_extra={"group": "judge"},
    )
    judge_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Longest a group's judging may take (every try); past it, or on an error, own rewards.",
        json_schema_extra={"group": "judge"},
    )
    judge_max_tokens: int = Field(
        1024, ge=1, description="max_tokens of each judge call.", json_schema_extra={"group": "judge"}
    )


class TrainerSettings(ServedModelSettings, TrainingRunSettings, ComputeSettings, CheckpointDirSettings,
                      WeightGroupSettings):
    weight_group_host: str = Field(
        "127.0.0.1",
        description="The address vLLM's workers reach this trainer's weight-group rendezvous at.",
        json_schema_extra={"group": "weight group"},
    )
    weight_group_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="The port the weight-group rendezvous listens on (0: a free one, advertised in the store).",
        json_schema_extra={"group": "weight group"},
    )
    algorithm: Algorithm = Field(
        "grpo",
        description="The training recipe: grpo, dr_grpo, dapo, gspo, rloo, reinforce_pp, ppo, ppo_gae, reinforce or sft "
        "(docs/guides/recipes.md).",
        json_schema_extra={"group": "objective"},
    )
    learning_rate: float = Field(
        1e-4,
        ge=0,
        description="AdamW learning rate (0: a no-training baseline).",
        json_schema_extra={"group": "optimizer"},
    )
    lr_warmup_steps: int = Field(
        0,
        ge=0,
        description="Steps of linear learning-rate warm-up.",
        json_schema_extra={"group": "optimizer"},
    )
    lr_decay_steps: int | None = Field(
        None,
        ge=1,
        description="Steps of linear decay to lr_final after warm-up.",
        json_schema_extra={"group": "optimizer"},
    )
    lr_final: float | None = Field(
        None,
        ge=0,
        description="Learning rate at the end of the decay.",
        json_schema_extra={"group": "optimizer"},
    )
    group_size: int | None = Field(
        None,
        ge=1,
        description="Rollouts per task when samples do not say.",
        json_schema_extra={"group": "objective"},
    )
    sample_shape: SampleShape = Field(
        "triplet",
        description="Train on triplet (per call) or trajectory samples.",
        json_schema_extra={"group": "objective"},
    )
    reward_source: RewardSource = Field(
        "final",
        description="final (the rollout's last reward) or matched (per call).",
        json_schema_extra={"group": "objective"},
    )
    max_staleness: int | None = Field(
        None,
        ge=0,
        description="Model versions a sample may lag (unset: any).",
        json_schema_extra={"group": "objective"},
    )
    stale_policy: StalePolicy = Field(
        "drop",
        description="drop or downweight samples beyond max_staleness.",
        json_schema_extra={"group": "objective"},
    )
    clip_eps: float = Field(
        0.2, gt=0, description="PPO clip range.", json_schema_extra={"group": "objective"}
    )
    ppo_epochs: int = Field(
        1,
        ge=1,
        description="Optimizer updates per batch (PPO-clip passes over it).",
        json_schema_extra={"group": "objective"},
    )
    tis_cap: float = Field(
        2.0,
        gt=0,
        description="Cap of the truncated importance weight for stale samples.",
        json_schema_extra={"group": "objective"},
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="KL penalty to the initial (reference) model.",
        json_schema_extra={"group": "objective"},
    )
    ent_coef: float = Field(0.0, ge=0, description="Entropy bonus.", json_schema_extra={"group": "objective"})
    loss_aggregation: LossAggregation = Field(
        "token",
        description="token or sequence mean of the per-token loss.",
        json_schema_extra={"group": "objective"},
    )
    max_grad_norm: float = Field(
        1.0, gt=0, description="Gradient clipping norm.", json_schema_extra={"group": "optimizer"}
    )
    micro_batch: int = Field(
        64,
        ge=1,
        description="Most sequences per forward/backward pass.",
        json_schema_extra={"group": "batching"},
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="Padded tokens per forward/backward pass (unset: micro_batch alone decides).",
        json_schema_extra={"group": "batching"},
    )
    logprob_chunk_tokens: int = Field(
        1024,
        ge=1,
        description="Trained tokens per chunk of the output layer (bounds the fp32 logits in memory).",
        json_schema_extra={"group": "batching"},
    )
    entropy_metric: bool = Field(
        True,
        description="Compute the policy's entropy as a metric even with ent_coef 0.",
        json_schema_extra={"group": "objective"},
    )
    gradient_checkpointing: bool = Field(
        False,
        description="Recompute activations in the backward pass (less memory).",
        json_schema_extra={"group": "batching"},
    )
    pack_sequences: bool = Field(
        False,
        description="Concatenate a micro-batch's sequences into rows without padding, each attending only to "
        "itself (the same gradient, fewer tokens; micro_batch_tokens then counts the packed tokens).",
        json_schema_extra={"group": "batching"},
    )
    lora_rank: int | None = Field(
        None,
        ge=1,
        description="Train a LoRA adapter of this rank (unset: full fine-tuning).",
        json_schema_extra={"group": "lora"},
    )
    lora_alpha: float = Field(
        32.0,
        gt=0,
        description="LoRA alpha (the adapter is scaled by alpha / rank).",
        json_schema_extra={"group": "lora"},
    )
    lora_dropout: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Dropout on the LoRA adapter's input.",
        json_schema_extra={"group": "lora"},
    )
    lora_target_modules: str = Field(
        "all-linear",
        description="Modules that get an adapter: all-linear, or names such as q_proj,v_proj.",
        json_schema_extra={"group": "lora"},
    )
    publish_dtype: PublishDtype = Field(
        "auto",
        description="dtype of published model versions: auto (the training dtype), float32 or bfloat16.",
        json_schema_extra={"group": "publishing"},
    )
    publish_format: PublishFormat = Field(
        "full",
        description="Model versions: full, or delta (what changed since the previous version; "
        "a full version every keyframe_every). A LoRA adapter is always published whole.",
        json_schema_extra={"group": "publishing"},
    )
    keyframe_every: int = Field(
        10,
        ge=1,
        description="delta: publish a full version every K versions.",
        json_schema_extra={"group": "publishing"},
    )
    reference_dtype: Dtype = Field(
        "bfloat16",
        description="The KL reference copy's dtype (not used with LoRA).",
        json_schema_extra={"group": "objective"},
    )
    reference_device: ReferenceDevice = Field(
        "same",
        description="The KL reference copy's device: same, or cpu to offload it.",
        json_schema_extra={"group": "objective"},
    )
    sft_min_reward: float | None = Field(
        None,
        description="sft: train only on samples with reward >= this.",
        json_schema_extra={"group": "objective"},
    )
    clip_eps_low: float | None = Field(
        None,
        gt=0,
        description="Lower clip range: the ratio is kept above 1 - this (unset: the recipe's, else clip_eps).",
        json_schema_extra={"group": "objective"},
    )
    clip_eps_high: float | None = Field(
        None,
        gt=0,
        description="Upper clip range: the ratio is kept below 1 + this (unset: the recipe's, dapo 0.28, "
        "else clip_eps).",
        json_schema_extra={"group": "objective"},
    )
    dynamic_sampling: bool | None = Field(
        None,
        description="Never train on a group whose rewards are all equal; the step is filled from later "
        "groups (unset: on for dapo).",
        json_schema_extra={"group": "objective"},
    )
    max_response_length: int | None = Field(
        None,
        ge=1,
        description="The rollouts' generation limit in tokens (their max_tokens): dr_grpo's constant "
        "normaliser and the overlong penalty's end.",
        json_schema_extra={"group": "objective"},
    )
    overlong_buffer_len: int | None = Field(
        None,
        ge=0,
        description="Overlong penalty: responses in the last this many tokens before max_response_length "
        "lose reward linearly, up to overlong_penalty_factor (unset: a fifth of it for dapo, else off; 0: off).",
        json_schema_extra={"group": "objective"},
    )
    overlong_penalty_factor: float = Field(
        1.0,
        ge=0,
        description="The overlong penalty at max_response_length and beyond.",
        json_schema_extra={"group": "objective"},
    )
    gamma: float = Field(
        1.0,
        ge=0,
        le=1,
        description="ppo_gae: the discount per response token of generalised advantage estimation.",
        json_schema_extra={"group": "objective"},
    )
    gae_lambda: float = Field(
        0.95,
        ge=0,
        le=1,
        description="ppo_gae: GAE's λ (1: the Monte Carlo return minus the value; 0: the one-step TD error).",
        json_schema_extra={"group": "objective"},
    )
    whiten_advantages: bool = Field(
        True,
        description="ppo_gae: the per-token advantages shifted and scaled to mean 0, std 1 over the step's tokens.",
        json_schema_extra={"group": "objective"},
    )
    vf_coef: float = Field(
        0.1,
        ge=0,
        description="ppo_gae: the value loss's weight in the loss.",
        json_schema_extra={"group": "objective"},
    )
    value_clip: float = Field(
        0.2,
        ge=0,
        description="ppo_gae: the new value is clipped to within this of the step's start value in the value "
        "loss (0: not clipped).",
        json_schema_extra={"group": "objective"},
    )
    publish_every: int = Field(
        1,
        ge=1,
        description="Publish a model version every K steps.",
        json_schema_extra={"group": "publishing"},
    )
    checkpoint_every: int = Field(
        1,
        ge=1,
        description="Checkpoint every K steps (a step that publishes a version always checkpoints first).",
        json_schema_extra={"group": "checkpoints"},
    )
    weights_dir: Path | None = Field(
        None,
        description="Shared folder for model versions (unset: via Redis).",
        json_schema_extra={"group": "publishing"},
    )
    keep_versions: int = Field(
        3,
        ge=1,
        description="Model versions whose weights stay stored (the newest; a version a proxy serves stays too).",
        json_schema_extra={"group": "publishing"},
    )
    max_steps: int | None = Field(
        None,
        ge=1,
        description="Stop after this many steps (unset: run until stopped).",
        json_schema_extra={"group": "run"},
    )
    torch_threads: int | None = Field(
        None, ge=1, description="torch CPU threads for the trainer.", json_schema_extra={"group": "compute"}
    )
    parallel: Parallel = Field(
        "redis",
        description="How trainer ranks share a step: redis (honcho -c trainer=R, with world_size), "
        "or under torchrun --nproc-per-node N: ddp (a model per GPU) or fsdp (the model sharded over them).",
        json_schema_extra={"group": "parallelism"},
    )
    ddp_bucket_mb: float = Field(
        25.0,
        gt=0,
        description="ddp: gradient bucket size (MB) of each all-reduce.",
        json_schema_extra={"group": "parallelism"},
    )
    world_size: int = Field(
        1,
        ge=1,
        le=256,
        description="Data-parallel trainer ranks (honcho -c trainer=R).",
        json_schema_extra={"group": "parallelism"},
    )
    codec: Codec = Field(
        "none",
        description="Gradient codec between ranks: none, bf16, topk, dgc, qsgd8, qsgd4.",
        json_schema_extra={"group": "codec"},
    )
    codec_density: float = Field(
        0.01, gt=0, le=1, description="Kept fraction for topk and dgc.", json_schema_extra={"group": "codec"}
    )
    full_sync_every: int | None = Field(
        None,
        ge=1,
        description="Send the gradient uncompressed (with what error feedback held back) every K steps.",
        json_schema_extra={"group": "codec"},
    )
    density_schedule: str | None = Field(
        None,
        description="topk/dgc density by phase: 'until_step:density,...,density', e.g. 50:0.1,900:0.01,0.05.",
        json_schema_extra={"group": "codec"},
    )
    adaptive_density: bool = Field(
        False,
        description="Scale the density (x1/4..x4) to keep comm/cosine near target_cosine.",
        json_schema_extra={"group": "codec"},
    )
    target_cosine: float = Field(
        0.8,
        gt=0,
        le=1,
        description="adaptive_density: the cosine to hold.",
        json_schema_extra={"group": "codec"},
    )
    anomaly_factor: float = Field(
        10.0,
        gt=1,
        description="A gradient norm this many times the recent median is sent uncompressed (and logged).",
        json_schema_extra={"group": "codec"},
    )
    rank_timeout_s: float = Field(
        10.0,
        gt=0,
        description="A rank silent this long is considered gone.",
        json_schema_extra={"group": "parallelism"},
    )
    on_rank_loss: OnRankLoss = Field(
        "continue",
        description="When a rank is gone: continue without it, or wait.",
        json_schema_extra={"group": "parallelism"},
    )


class AlgorithmSettings(ServedModelSettings, TrainingRunSettings, ValidationSettings, TrainDataSettings):
    n_samples: int = Field(
        8, ge=1, description="Rollouts per task (the GRPO group).", json_schema_extra={"group": "rollouts"}
    )
    max_inflight: int = Field(
        256,
        ge=1,
        description="Most train rollouts enqueued and unfinished.",
        json_schema_extra={"group": "rollouts"},
    )
    staleness: int = Field(
        0,
        ge=0,
        description="Trainer steps a round of rollouts may run ahead of the weights the model servers serve "
        "(0: synchronous).",
        json_schema_extra={"group": "rollouts"},
    )
    epochs: int | None = Field(
        None,
        ge=1,
        description="Passes over the training tasks (unset: until total_steps).",
        json_schema_extra={"group": "run"},
    )
    total_steps: int | None = Field(
        None,
        ge=1,
        description="Trainer steps in the run: exactly N (nothing is enqueued past step N); the last model "
        "version is then v<N> (the base is version 0; with publish_every K, v<N // K>).",
        json_schema_extra={"group": "run"},
    )
    val_every: int | None = Field(
        None,
        ge=1,
        description="Validate every V trainer versions (needs val_data).",
        json_schema_extra={"group": "validation"},
    )
    target_accuracy: float | None = Field(
        None,
        gt=0,
        le=1,
        description="End the run early once two validation passes in a row reach this accuracy.",
        json_schema_extra={"group": "validation"},
    )
    report_to: str = Field(
        NO_TRACKER,
        description="Experiment trackers that get the run's metrics, comma-separated: tensorboard, wandb, mlflow, "
        "trackio, or none (docs/guides/trackers.md).",
        json_schema_extra={"group": "trackers"},
    )

    @model_validator(mode="after")
    def _known_trackers(self) -> AlgorithmSettings:
        """report_to as a clean list (``"wandb,tensorboard"``; ``"none"``): an unknown name fails here,
        naming the known ones."""
        names = [name.strip().lower() for name in self.report_to.split(",") if name.strip()]
        unknown = [name for name in names if name not in (*TRACKERS, NO_TRACKER)]
        if unknown:
            raise ValueError(f"report_to: unknown tracker {unknown[0]!r}; use {', '.join(TRACKERS)} or {NO_TRACKER}")
        if NO_TRACKER in names and len(names) > 1:
            raise ValueError(f"report_to: {NO_TRACKER} cannot be listed with trackers")
        chosen = [name for name in dict.fromkeys(names) if name != NO_TRACKER]
        object.__setattr__(self, "report_to", ",".join(chosen) or NO_TRACKER)
        return self


class DemoSettings(AlgorithmSettings):
    """The algorithm with the demo's defaults: it must end on its own and validate as it goes."""

    total_steps: int | None = with_default(AlgorithmSettings, "total_steps", 300)
    val_every: int | None = with_default(AlgorithmSettings, "val_every", 25)
    task: DemoTask = Field(
        "arithmetic",
        description="The demo's task: arithmetic (2-digit addition, one call) or tools (3-digit "
        "multiplication through a calculator tool, multi-turn; run it with Procfile.tools and .env.tools).",
        json_schema_extra={"group": "demo"},
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="torch CPU threads for the demo's SFT warm start (unset: torch's default). The demo's .env "
        "sets 1, as for the trainer: its services share the cores, and torch's threads run several times "
        "slower when another process holds a core.",
        json_schema_extra={"group": "demo"},
    )


class EvaluatorSettings(RolloutPolicySettings):
    pass


class EvalSettings(ValidationSettings):
    pass


class VllmSyncSettings(ServedModelSettings, CheckpointDirSettings, WeightGroupSettings):
    vllm_url: str | None = Field(
        None,
        description="The vLLM server to keep in step (its base URL, as in upstream_urls).",
        json_schema_extra={"group": "vllm server"},
    )
    vllm_api_key: SecretStr | None = Field(
        None,
        description="Bearer key of that server's routes (never logged).",
        json_schema_extra={"group": "vllm server"},
    )
    replica_url: str | None = Field(
        None,
        description="The URL proxies reach that server at, as in their upstream_urls (unset: vllm_url).",
        json_schema_extra={"group": "vllm server"},
    )
    sync_dir: Path = Field(
        Path(".fulmen/vllm-sync/default"),
        description="Where versions are written for the server to load (it must see this path; unset: "
        "<data_dir>/vllm-sync/<experiment>).",
        json_schema_extra={"group": "sync"},
    )
    sync_timeout_s: float = Field(
        120.0,
        gt=0,
        description="Each admin route's timeout (pause, load, verify, resume).",
        json_schema_extra={"group": "sync"},
    )
    sync_retry_s: float = Field(
        5.0, gt=0, description="Wait before trying a failed sync again.", json_schema_extra={"group": "sync"}
    )
    pause_mode: PauseMode = Field(
        "wait",
        description="How the server pauses for a load: wait (drain), abort, or keep.",
        json_schema_extra={"group": "sync"},
    )
    lora_loading: LoraLoading = Field(
        "auto",
        description="LoRA versions: dynamic (load each adapter at run time, no pause; the server runs with --enable-lora "
        "and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True), merge (merge it onto the base and reload the weights), or auto "
        "(dynamic, else merge when the server cannot load adapters).",
        json_schema_extra={"group": "sync"},
    )

    @model_validator(mode="after")
    def _per_experiment_sync_dir(self) -> VllmSyncSettings:
        """Each experiment its own folder of versions, unless one is named: two experiments' syncs never
        write, or delete, each other's folders."""
        if "sync_dir" not in self.model_fields_set:
            object.__setattr__(self, "sync_dir", self.data_dir / "vllm-sync" / self.experiment)
        return self


class ApoSettings(TrainDataSettings):
    critic_base_url: str | None = Field(
        None,
        description="APO's critic: an OpenAI-compatible base URL.",
        json_schema_extra={"group": "critic"},
    )
    critic_model: str | None = Field(
        None, description="APO's critic model name.", json_schema_extra={"group": "critic"}
    )
    critic_api_key: SecretStr | None = Field(
        None, description="Bearer key for the critic (never logged).", json_schema_extra={"group": "critic"}
    )


class DashboardSettings(CommonSettings):
    dashboard_host: str = Field(
        "127.0.0.1", description="Address the dashboard listens on.", json_schema_extra={"group": "server"}
    )
    dashboard_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of the dashboard (unset: $PORT from honcho, else 8300; 0: any free port).",
        json_schema_extra={"group": "server"},
    )
    dashboard_admin: bool = Field(
        False,
        description="Allow admin actions (cancel a rollout, requeue a dead letter); off: read-only.",
        json_schema_extra={"group": "auth"},
    )
    dashboard_token: SecretStr | None = Field(
        None,
        description="Require this secret: as a bearer token, or as the password of HTTP basic auth (any user name). "
        "Unset: no auth.",
        json_schema_extra={"group": "auth"},
    )


class WatchdogSettings(CommonSettings):
    """The watchdog's retention loop (`fulmen.retention.trim`). Off by default: trimming drops spans
    and samples for good, so it runs only when asked, after whatever archives them."""

    retention_interval_s: float | None = Field(
        None,
        gt=0,
        description="Seconds between the watchdog's retention passes (unset: 300 once a retention limit is set; "
        "with none, the default, no retention loop runs and `fulmen trim` trims by hand).",
        json_schema_extra={"group": "retention"},
    )
    retention_max_age_s: float | None = Field(
        None,
        ge=0,
        description="Retention: queue, finished and samples entries at least this old (seconds) go, once every consumer group "
        "acknowledged them (with a finished entry, its rollout's spans).",
        json_schema_extra={"group": "retention"},
    )
    retention_max_count: int | None = Field(
        None,
        ge=0,
        description="Retention: at most this many entries stay per queue, finished and samples stream "
        "(acknowledged ones go first; an unacknowledged one never goes).",
        json_schema_extra={"group": "retention"},
    )
    retention_delete_rollouts: bool = Field(
        False,
        description="Retention: delete the records of the rollouts whose finished entries go, too.",
        json_schema_extra={"group": "retention"},
    )
    retention_resources: bool = Field(
        False,
        description="Retention: trim the resources log by the same limits (never what a stored or served "
        "model version needs, never the newest entry).",
        json_schema_extra={"group": "retention"},
    )
    retention_keep_versions: int | None = Field(
        None,
        ge=1,
        description="Retention: the weights of the newest this many model versions stay, and any version "
        "served (unset: the weights are left to the trainer's keep_versions).",
        json_schema_extra={"group": "retention"},
    )
    retention_steps_max_count: int | None = Field(
        None,
        ge=1,
        description="Retention: the trainer's newest this many step records stay (unset: all).",
        json_schema_extra={"group": "retention"},
    )
    retention_dead_letters_max_age_s: float | None = Field(
        None,
        ge=0,
        description="Retention: dead letters at least this old (seconds) go (unset: all stay).",
        json_schema_extra={"group": "retention"},
    )
    weights_dir: Path | None = with_default(TrainerSettings, "weights_dir", None)


# Each command's class (`fulmen config SERVICE`); the proxy's command is llm-proxy.
SERVICES: dict[str, type[CommonSettings]] = {
    "runner": RunnerSettings,
    "llm-proxy": ProxySettings,
    "adapter": AdapterSettings,
    "trainer": TrainerSettings,
    "algorithm": AlgorithmSettings,
    "demo": DemoSettings,
    "evaluator": EvaluatorSettings,
    "eval": EvalSettings,
    "apo": ApoSettings,
    "vllm-sync": VllmSyncSettings,
    "dashboard": DashboardSettings,
    "watchdog": WatchdogSettings,
}

# Every process's class: a FULMEN_* variable is known if one of them has the field.
SERVICE_SETTINGS: tuple[type[CommonSettings], ...] = (
    CommonSettings,
    RunnerSettings,
    ProxySettings,
    AdapterSettings,
    TrainerSettings,
    AlgorithmSettings,
    DemoSettings,
    EvaluatorSettings,
    EvalSettings,
    ApoSettings,
    VllmSyncSettings,
    DashboardSettings,
    WatchdogSettings,
)
