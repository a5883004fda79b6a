"""The end of a run: the reward curve as a PNG, a JSON summary, and the final model as a folder.

The curve comes from `fulmen.telemetry.steps.read_curve`; the folder is a standard Hugging Face one with
a model card (`fulmen_algorithm.export`). Which version is final: docs/design/algorithm.md.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

from fulmen.errors import FulmenError
from fulmen.records import TrainStep
from fulmen.settings import AlgorithmSettings
from fulmen.store import RedisStore
from fulmen.versions.folder import full_weights
from fulmen.versions.lora import LORA_FORMAT
from fulmen.versions.model_version import (
    BASE_VERSION,
    POLICY_RESOURCES_ID,
    ModelVersion,
    fetch_full_version,
    find_weights,
)
from fulmen.versions.retention import stored_versions
from fulmen_algorithm.export import ModelCard, write_hf_folder
from fulmen_algorithm.pass_at_k import score_columns

log = logging.getLogger(__name__)

CURVE_SIZE_IN = (7, 4)
CURVE_DPI = 120


def plot_curve(path: Path, steps: Sequence[TrainStep], validations: list[dict[str, Any]]) -> Path:
    """The train reward per step and the validation accuracy of every pass, as a PNG."""
    matplotlib.use("Agg")  # files only: no display on a server
    import matplotlib.pyplot as plt  # after use(): pyplot picks its backend when first imported

    fig, ax = plt.subplots(figsize=CURVE_SIZE_IN)
    if steps:
        ax.plot([s.step for s in steps], [s.reward_mean if s.reward_mean is not None else 0.0 for s in steps],
                label="train reward (mean per step)", color="tab:blue", alpha=0.8)
    sampled = any("samples" in v for v in validations)
    for key, label, color in (("accuracy", "validation accuracy (pass@1)" if sampled else "validation accuracy (greedy)",
                               "tab:orange"), *_score_lines(validations)):
        points = [(v["step"], v[key]) for v in validations if isinstance(v.get("step"), int) and key in v]
        if points:
            ax.plot(*zip(*points, strict=True), "o-", label=label, color=color, markersize=3)
    ax.set_xlabel("trainer step (model version)")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # nothing plotted yet (a run stopped at step 0): no legend
        ax.legend(loc="lower right")
    ax.set_title("Fulmen: reward curve")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=CURVE_DPI)
    plt.close(fig)
    return path


def _score_lines(validations: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """(key, label, colour) of the curve's k-sample lines: the largest pass@k and maj@k recorded."""
    columns = score_columns(validations)
    chosen = [k for family in ("pass@", "maj@") for k in [c for c in columns if c.startswith(family)][-1:]]
    colors = {"pass@": "tab:green", "maj@": "tab:red"}
    return [(k, f"validation {k}", colors[k[:k.index("@") + 1]]) for k in chosen]


async def export_final_model(store: RedisStore, base_model_dir: Path, out: Path,
                             resources_id: str = POLICY_RESOURCES_ID, card: ModelCard | None = None) -> Path | None:
    """The latest published weights as a Hugging Face folder (config and tokenizer from the base, a
    model card). Those weights lost (retention, a Redis that lost them): a warning, and the newest
    version whose weights are still stored instead, or None if none is."""
    try:
        update = await store.resources.get_resources(resources_id)
    except Exception:
        return None
    llm = update.resources.get("llm") or {}
    version = ModelVersion.of(update).name
    if version == BASE_VERSION.name:
        return None
    try:
        state = (await fetch_full_version(store, version, resource=llm)).state  # a delta applied onto its base
        return await _write(state, llm.get("weights") or {}, base_model_dir, out, version, card)
    except FulmenError as e:
        log.warning("the final version %s cannot be exported (%s): the final model is the newest version "
                    "still stored", version, e)
        return await export_latest_stored(store, base_model_dir, out, skip=version, card=card)


async def _write(state: Any, weights: Any, base_model_dir: Path, out: Path, version: str,
                 card: ModelCard | None) -> Path:
    """The folder of one version's weights: merged onto the base (and the adapter too) for LoRA."""
    full = await asyncio.to_thread(full_weights, state, weights, base_model_dir)
    lora = (state, weights.get("lora") or {}) if weights.get("format") == LORA_FORMAT else None
    return await asyncio.to_thread(write_hf_folder, full, base_model_dir, out, version, card, lora)


async def model_card(store: RedisStore, settings: AlgorithmSettings, role: str, curve: Path | None = None) -> ModelCard:
    """The card of a folder this run exports: its settings, steps and validation passes so far."""
    from fulmen.telemetry.steps import read_curve
    from fulmen_algorithm.validation import recorded

    assert settings.model_dir is not None
    return ModelCard(base_model=str(settings.model_dir), settings=card_settings(settings),
                     steps=await read_curve(store.redis, store.keys), validations=await recorded(store),
                     curve=curve if curve is not None and curve.exists() else None, role=role)


def card_settings(settings: AlgorithmSettings) -> dict[str, Any]:
    """The settings a model card lists: the algorithm's own (no secret, no connection), and the
    trainer's as the environment the services share sets them (its objective, rate and LoRA at least)."""
    from pydantic import SecretStr

    from fulmen.settings import CommonSettings, TrainerSettings, load_settings

    shown = {name: value for name, value in settings.model_dump().items()
             if name not in CommonSettings.model_fields and not isinstance(value, SecretStr) and value is not None}
    try:
        trainer = load_settings(TrainerSettings, experiment=settings.experiment)
    except FulmenError:
        return shown
    always = {"algorithm", "learning_rate", "lora_rank", "lora_alpha"}
    for name in sorted(always | trainer.model_fields_set):
        value = getattr(trainer, name)
        if name not in CommonSettings.model_fields and not isinstance(value, SecretStr) and value is not None:
            shown.setdefault(name, value)
    return {name: str(value) if isinstance(value, Path) else value for name, value in shown.items()}


async def export_latest_stored(store: RedisStore, base_model_dir: Path, out: Path, skip: str = "",
                               card: ModelCard | None = None) -> Path | None:
    """The newest stored version but ``skip`` that exports (`export_version`); None, with a warning,
    when none does."""
    for version in reversed(await stored_versions(store)):
        if version != skip and (folder := await export_version(store, version, base_model_dir, out, card)) is not None:
            return folder
    log.warning("no model version's weights are stored any more: the run has no final model folder")
    return None


def served_version(result: dict[str, Any]) -> str | None:
    """The model version that answered most of a validation pass's tasks (None: none recorded)."""
    served = {v: n for v, n in (result.get("served_by") or {}).items() if v != "none" and isinstance(n, int)}
    return max(served, key=lambda v: served[v]) if served else None


def best_pass(passes: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The pass with the highest accuracy whose serving version is known; the later one on a tie."""
    best = None
    for result in passes:
        if served_version(result) is None or not isinstance(result.get("accuracy"), int | float):
            continue
        if best is None or result["accuracy"] >= best["accuracy"]:
            best = result
    return best


async def export_version(store: RedisStore, version: str, base_model_dir: Path, out: Path,
                         card: ModelCard | None = None) -> Path | None:
    """One published version as a Hugging Face folder with its model card; None when its weights are
    no longer stored (retention keeps the newest few) or were never published."""
    entry = await find_weights(store, version)
    if version == BASE_VERSION.name or entry is None:
        return None
    try:
        state = (await fetch_full_version(store, version, resource={"weights": entry})).state
        return await _write(state, entry, base_model_dir, out, version, card)
    except FulmenError:
        return None
