"""The run's model folders as standard Hugging Face folders: they load with transformers (sharded or
not) and compute what the published weights compute; a LoRA version's adapter loads with PEFT; the
model card says how the model was trained."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fulmen.demo.tiny_model import build_tiny_model, load_tiny_model
from fulmen.settings import AlgorithmSettings
from fulmen.store import RedisStore
from fulmen.versions.lora import LORA_FORMAT, lora_description
from fulmen.versions.model_version import publish_model_version
from fulmen_algorithm.export import ADAPTER_DIR, ModelCard, write_hf_folder
from fulmen_algorithm.report import card_settings, export_final_model, export_version

PROMPT = torch.tensor([[1, 5, 9, 12, 7, 30]])


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(PROMPT).logits


def _card(tmp_path: Path, base: Path) -> ModelCard:
    settings = AlgorithmSettings(model_dir=base, n_samples=4, total_steps=2, data_dir=tmp_path)
    validations = [{"label": "v1", "step": 1, "accuracy": 0.5, "mean_reward": 0.25, "tasks": 8,
                    "served_by": {"v1": 8}}]
    return ModelCard(base_model=str(base), settings=card_settings(settings), validations=validations)


async def test_a_full_version_exports_a_folder_transformers_loads(real_store: RedisStore, tmp_path: Path) -> None:
    """config, model.safetensors, tokenizer, generation_config.json and README.md; the loaded model's
    logits are the published version's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = build_tiny_model(tmp_path / "tiny")
    trained, _ = load_tiny_model(build_tiny_model(tmp_path / "m1", seed=1))
    await publish_model_version(real_store, trained.state_dict(), model="tiny")
    out = await export_version(real_store, "v1", base, tmp_path / "final-model", _card(tmp_path, base))
    assert out is not None
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md"} <= names
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(_logits(loaded), _logits(trained))
    assert AutoTokenizer.from_pretrained(out)("1+1").input_ids
    card = (out / "README.md").read_text()
    print(card)
    for expected in (f"`{base}`", "model version v1", "**Algorithm:** grpo", "| `n_samples` | `4` |",
                     "| v1 | 1 | v1 ×8 | 0.5000 | 0.2500 | 8 |", "library_name: transformers"):
        assert expected in card, expected
    assert json.loads((out / "fulmen_version.json").read_text()) == {"model_version": "v1"}


def test_large_weights_are_sharded_as_save_pretrained_shards(tmp_path: Path) -> None:
    """Above max_shard_size: model-0000i-of-0000n.safetensors and their index; the folder still loads
    and computes the same; a base without generation_config.json gets one."""
    from transformers import AutoModelForCausalLM

    base = build_tiny_model(tmp_path / "tiny")
    (base / "generation_config.json").unlink()
    model, _ = load_tiny_model(base)
    out = write_hf_folder(model.state_dict(), base, tmp_path / "sharded", "v3", max_shard_size="100KB")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    print(shards)
    assert len(shards) > 1 and set(index["weight_map"].values()) == set(shards)
    assert not (out / "model.safetensors").exists() and (out / "generation_config.json").exists()
    assert torch.equal(_logits(AutoModelForCausalLM.from_pretrained(out)), _logits(model))


async def test_a_lora_version_exports_the_merged_model_and_its_peft_adapter(
    real_store: RedisStore, tmp_path: Path
) -> None:
    """The folder is the merged model (transformers), and adapter/ is a PEFT adapter folder: both
    compute what the trained PEFT model computes."""
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = build_tiny_model(tmp_path / "tiny")
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    torch.manual_seed(0)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.5)  # a trained adapter: B is no longer zero
    adapter = {n: t.detach().clone() for n, t in get_peft_model_state_dict(peft_model).items()}
    await publish_model_version(real_store, adapter, model="tiny",
                                weights_format={"format": LORA_FORMAT, "lora": lora_description(4, 8.0)})
    out = await export_final_model(real_store, base, tmp_path / "final-model")
    assert out is not None
    expected = _logits(peft_model)
    assert not torch.allclose(expected, _logits(AutoModelForCausalLM.from_pretrained(base)))
    assert torch.allclose(_logits(AutoModelForCausalLM.from_pretrained(out)), expected, atol=1e-5)
    assert {p.name for p in (out / ADAPTER_DIR).iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out / ADAPTER_DIR)
    assert torch.allclose(_logits(loaded), expected, atol=1e-5)
    assert "**LoRA:** rank 4, alpha 8.0" in (out / "README.md").read_text()


def test_the_card_lists_reward_per_step(tmp_path: Path) -> None:
    """At most CARD_STEP_ROWS steps in the reward table, the last step always among them."""
    from fulmen.records import TrainStep
    from fulmen_algorithm.export import CARD_STEP_ROWS, render_card

    steps = [TrainStep(step=i, model_version=f"v{i}", reward_mean=i / 100, loss=0.1, samples=8, time=0.0)
             for i in range(1, 101)]
    card = render_card(ModelCard("base", steps=steps, curve=tmp_path / "reward-curve.png"), "v100")
    rows = [line for line in card.splitlines() if line.startswith("| ") and "| v" in line]
    assert len(rows) <= CARD_STEP_ROWS + 1 and rows[-1].startswith("| 100 | v100 | 1.0000 |")
    assert f"Reward curve: `{tmp_path / 'reward-curve.png'}`" in card


def test_card_settings_hold_no_secret(tmp_path: Path) -> None:
    """The card's settings: the algorithm's own and the trainer's objective, never a secret or Redis URL."""
    settings = AlgorithmSettings(model_dir=tmp_path, redis_url="redis://:hunter2@localhost:1/0", data_dir=tmp_path)
    shown = card_settings(settings)
    assert shown["algorithm"] == "grpo" and "n_samples" in shown and "redis_url" not in shown
    assert "hunter2" not in json.dumps(shown, default=str)
