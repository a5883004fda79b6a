"""A model version written as a standard Hugging Face folder: the base's config, tokenizer and generation
config, the weights as safetensors (sharded by save_pretrained's rule above `max_shard_size`), a model
card (README.md); a LoRA version also as a PEFT adapter folder (``adapter/``) beside the merged weights.

Which version is exported, and from where: `fulmen_algorithm.report`. The card's content: `ModelCard`.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulmen import progress
from fulmen.records import TrainStep
from fulmen.versions.lora import peft_adapter_config
from fulmen_algorithm.pass_at_k import score_columns

if TYPE_CHECKING:
    import torch

# save_pretrained's default: a folder of a model up to this size is one model.safetensors.
MAX_SHARD_SIZE = "5GB"
ADAPTER_DIR = "adapter"  # the PEFT adapter folder of a LoRA version, inside the exported folder
VERSION_FILE = "fulmen_version.json"  # which model version the folder holds
CARD_FILE = "README.md"
# The base folder's files that the export replaces rather than copies.
NOT_COPIED = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.safetensors.index.json", "*.bin.index.json",
              CARD_FILE, VERSION_FILE, ADAPTER_DIR)
CARD_STEP_ROWS = 20  # the card's reward table: at most this many steps, evenly spread over the run


@dataclass
class ModelCard:
    """What the model card says about the run that made a version."""

    base_model: str
    settings: Mapping[str, Any] = field(default_factory=dict)  # the algorithm's (and trainer's) settings
    steps: Sequence[TrainStep] = ()
    validations: Sequence[Mapping[str, Any]] = ()
    curve: Path | None = None  # the reward curve's PNG, if written
    role: str = "model"  # what the folder is to the run: its final model, its best validated one


def write_hf_folder(full: Mapping[str, torch.Tensor], base_model_dir: Path, out: Path, version: str,
                    card: ModelCard | None = None, lora: tuple[Mapping[str, torch.Tensor], Mapping[str, Any]] | None = None,
                    max_shard_size: int | str = MAX_SHARD_SIZE) -> Path:
    """``out`` = the base folder's config and tokenizer files, ``full`` as safetensors shards, a
    generation_config.json, the model card, and for a LoRA version (``lora`` = the adapter's tensors
    and its ``lora`` description) ``adapter/``. Written beside, then renamed over any ``out``."""
    tmp = out.parent / f".{out.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base_model_dir, tmp, ignore=shutil.ignore_patterns(*NOT_COPIED))
    write_weights(full, tmp, max_shard_size)
    if not (tmp / "generation_config.json").exists():
        _write_generation_config(tmp)
    if lora is not None:
        write_adapter(lora[0], lora[1], base_model_dir, tmp / ADAPTER_DIR)
    (tmp / VERSION_FILE).write_text(json.dumps({"model_version": version}))
    (tmp / CARD_FILE).write_text(render_card(card or ModelCard(str(base_model_dir)), version, lora))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def write_weights(full: Mapping[str, torch.Tensor], folder: Path, max_shard_size: int | str = MAX_SHARD_SIZE) -> None:
    """``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` and their index, split
    as ``save_pretrained`` splits them (huggingface_hub's `split_torch_state_dict_into_shards`)."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file

    state = _unshared(full)
    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size)
    shards = split.filename_to_tensors.items()
    with progress.bar("write model (shards)", len(shards)) as bar:
        for filename, names in bar.each(shards):
            save_file({n: state[n] for n in names}, str(folder / filename), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True))


def _unshared(full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors, none sharing storage with another (safetensors refuses shared storage)."""
    seen: set[int] = set()
    state = {}
    for name, tensor in full.items():
        tensor = tensor.detach().contiguous()
        if tensor.numel() and tensor.untyped_storage().data_ptr() in seen:
            tensor = tensor.clone()
        if tensor.numel():
            seen.add(tensor.untyped_storage().data_ptr())
        state[name] = tensor
    return state


def _write_generation_config(folder: Path) -> None:
    """A base without generation_config.json: the one transformers derives from its config."""
    from transformers import AutoConfig, GenerationConfig

    GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder)).save_pretrained(folder)


def write_adapter(adapter: Mapping[str, torch.Tensor], lora: Mapping[str, Any], base_model_dir: Path,
                  folder: Path) -> Path:
    """The adapter as PEFT writes one (adapter_config.json + adapter_model.safetensors, PEFT's tensor
    names, which published LoRA versions already use)."""
    from safetensors.torch import save_file

    config = peft_adapter_config(adapter, lora, str(base_model_dir))
    folder.mkdir(parents=True, exist_ok=True)
    save_file(_unshared(adapter), str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


def render_card(card: ModelCard, version: str,
                lora: tuple[Mapping[str, Any], Mapping[str, Any]] | None = None) -> str:
    """The model card: base model, version, algorithm and settings, reward per step, validations."""
    algorithm = card.settings.get("algorithm", "grpo")
    lines = ["---", "library_name: transformers", "pipeline_tag: text-generation",
             f"tags: [fulmen, reinforcement-learning, {algorithm}]", "---", "",
             f"# {Path(card.base_model).name} trained with Fulmen (model version {version})", "",
             f"- **Base model:** `{card.base_model}`",
             f"- **Model version:** {version} (the run's {card.role})",
             f"- **Algorithm:** {algorithm}",
             f"- **Trainer steps recorded:** {len(card.steps)}"]
    if lora is not None:
        lines.append(f"- **LoRA:** rank {lora[1].get('r')}, alpha {lora[1].get('alpha')}; the adapter alone is in "
                     f"`{ADAPTER_DIR}/` (`PeftModel.from_pretrained(base, \"{ADAPTER_DIR}\")`), this folder holds "
                     "the merged model")
    lines += ["", "Load it with `AutoModelForCausalLM.from_pretrained(\"<this folder>\")`.", ""]
    lines += _settings_table(card.settings) + _steps_table(card) + _validation_table(card.validations)
    return "\n".join(lines) + "\n"


def _settings_table(settings: Mapping[str, Any]) -> list[str]:
    if not settings:
        return []
    rows = [f"| `{name}` | `{value}` |" for name, value in sorted(settings.items())]
    return ["## Settings", "", "| setting | value |", "|---|---|", *rows, ""]


def _steps_table(card: ModelCard) -> list[str]:
    lines = ["## Reward per step", ""]
    if card.curve is not None:
        lines += [f"Reward curve: `{card.curve}`", ""]
    if not card.steps:
        return [*lines, "No trainer step recorded.", ""]
    every = max(1, -(-len(card.steps) // CARD_STEP_ROWS))
    shown = [*card.steps[::every], *([card.steps[-1]] if (len(card.steps) - 1) % every else [])]
    rows = [f"| {s.step} | {s.model_version} | {_number(s.reward_mean)} | {_number(s.loss)} |" for s in shown]
    return [*lines, "| step | model version | reward (mean) | loss |", "|---|---|---|---|", *rows, ""]


def _validation_table(validations: Sequence[Mapping[str, Any]]) -> list[str]:
    if not validations:
        return ["## Validation", "", "No validation pass recorded.", ""]
    scores = score_columns(validations)  # pass@k and maj@k columns, when a pass sampled k > 1 answers per task
    rows = []
    for v in validations:
        served = ", ".join(f"{name} ×{n}" for name, n in (v.get("served_by") or {}).items())
        extra = "".join(f" {_number(v.get(k))} |" for k in scores)
        rows.append(f"| {v.get('label')} | {v.get('step')} | {served} | {_number(v.get('accuracy'))} | "
                    f"{_number(v.get('mean_reward'))} | {v.get('tasks', '')} |{extra}")
    header = ["| pass | step | served by (model version × tasks) | accuracy | mean reward | tasks |"
              + "".join(f" {k} |" for k in scores), "|---|---|---|---|---|---|" + "---|" * len(scores)]
    return ["## Validation", "", *header, *rows, ""]


def _number(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) and not isinstance(value, bool) else "-"
