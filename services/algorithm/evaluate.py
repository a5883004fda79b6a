"""`fulmen eval`: a checkpoint published as a model version, served, and validated like the run's passes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fulmen.errors import FulmenError
from fulmen.settings import EvalSettings
from fulmen.store import RedisStore
from fulmen.versions.model_version import (
    POLICY_RESOURCES_ID,
    SERVE_TIMEOUT_S,
    ModelVersion,
    publish_model_version,
    wait_until_served,
)
from fulmen_algorithm.dataset import Task
from fulmen_algorithm.scheduler import recoverable_rollout_config
from fulmen_algorithm.validation import PassSampling, validate

WEIGHTS_FILE = "model.safetensors"


class NotServed(FulmenError):
    """No live proxy loaded the published version in time."""


def weights_of(checkpoint: Path) -> Path | None:
    """The checkpoint's weights file, or None when the folder is no Hugging Face model."""
    weights = checkpoint / WEIGHTS_FILE
    return weights if weights.exists() else None


async def evaluate_checkpoint(store: RedisStore, checkpoint: Path, tasks: list[Task], settings: EvalSettings) -> dict[str, Any]:
    """Publish the checkpoint's weights as a new model version of the policy, wait until it is served,
    and run a validation pass on it; the pass's result."""
    from safetensors.torch import load_file

    policy = await store.resources.get_resources(POLICY_RESOURCES_ID)
    model = (policy.resources.get("llm") or {}).get("model", checkpoint.name)
    update = await publish_model_version(store, load_file(str(checkpoint / WEIGHTS_FILE)), model=model)
    version = ModelVersion.of(update)
    if not await wait_until_served(store, version):
        raise NotServed(f"no proxy loaded {version.name} within {SERVE_TIMEOUT_S:.0f} s; is `fulmen llm-proxy` running?")
    config = recoverable_rollout_config(settings.rollout_unresponsive_s, settings.rollout_max_attempts)
    return await validate(store, tasks, label=f"eval-{version.name}", timeout_s=settings.val_timeout_s, config=config,
                          sampling=PassSampling.of(settings))
