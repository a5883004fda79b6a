"""Sequence packing: a micro-batch's sequences in rows without padding, each attending only to itself,
give the padded batch's log-probabilities, entropy, KL and gradients; a model that cannot pack is
padded, with one warning."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import Sample
from fulmen.settings import TrainerSettings, load_settings
from fulmen_trainer import logprobs
from fulmen_trainer.batch import TokenBatch, make_batch
from fulmen_trainer.distributed.gradients import flat_gradient
from fulmen_trainer.logprobs import pack_micro_batch, row_tokens, token_logprobs
from fulmen_trainer.plan import StepPlan
from fulmen_trainer.policy import load_policy
from fulmen_trainer.trainer import Trainer

# (prompt, response) lengths: mixed, one response token only, one long conversation
SHAPES = [(3, 4), (12, 7), (2, 1), (21, 9), (5, 5), (8, 2)]
ATOL = 1e-5


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _samples(vocab: int = 40) -> list[Sample]:
    """Conversations of mixed lengths whose responses have untrained tokens inside (a tool's result)."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i, (p, r) in enumerate(SHAPES):
        ids = torch.randint(4, vocab, (p + r,), generator=g).tolist()
        mask = [0 if 0 < j < r - 1 and j % 3 == 1 else 1 for j in range(r)]
        behaviour = [-1.0 - (j % 4) for j in range(r)]
        out.append(Sample(f"r{i}.1/t0", "trajectory", f"r{i}", f"r{i}.1", f"g{i // 3}", 0, ids[:p], ids[p:],
                          behaviour, mask, float(i % 2), float(i % 2), "base", group_size=3))
    return out


def _batch() -> TokenBatch:
    return make_batch(_samples(), pad_id=0, rewards=[0.0] * len(SHAPES))


def _qwen2(attention: str) -> torch.nn.Module:
    """A tiny Qwen2 (grouped KV heads, as Qwen2.5's) with random weights, in fp32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation=attention)
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config).float()


def _scored(model: torch.nn.Module, batch: TokenBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities, entropy and the gradient of a loss made of both, in chunks of 3 tokens."""
    model.zero_grad(set_to_none=True)
    logp, entropy = token_logprobs(model, batch, chunk_tokens=3, entropy=True)
    assert entropy is not None
    (logp.sum() - 0.1 * entropy.sum()).backward()
    return logp.detach(), entropy.detach(), flat_gradient(model)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_packed_rows_give_the_padded_logprobs_entropy_and_gradient(attention: str) -> None:
    """One row, rows of the longest sequence, rows cut in between: all equal the padded forward (atol 1e-5)."""
    model = _qwen2(attention)
    batch = _batch()
    want = _scored(model, batch)
    longest, total = max(batch.lengths), sum(batch.lengths)
    for width in (total, longest, 40):
        packed = batch.packed_into(width)
        assert packed.packed is not None and packed.packed.input_ids.shape[1] == width
        for got, expected in zip(_scored(model, packed), want, strict=True):
            assert torch.allclose(got, expected, atol=ATOL), (attention, width, (got - expected).abs().max())


def test_attending_across_sequences_breaks_the_equality(monkeypatch: pytest.MonkeyPatch) -> None:
    """The equality above needs the block-diagonal mask: a plain causal mask over the row (each token
    attending to the sequences before it in its row) changes the log-probabilities."""
    model = _qwen2("sdpa")
    batch = _batch()
    want, _, _ = _scored(model, batch)
    packed = batch.packed_into(sum(batch.lengths))
    got, _, _ = _scored(model, packed)
    assert torch.allclose(got, want, atol=ATOL)
    inputs = logprobs._packed_inputs

    def causal_only(model: object, rows: object) -> dict[str, torch.Tensor]:
        out = inputs(model, rows)
        length = out["input_ids"].shape[1]
        out["attention_mask"] = torch.ones((length, length), dtype=torch.bool).tril()[None, None]
        return out

    monkeypatch.setattr(logprobs, "_packed_inputs", causal_only)
    leaked, _, _ = _scored(model, packed)
    assert (leaked - want).abs().max() > 1e-3


def test_packed_rows_hold_each_sequence_once_with_its_own_positions() -> None:
    """Every token sits once in the rows, at the index the batch records, with its position in its own
    sequence; no row is longer than its width."""
    batch = _batch()
    for width in (30, sum(batch.lengths)):
        rows = batch.packed_into(width).packed
        assert rows is not None
        flat_ids, flat_pos = rows.input_ids.flatten(), rows.position_ids.flatten()
        seen = set()
        for b, n in enumerate(batch.lengths):
            where = rows.index[b, :n]
            assert torch.equal(flat_ids[where], batch.input_ids[b, :n])
            assert torch.equal(flat_pos[where], torch.arange(n))
            assert bool((rows.segments.flatten()[where] == b).all())
            seen |= set(where.tolist())
        assert len(seen) == sum(batch.lengths)
        assert rows.input_ids.shape[1] == max(width, *batch.lengths)


def test_packed_micro_batches_count_the_real_tokens_and_rows_keep_the_budget() -> None:
    """With packing a token budget holds the sum of the lengths, not sequences × the longest; the rows
    chosen for a micro-batch stay within it."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config

    batch = _batch()
    lengths = batch.lengths
    model = LlamaForCausalLM(LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2))
    cuts = {True: 0, False: 0}
    for budget in (20, 35, 60):
        ranges = batch.micro_batches(64, budget, packed=True)
        assert [i for lo, hi in ranges for i in range(lo, hi)] == list(range(len(lengths)))
        for lo, hi in ranges:
            assert hi - lo == 1 or sum(lengths[lo:hi]) <= budget
            micro = batch.slice(lo, hi).trimmed()
            rows = pack_micro_batch(model, micro, budget).packed
            assert rows is not None
            assert hi - lo == 1 or rows.input_ids.numel() <= budget
        cuts[True] += len(ranges)
        cuts[False] += len(batch.micro_batches(64, budget))
    assert cuts[True] < cuts[False]  # padding cuts more micro-batches for the same budgets
    # masked attention costs per token and key of the row: dear beside this model's tiny layers (rows
    # of the longest sequence), cheap beside Qwen2.5-0.5B's (several sequences a row)
    assert row_tokens(model, lengths) == max(lengths)
    wide = SimpleNamespace(config=Qwen2Config(hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                                              num_key_value_heads=2))
    assert row_tokens(wide, lengths) > max(lengths)


def _samples_plan() -> StepPlan:
    samples = _samples()
    advantages = torch.tensor([(-1.0) ** i * (1 + i / 10) for i in range(len(samples))])
    return StepPlan(samples, [s.reward or 0.0 for s in samples], advantages, [s.group_key for s in samples], [])


def _two_passes(tiny: Path, **knobs: object) -> tuple[torch.Tensor, torch.Tensor, dict, dict]:
    """Two PPO passes through the trainer (SGD between them, so the second is clipped around π_prox):
    each pass's gradient and metrics."""
    settings = load_settings(TrainerSettings, model_dir=tiny, algorithm="grpo", ent_coef=0.01, kl_coef=0.1,
                             logprob_chunk_tokens=3, micro_batch_tokens=64, ppo_epochs=2, **knobs)
    trainer = Trainer(None, settings)  # type: ignore[arg-type]  # no store: backward passes only
    torch.manual_seed(0)  # the adapter's initial weights
    trainer.policy = load_policy(settings, None)
    trainer.optimizer = torch.optim.SGD(trainer.policy.trainable_parameters(), lr=0.5)
    plan = _samples_plan()
    first = trainer.backward(plan)
    first_grad = flat_gradient(trainer.model)
    trainer.update()
    second = trainer.backward(plan)
    return first_grad, flat_gradient(trainer.model), first, second


@pytest.mark.parametrize("knobs", [{}, {"lora_rank": 4, "lora_alpha": 8}], ids=["full", "lora"])
def test_the_trainer_packed_gives_the_padded_gradients_over_ppo_passes(
        tiny: Path, knobs: dict, caplog: pytest.LogCaptureFixture) -> None:
    """Through Trainer.backward: entropy, KL to the reference (a frozen copy, or the base under LoRA),
    π_prox kept across passes, chunked output layer, micro-batches planned by tokens — same gradients
    and metrics packed as padded (fp32, atol 1e-5)."""
    with caplog.at_level(logging.WARNING, logger="fulmen_trainer.logprobs"):
        packed = _two_passes(tiny, pack_sequences=True, **knobs)
    assert not [r for r in caplog.records if "packing off" in r.message]  # it did pack
    padded = _two_passes(tiny, **knobs)
    for got, want in zip(packed[:2], padded[:2], strict=True):
        assert float(want.abs().max()) > 1e-3  # a gradient worth comparing
        assert torch.allclose(got, want, atol=ATOL), (got - want).abs().max()
    for got, want in zip(packed[2:], padded[2:], strict=True):
        for key in ("loss/total", "loss/kl", "loss/entropy", "loss/clip_frac", "rollout/logp_mismatch"):
            assert got[key] == pytest.approx(want[key], abs=ATOL), key
    assert packed[3]["loss/kl"] > 0  # the second pass moved away from the reference


def test_a_model_that_cannot_pack_is_padded_with_one_warning(caplog: pytest.LogCaptureFixture) -> None:
    """A model class transformers does not define may ignore a 4-D mask: its micro-batches stay padded
    (the same numbers), and the warning naming why comes once."""
    from transformers import Qwen2ForCausalLM

    class Custom(Qwen2ForCausalLM):
        pass

    reference = _qwen2("sdpa")
    model = Custom(reference.config).float()
    model.load_state_dict(reference.state_dict())
    batch = _batch()
    with caplog.at_level(logging.WARNING, logger="fulmen_trainer.logprobs"):
        assert pack_micro_batch(model, batch).packed is None
        got = _scored(model, batch.packed_into(20))  # rows built anyway: the forward pads
        _scored(model, batch.packed_into(20))
    warnings = [r.message for r in caplog.records if "packing off" in r.message]
    assert len(warnings) == 1 and "Custom is not a transformers model class" in warnings[0], warnings
    for a, b in zip(got, _scored(reference, batch), strict=True):
        assert torch.allclose(a, b, atol=ATOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (this machine has none)")
def test_flash_attention_packs_one_row_by_positions(tiny: Path) -> None:
    """On CUDA with flash_attn installed, bf16 and pack_sequences load flash attention; one packed row,
    no mask, gives the padded forward's log-probabilities to bf16 precision."""
    pytest.importorskip("flash_attn")
    settings = load_settings(TrainerSettings, model_dir=tiny, device="cuda", dtype="bfloat16", pack_sequences=True)
    policy = load_policy(settings, None)
    assert policy.model.config._attn_implementation == "flash_attention_2"
    batch = _batch()
    packed = pack_micro_batch(policy.model, batch).to(policy.device)
    assert packed.packed is not None and packed.packed.input_ids.shape[0] == 1
    assert "attention_mask" not in logprobs._packed_inputs(policy.model, packed.packed)
    with torch.no_grad(), policy.compute():
        got, _ = token_logprobs(policy.model, packed)
        want, _ = token_logprobs(policy.model, batch.to(policy.device))
    assert torch.allclose(got, want, atol=5e-2)
