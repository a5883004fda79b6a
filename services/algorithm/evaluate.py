"""`fulmen eval`: a checkpoint published as a model version, served, and validated like the run's passes."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from fulmen.errors import FulmenError
from fulmen.settings import EvalSettings
from fulmen.store import RedisStore
from fulmen_algorithm.dataset import Task
from fulmen_algorithm.scheduler import recoverable_rollout_config
from fulmen_algorithm.validation import validate

# The resources entry the trainer publishes to and the proxies serve from.
POLICY_RESOURCES_ID = "policy"
WEIGHTS_FILE = "model.safetensors"
# How long the proxies may take to load a published version, and how often to look.
SERVE_TIMEOUT_S = 60.0
SERVE_POLL_S = 0.1


class NotServed(FulmenError):
    """No live proxy loaded the published version in time."""


def weights_of(checkpoint: Path) -> Path | None:
    """The checkpoint's weights file, or None when the folder is no Hugging Face model."""
    weights = checkpoint / WEIGHTS_FILE
    return weights if weights.exists() else None


async def wait_until_served(store: RedisStore, version: str, timeout_s: float = SERVE_TIMEOUT_S) -> None:
    """Until every live proxy serves ``version``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        proxies = await store.query_proxies()
        if proxies and all(p.model_version == version for p in proxies):
            return
        await asyncio.sleep(SERVE_POLL_S)
    raise NotServed(f"no proxy loaded {version} within {timeout_s:.0f} s; is `fulmen llm-proxy` running?")


async def evaluate_checkpoint(store: RedisStore, checkpoint: Path, tasks: list[Task], settings: EvalSettings) -> dict[str, Any]:
    """Publish the checkpoint's weights as a new model version of the policy, wait until it is served,
    and run a validation pass on it; the pass's result."""
    from safetensors.torch import load_file

    from fulmen.model_versions import publish_model_version

    policy = await store.get_resources(POLICY_RESOURCES_ID)
    model = (policy.resources.get("llm") or {}).get("model", checkpoint.name)
    update = await publish_model_version(store, load_file(str(checkpoint / WEIGHTS_FILE)), model=model)
    version = update.resources["llm"]["model_version"]
    await wait_until_served(store, version)
    config = recoverable_rollout_config(settings.rollout_unresponsive_s, settings.rollout_max_attempts)
    return await validate(store, tasks, label=f"eval-{version}", timeout_s=settings.val_timeout_s, config=config)
