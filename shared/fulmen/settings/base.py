"""What every process reads: where Redis is, which experiment, logging and the ops port.

Environment names: ``REDIS_URL`` (secrets such as the Redis password live only there, never in a
flag or a log line) and ``FULMEN_<FIELD>`` for every other field; the CLI flags carry the same names.
"""

from __future__ import annotations

import re
from copy import copy
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BeforeValidator, Field, SecretStr
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from fulmen.codec import DEFAULT_MAX_RECORD_BYTES
from fulmen.errors import InvalidInput

# An experiment's name, matched whole (``$`` would also match before a trailing newline): it goes
# into every Redis key (`fulmen.keys`) and into log lines.
_EXPERIMENT = re.compile(r"[A-Za-z0-9_.\-]{1,64}")

DEFAULT_PORT = 6399  # the embedded Redis's: not 6379, so a system Redis on the default port is left alone


def check_experiment(name: str) -> str:
    """``name`` if it can name an experiment: it also names the experiment's folders (checkpoints,
    metrics, archive, vLLM sync), so '.' and '..', which would name a folder above them, are refused."""
    if not isinstance(name, str) or not _EXPERIMENT.fullmatch(name) or set(name) == {"."}:
        raise InvalidInput(f"experiment name {name!r} is invalid: use 1-64 letters, digits, '_', '.' or '-', "
                           "not only dots")
    return name

ENV_PREFIX = "FULMEN_"
# The one field read from an unprefixed name: REDIS_URL is what every Redis tool already reads.
REDIS_URL_FIELD = "redis_url"
# Log levels are read in any case (``info`` as ``INFO``), as `logging` reads them.
LogLevel = Annotated[
    Literal["DEBUG", "INFO", "WARNING", "ERROR"],
    BeforeValidator(lambda v: v.upper() if isinstance(v, str) else v),
]


class CommonSettings(BaseSettings):
    """The base of every service's settings; a service's own class adds only the fields it reads."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    redis_url: SecretStr | None = Field(
        default=None,
        validation_alias=AliasChoices("REDIS_URL", REDIS_URL_FIELD),
        description="Redis to use (redis://, rediss:// for TLS, user:password@ for ACL). Unset: the embedded one.",
        json_schema_extra={"group": "redis"},
    )
    weights_redis_url: SecretStr | None = Field(
        default=None,
        description="Opt-in: a Redis of its own for model versions' weight chunks, typically without AOF "
        "(unset: the main Redis). Faster for large full versions; the versions it holds are lost when it "
        "restarts (replicas keep their weights until the trainer's next version). Every process of the experiment sets the same.",
        json_schema_extra={"group": "redis"},
    )
    config: Path | None = Field(
        None,
        description="A run file (YAML, grouped by service) read under the environment and the flags.",
        json_schema_extra={"group": "experiment"},
    )
    experiment: str = Field(
        "default",
        description="Experiment name; several share one Redis in isolation.",
        json_schema_extra={"group": "experiment"},
    )
    data_dir: Path = Field(
        Path(".fulmen"),
        description="Where the embedded Redis keeps its AOF (under redis/).",
        json_schema_extra={"group": "redis"},
    )
    redis_port: int = Field(
        DEFAULT_PORT,
        ge=1,
        le=65535,
        description="Port of the embedded Redis.",
        json_schema_extra={"group": "redis"},
    )
    redis_wait_s: float = Field(
        60.0,
        ge=0,
        description="How long to wait for Redis to come up before giving up.",
        json_schema_extra={"group": "redis"},
    )
    redis_outage_s: float = Field(
        60.0,
        ge=0,
        description="How long a running service rides out a Redis outage (reconnecting with backoff) before it gives up.",
        json_schema_extra={"group": "redis"},
    )
    max_record_bytes: int = Field(
        DEFAULT_MAX_RECORD_BYTES,
        ge=1024,
        description="Size limit of one record.",
        json_schema_extra={"group": "store"},
    )
    store_shards: int = Field(
        1,
        ge=1,
        le=64,
        description="Shards of an experiment's rollout lifecycle in the store, each with a hash tag of its own "
        "(on a Redis Cluster: the number of masters). The same for every process of the experiment; "
        "the store reads it from the environment (fulmen.keys).",
        json_schema_extra={"group": "store"},
    )
    weights_in_aof: bool = Field(
        False,
        description="Write model versions' weight chunks through the AOF (and to replicas) like any other write "
        "(off: outside it, as the trainer publishes them again after a restart; always on a cluster).",
        json_schema_extra={"group": "store"},
    )
    log_level: LogLevel = Field(
        "INFO", description="DEBUG, INFO, WARNING or ERROR.", json_schema_extra={"group": "ops"}
    )
    metrics_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of this process's /healthz /readyz /metrics (unset: $PORT; neither: none; 0: any free port).",
        json_schema_extra={"group": "ops"},
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="Address /healthz /readyz /metrics listen on (containers set 0.0.0.0 for probes and scrapers).",
        json_schema_extra={"group": "ops"},
    )
    metrics_token: SecretStr | None = Field(
        None,
        description="Bearer token /metrics requires (unset: none); /healthz and /readyz stay open for probes.",
        json_schema_extra={"group": "ops"},
    )

    @property
    def embedded(self) -> bool:
        return self.redis_url is None

    def redis_url_value(self) -> str:
        """The URL to connect to, secret included (pass it to the client, never to a log)."""
        if self.redis_url is not None:
            return self.redis_url.get_secret_value()
        return f"redis://127.0.0.1:{self.redis_port}/0"

    def __repr_args__(self) -> Any:  # SecretStr already masks its value; say plainly that one is set
        for name, value in super().__repr_args__():
            yield name, ("<set>" if isinstance(value, SecretStr) else value)


def env_name(field: str) -> str:
    """The environment variable of a field (``REDIS_URL`` for the Redis URL)."""
    return "REDIS_URL" if field == REDIS_URL_FIELD else f"{ENV_PREFIX}{field.upper()}"


# Panel titles that capitalising the group's name would misspell.
GROUP_TITLES = {"lora": "LoRA", "vllm server": "vLLM server", "ops": "Ops (logging, health, metrics)"}


def field_group(cls: type[BaseSettings], field: str) -> str:
    """The component a field belongs to (``json_schema_extra={"group": ...}`` on the field): metadata
    only, so the attribute and its environment name stay flat (docs/design/settings.md)."""
    extra = cls.model_fields[field].json_schema_extra
    group = extra.get("group") if isinstance(extra, dict) else None
    return str(group) if group else "general"


def group_title(group: str) -> str:
    """A group as a heading: its `--help` panel, its section in `fulmen config`."""
    return GROUP_TITLES.get(group, group[:1].upper() + group[1:])


def with_default(owner: type[BaseSettings], field: str, default: Any) -> Any:
    """``owner``'s field with another default, for a subclass that only changes the default (the
    description and the bounds stay written once, in ``owner``)."""
    info: FieldInfo = copy(owner.model_fields[field])
    info.default = default
    return info
