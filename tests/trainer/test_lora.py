"""LoRA through PEFT: only the adapter trains, a model version is the adapter alone, and the proxy's
torch engine serves base + adapter with the trainer's own greedy choices."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from fulmen import keys as k
from fulmen.demo.tiny_model import build_tiny_model
from fulmen.errors import InvalidInput
from fulmen.records import Sample
from fulmen.settings import TrainerSettings, load_settings
from fulmen.store import RedisStore
from fulmen.versions.lora import merge_lora
from fulmen.versions.model_version import fetch_model_version, llm_resource
from fulmen_llm_proxy.backends.torch.engine import TorchEngine
from fulmen_llm_proxy.backends.torch.request import SamplingParams
from fulmen_trainer.trainer import Trainer

RANK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _group(name: str, rewards: list[float]) -> list[Sample]:
    out = []
    for i, reward in enumerate(rewards):
        prompt, response = [1, 5 + i, 9, 12], [20 + int(reward), 21, 2]
        out.append(Sample(f"{name}{i}.1/t0", "triplet", f"{name}{i}", f"{name}{i}.1", name, 0, prompt, response,
                          [-1.5, -2.0, -0.5], [1, 1, 1], reward, reward, "base", mode="train",
                          group_size=len(rewards)))
    return out


async def _trained(store: RedisStore, tiny: Path, tmp_path: Path, **knobs) -> Trainer:
    await store.samples.ensure_samples_group(k.TRAINERS_GROUP)
    for sample in _group("a", [1.0, 0.0, 1.0, 0.0]) + _group("b", [0.0, 1.0, 1.0, 0.0]):
        await store.redis.xadd(store.keys.samples, {"m": sample.to_wire()})
    settings = load_settings(TrainerSettings, model_dir=tiny, groups_per_step=2, checkpoint_dir=tmp_path / "ck",
                             metrics_file=tmp_path / "m.jsonl", max_steps=1, experiment=store.experiment,
                             learning_rate=0.05, lora_rank=RANK, lora_alpha=8, **knobs)
    trainer = Trainer(store, settings)
    await trainer.setup()
    return trainer


def _greedy(model: torch.nn.Module, prompt: list[int], steps: int = 10) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


async def test_only_the_adapter_trains_and_the_version_is_the_adapter(real_store: RedisStore, tiny: Path,
                                                                     tmp_path: Path) -> None:
    trainer = await _trained(real_store, tiny, tmp_path, kl_coef=0.1)
    assert trainer.policy is not None and trainer.policy.reference is None  # KL: the base, adapter off
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    await asyncio.wait_for(trainer.run(asyncio.Event()), 60)
    changed = {n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    assert changed and all(".lora_B." in n or ".lora_A." in n for n in changed)
    assert all(p.requires_grad == (".lora_" in n) for n, p in trainer.model.named_parameters())
    latest = await real_store.resources.get_latest_resources()
    assert latest is not None
    weights = llm_resource(latest)["weights"]
    assert weights["format"] == "lora" and weights["lora"] == {"r": RANK, "alpha": 8, "scaling": 2.0}
    published = await fetch_model_version(real_store, "v1")
    assert published and all(".lora_A.weight" in n or ".lora_B.weight" in n for n in published)
    full_bytes = sum(p.numel() * 4 for p in trainer.model.get_base_model().parameters())
    assert weights["bytes"] < full_bytes / 3  # the adapter alone, not the model


async def test_the_proxy_serves_base_plus_adapter_with_the_trainers_greedy_ids(real_store: RedisStore, tiny: Path,
                                                                              tmp_path: Path) -> None:
    trainer = await _trained(real_store, tiny, tmp_path)
    await asyncio.wait_for(trainer.run(asyncio.Event()), 60)
    latest = await real_store.resources.get_latest_resources()
    assert latest is not None
    weights = llm_resource(latest)["weights"]
    adapter = await fetch_model_version(real_store, "v1", resource=llm_resource(latest))
    engine = TorchEngine(tiny)
    prompt = [1, 5, 9, 12, 7]
    base_ids = (await engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0))).token_ids
    await engine.load_weights(adapter, "v1", lora=weights["lora"])
    served = await engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0))
    trainer.model.eval()
    assert served.model_version == "v1"
    assert served.token_ids == _greedy(trainer.model, prompt)
    assert served.token_ids != base_ids  # the adapter changed what the model says
    # the next version merges onto the base again, not onto v1's weights
    zero = {n: torch.zeros_like(t) for n, t in adapter.items()}
    await engine.load_weights(zero, "v2", lora=weights["lora"])
    assert (await engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0))).token_ids == base_ids
    await engine.close()


async def test_the_final_model_of_a_lora_run_is_the_merged_model(real_store: RedisStore, tiny: Path,
                                                                   tmp_path: Path) -> None:
    """The run's final-model folder loads as a plain model that says what the trained adapter says."""
    from transformers import AutoModelForCausalLM

    from fulmen_algorithm.report import export_final_model

    trainer = await _trained(real_store, tiny, tmp_path)
    await asyncio.wait_for(trainer.run(asyncio.Event()), 60)
    out = await export_final_model(real_store, tiny, tmp_path / "final-model")
    assert out is not None and (out / "fulmen_version.json").read_text() == '{"model_version": "v1"}'
    final = AutoModelForCausalLM.from_pretrained(out).eval()
    trainer.model.eval()
    prompt = [1, 5, 9, 12, 7]
    assert _greedy(final, prompt) == _greedy(trainer.model, prompt)
    assert _greedy(final, prompt) != _greedy(AutoModelForCausalLM.from_pretrained(tiny).eval(), prompt)


async def test_a_restarted_lora_trainer_resumes_its_adapter_and_optimizer(real_store: RedisStore, tiny: Path,
                                                                         tmp_path: Path) -> None:
    trainer = await _trained(real_store, tiny, tmp_path)
    await asyncio.wait_for(trainer.run(asyncio.Event()), 60)
    adapter = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    again = Trainer(real_store, trainer.s)
    await again.setup()
    assert again.step == 1 and str(again.version) == "v1"
    resumed = {n: p.detach() for n, p in again.model.named_parameters() if p.requires_grad}
    assert resumed.keys() == adapter.keys() and all(torch.equal(resumed[n], adapter[n]) for n in adapter)
    assert again.optimizer is not None and len(again.optimizer.state) == len(adapter)


def test_a_malformed_adapter_is_refused_with_the_reason() -> None:
    base = {"model.layers.0.q.weight": torch.zeros(4, 3)}
    a, b = "base_model.model.model.layers.0.q.lora_A.weight", "base_model.model.model.layers.0.q.lora_B.weight"
    lora = {"scaling": 1.0}
    with pytest.raises(InvalidInput, match="not 'base_model"):
        merge_lora({a: torch.zeros(2, 3)}, lora, base.__getitem__)
    with pytest.raises(InvalidInput, match="do not fit"):
        merge_lora({a: torch.zeros(2, 3), b: torch.zeros(5, 2)}, lora, base.__getitem__)
    with pytest.raises(InvalidInput, match="neither"):
        merge_lora({"model.layers.0.q.weight": torch.zeros(4, 3)}, lora, base.__getitem__)
    with pytest.raises(InvalidInput, match="finite scaling"):
        merge_lora({a: torch.zeros(2, 3), b: torch.zeros(4, 2)}, {}, base.__getitem__)
    merged = merge_lora({a: torch.ones(2, 3), b: torch.ones(4, 2)}, {"scaling": 0.5}, base.__getitem__)
    assert torch.equal(merged["model.layers.0.q.weight"], torch.ones(4, 3))


async def test_a_lora_version_runs_beside_the_base_weights_like_the_merged_model(tiny: Path) -> None:
    """While the proxy holds the base, a LoRA version changes no weight (only small tensors swap) and
    serves what the merged model serves; after a full version it is merged instead."""
    from safetensors.torch import load_file

    from fulmen.versions.lora import lora_description

    base = load_file(str(tiny / "model.safetensors"))
    g = torch.Generator().manual_seed(7)
    adapter = {}
    for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        out_f, in_f = base[name + ".weight"].shape
        adapter[f"base_model.model.{name}.lora_A.weight"] = torch.randn(RANK, in_f, generator=g)
        adapter[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_f, RANK, generator=g)
    lora = lora_description(RANK, 8.0)
    prompt, params = [1, 5, 9, 12, 7], SamplingParams(max_tokens=10, temperature=0)
    engine = TorchEngine(tiny)
    before = {n: t.clone() for n, t in engine.model.state_dict().items()}
    await engine.load_weights(adapter, "v1", lora=lora)
    assert all(torch.equal(t, before[n]) for n, t in engine.model.state_dict().items())
    applied = await engine.generate(prompt, params)
    merged = TorchEngine(tiny)
    await merged.load_weights({**base, **merge_lora(adapter, lora, base.__getitem__)}, "m")
    want = await merged.generate(prompt, params)
    assert applied.token_ids == want.token_ids and applied.model_version == "v1"
    assert applied.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    assert applied.token_ids != (await TorchEngine(tiny).generate(prompt, params)).token_ids
    # a full version, then a LoRA one: merged onto the base weights (the model no longer holds them)
    await engine.load_weights(base, "full")
    await engine.load_weights(adapter, "v2", lora=lora)
    assert (await engine.generate(prompt, params)).token_ids == want.token_ids
    assert not torch.equal(engine.model.state_dict()["model.layers.0.self_attn.q_proj.weight"],
                           before["model.layers.0.self_attn.q_proj.weight"])
    for e in (engine, merged):
        await e.close()
