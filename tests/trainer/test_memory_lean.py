"""The trainer's memory-lean paths compute what the plain ones do: chunked log-probabilities and
entropy, micro-batches cut by a token budget, gradient checkpointing, device and precision settings."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.devices import resolve_device
from fulmen.errors import InvalidInput
from fulmen.records import Sample
from fulmen.settings import TrainerSettings, load_settings
from fulmen_trainer.batch import make_batch
from fulmen_trainer.distributed.gradients import flat_gradient
from fulmen_trainer.logprobs import token_logprobs
from fulmen_trainer.objectives import entropy_from_logits
from fulmen_trainer.plan import StepPlan
from fulmen_trainer.policy import load_policy
from fulmen_trainer.trainer import Trainer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _samples(count: int = 6) -> list[Sample]:
    """Sequences of different lengths (so budgets cut them differently), each with trained tokens."""
    out = []
    for i in range(count):
        prompt = [1, *range(5, 5 + 2 + 3 * i)]
        response = [20 + i, 21, 22 + i % 3, 2][: 2 + i % 3]
        mask = [1] * len(response)
        out.append(Sample(f"r{i}.1/t0", "triplet", f"r{i}", f"r{i}.1", f"g{i // 3}", 0, prompt, response,
                          [-1.0] * len(response), mask, float(i % 2), float(i % 2), "base", group_size=3))
    return out


def _plan(samples: list[Sample]) -> StepPlan:
    advantages = torch.tensor([(-1.0) ** i * (1 + i / 10) for i in range(len(samples))])
    return StepPlan(samples, [s.reward or 0.0 for s in samples], advantages, [s.group_key for s in samples], [])


def _full_logprobs(model: torch.nn.Module, batch) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits[:, :-1].float()
    logp = torch.log_softmax(logits, -1).gather(-1, batch.input_ids[:, 1:, None]).squeeze(-1)
    return logp * batch.mask, entropy_from_logits(logits) * batch.mask


@pytest.mark.parametrize("chunk", [1, 3, 1024])
def test_chunked_logprobs_and_entropy_equal_the_full_logits_ones(tiny: Path, chunk: int) -> None:
    """Values and gradients: the output layer on chunks of trained positions equals the log-softmax of
    the full logits (atol 1e-5)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    batch = make_batch(_samples(), pad_id=0, rewards=[0.0] * 6)
    logp, entropy = token_logprobs(model, batch, chunk_tokens=chunk, entropy=True)
    assert entropy is not None
    (logp.sum() + entropy.sum()).backward()
    lean_grad = flat_gradient(model)
    model.zero_grad(set_to_none=True)
    want_logp, want_entropy = _full_logprobs(model, batch)
    (want_logp.sum() + want_entropy.sum()).backward()
    assert torch.allclose(logp, want_logp, atol=1e-5)
    assert torch.allclose(entropy, want_entropy, atol=1e-5)
    assert bool((logp[batch.mask == 0] == 0).all())  # untrained positions are not computed
    assert torch.allclose(lean_grad, flat_gradient(model), rtol=1e-4, atol=1e-5)  # grads reach ~30


def _gradient(tiny: Path, **knobs) -> torch.Tensor:
    settings = load_settings(TrainerSettings, model_dir=tiny, algorithm="grpo", ent_coef=0.01, **knobs)
    trainer = Trainer(None, settings)  # type: ignore[arg-type]  # no store: one backward pass only
    trainer.policy = load_policy(settings, None)
    trainer.backward(_plan(_samples()))
    return flat_gradient(trainer.model)


def test_a_token_budget_gives_the_same_gradient_whatever_it_cuts(tiny: Path) -> None:
    """The step's loss is a mean over all its trained tokens, however the micro-batches are cut."""
    whole = _gradient(tiny)
    batch = make_batch(_samples(), pad_id=0, rewards=[0.0] * 6)
    for budget in (1, 40, 64):
        assert len(batch.micro_batches(64, budget)) > 1  # the budget does split this batch
        assert torch.allclose(_gradient(tiny, micro_batch_tokens=budget), whole, atol=1e-5), budget
    assert torch.allclose(_gradient(tiny, micro_batch=1), whole, atol=1e-5)


def test_micro_batches_keep_order_and_the_budget() -> None:
    """Padded size (sequences × longest) stays within the budget; a longer sequence is alone."""
    batch = make_batch(_samples(), pad_id=0, rewards=[0.0] * 6)
    lengths = [int(n) for n in batch.attention_mask.sum(-1)]
    for budget in (10, 25, 40):
        ranges = batch.micro_batches(4, budget)
        assert [i for lo, hi in ranges for i in range(lo, hi)] == list(range(6))
        for lo, hi in ranges:
            assert hi - lo <= 4
            assert hi - lo == 1 or max(lengths[lo:hi]) * (hi - lo) <= budget
    assert batch.micro_batches(2) == [(0, 2), (2, 4), (4, 6)]
    trimmed = batch.slice(0, 2).trimmed()
    assert trimmed.input_ids.shape[1] == max(lengths[:2]) < batch.input_ids.shape[1]


def test_gradient_checkpointing_gives_the_same_gradient(tiny: Path) -> None:
    assert torch.allclose(_gradient(tiny, gradient_checkpointing=True), _gradient(tiny), atol=1e-5)


def test_bf16_on_a_cpu_stores_frozen_weights_in_bf16_and_trains_the_adapter_in_fp32(tiny: Path) -> None:
    """LoRA with dtype bfloat16 on a CPU: the base is stored in bf16 and read as fp32 as it computes;
    the adapter (the master weights) is fp32; the first forward equals the fp32 base's to bf16 precision."""
    from transformers import AutoModelForCausalLM

    settings = load_settings(TrainerSettings, model_dir=tiny, dtype="bfloat16", lora_rank=4, device="cpu")
    policy = load_policy(settings, None)
    base = policy.model.get_base_model()
    stored = base.model.layers[0].self_attn.q_proj.base_layer.parametrizations.weight.original
    assert stored.dtype == torch.bfloat16 and not stored.requires_grad
    assert {p.dtype for p in policy.trainable_parameters()} == {torch.float32}
    batch = make_batch(_samples(), pad_id=0, rewards=[0.0] * 6)
    logp, _ = token_logprobs(policy.model, batch)
    fp32 = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    want, _ = _full_logprobs(fp32, batch)
    assert logp.dtype == torch.float32 and torch.allclose(logp, want, atol=0.1)
    assert not torch.allclose(logp, want, atol=1e-6)  # it really is the bf16-rounded base


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_a_version_is_published_in_the_training_dtype_and_exactly_for_catching_up(tiny: Path, lora: bool) -> None:
    """dtype bfloat16: a published version holds bf16 tensors (half the bytes), without the tied
    lm_head's second copy; ``exact`` (what a rank that catches up loads) is the fp32 master weights."""
    knobs = {"lora_rank": 4} if lora else {}
    settings = load_settings(TrainerSettings, model_dir=tiny, dtype="bfloat16", device="cpu", **knobs)
    policy = load_policy(settings, None)
    small, exact = policy.published_state(), policy.published_state(exact=True)
    assert small.keys() == exact.keys() and small
    assert {t.dtype for t in small.values()} == {torch.bfloat16}
    assert {t.dtype for t in exact.values()} == {torch.float32}
    if lora:
        assert all("lora_" in name for name in small)
        trained = dict(policy.model.named_parameters())
        for name, tensor in exact.items():  # the fp32 master weights, bit for bit
            own = next(p for n, p in trained.items() if n.replace(".default", "") == name)
            assert torch.equal(tensor, own.detach())
    else:
        assert "lm_head.weight" in small  # the tiny model's output layer is its own
    fp32 = load_policy(load_settings(TrainerSettings, model_dir=tiny, device="cpu", **knobs), None)
    assert {t.dtype for t in fp32.published_state().values()} == {torch.float32}  # auto follows dtype


def test_a_tied_output_layer_is_published_once(tiny: Path, tmp_path: Path) -> None:
    """lm_head shares the embeddings: the version holds the tensor once and a proxy ties it again."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    tied = tmp_path / "tied"
    shutil.copytree(tiny, tied)
    config = json.loads((tied / "config.json").read_text())
    (tied / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    [weights] = tied.glob("*.safetensors")
    state = load_file(weights)
    del state["lm_head.weight"]  # a tied checkpoint stores the embeddings once
    save_file(state, weights, metadata={"format": "pt"})
    policy = load_policy(load_settings(TrainerSettings, model_dir=tied, device="cpu"), None)
    state = policy.published_state()
    assert "lm_head.weight" not in state and "model.embed_tokens.weight" in state
    served = AutoModelForCausalLM.from_pretrained(tied)
    served.load_state_dict(state, strict=False)
    assert torch.equal(served.lm_head.weight, state["model.embed_tokens.weight"])


def test_device_and_dtype_settings_fail_clearly() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU"):
            resolve_device("cuda:0")
    with pytest.raises(ValueError, match="not a torch device"):
        resolve_device("gpu-please")
    with pytest.raises(InvalidInput, match=r"dtype \(FULMEN_DTYPE\): .*'float32' or 'bfloat16', got 'float16'"):
        load_settings(TrainerSettings, model_dir=Path("."), dtype="float16")  # refused at load, before any model


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (this machine has none)")
def test_on_cuda_bf16_the_step_runs_under_autocast_with_fp32_master_weights(tiny: Path) -> None:
    settings = load_settings(TrainerSettings, model_dir=tiny, device="cuda", dtype="bfloat16")
    trainer = Trainer(None, settings)  # type: ignore[arg-type]
    trainer.policy = load_policy(settings, None)
    assert trainer.policy.autocast_dtype == torch.bfloat16
    assert {p.dtype for p in trainer.policy.trainable_parameters()} == {torch.float32}
    trainer.optimizer = torch.optim.AdamW(trainer.policy.trainable_parameters(), lr=1e-3)
    metrics = trainer.backward(_plan(_samples()))
    assert torch.isfinite(torch.tensor(metrics["loss/total"]))
    assert all(p.grad is not None and p.grad.is_cuda for p in trainer.policy.trainable_parameters())


@pytest.mark.parametrize("how", ["fp32 copy", "bf16 copy on the cpu", "lora: the base, adapter off"])
def test_the_kl_reference_is_the_start_of_training(tiny: Path, how: str) -> None:
    """Before any update the policy is its reference: KL 0 with an fp32 copy or with LoRA's base (no copy
    at all), and within bf16 rounding of 0 with a bf16 copy (stored bf16, computed in fp32)."""
    knobs = {"fp32 copy": {"reference_dtype": "float32"},
             "bf16 copy on the cpu": {"reference_dtype": "bfloat16", "reference_device": "cpu"},
             "lora: the base, adapter off": {"lora_rank": 4}}[how]
    settings = load_settings(TrainerSettings, model_dir=tiny, algorithm="grpo", kl_coef=0.1, **knobs)
    trainer = Trainer(None, settings)  # type: ignore[arg-type]  # no store: one backward pass only
    trainer.policy = load_policy(settings, None)
    assert trainer.policy.has_reference
    kl = trainer.backward(_plan(_samples()))["loss/kl"]
    if how.startswith("lora"):
        assert trainer.policy.reference is None and kl == 0.0
    elif how.startswith("fp32"):
        assert kl == 0.0
    else:
        original = trainer.policy.reference.model.layers[0].mlp.up_proj.parametrizations.weight.original
        assert original.dtype == torch.bfloat16
        assert 0.0 < kl < 1e-2
