"""PPO epochs: ``ppo_epochs`` optimizer updates per batch, each clipped around the step's start policy."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import Sample
from fulmen.settings import TrainerSettings, load_settings
from fulmen_trainer.batch import make_batch
from fulmen_trainer.logprobs import token_logprobs
from fulmen_trainer.objectives import policy_gradient
from fulmen_trainer.plan import StepPlan
from fulmen_trainer.trainer import Trainer

LR, CLIP, TIS_CAP, MAX_NORM = 0.05, 0.2, 2.0, 1.0  # a large rate: the second pass leaves the clip range


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _plan() -> StepPlan:
    samples = []
    for i in range(4):
        prompt = [1, 5 + i, 9, 12]
        response = [20 + i, 21, 22 + i, 2]
        # made-up behaviour log-probs, far below the model's for some tokens: the IS weight is
        # truncated there, so a pass that dropped or replaced them would show
        behaviour = [-1.0 - i, -6.0, -2.5, -0.5 * i]
        samples.append(Sample(f"r{i}.1/t0", "triplet", f"r{i}", f"r{i}.1", "g", 0, prompt, response, behaviour,
                              [1, 1, 1, 1], float(i % 2), float(i % 2), "base", group_size=4))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return StepPlan(samples, [float(i % 2) for i in range(4)], advantages, ["g"] * 4, [])


def _trainer(tiny: Path, epochs: int, algorithm: str = "ppo") -> Trainer:
    from transformers import AutoModelForCausalLM

    settings = load_settings(TrainerSettings, model_dir=tiny, algorithm=algorithm, ppo_epochs=epochs, learning_rate=LR, clip_eps=CLIP,
                             tis_cap=TIS_CAP, max_grad_norm=MAX_NORM)
    trainer = Trainer(None, settings)  # type: ignore[arg-type]  # no store: only the passes are run
    trainer.model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).train()
    trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=LR)
    return trainer


def _by_hand(model: torch.nn.Module, plan: StepPlan, *, epochs: int, recompute_prox: bool) -> torch.nn.Module:
    """Sequential updates with the objective functions; ``recompute_prox`` is the wrong variant that
    centres each pass's clip on its own start (ratio 1 every pass)."""
    model = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    batch = make_batch(plan.samples, pad_id=0, rewards=plan.rewards, group_keys=plan.group_keys)
    prox = None
    for _ in range(epochs):
        logp, _ = token_logprobs(model, batch)
        if prox is None or recompute_prox:
            prox = logp.detach()
        loss = policy_gradient(logp, batch.behaviour_logp, plan.advantages, batch.mask, prox_logp=prox,
                               clip_eps=CLIP, tis_cap=TIS_CAP)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return model


def _max_gap(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_two_epochs_are_two_updates_clipped_around_the_step_start(tiny: Path) -> None:
    """ppo_epochs=2: the weights of two hand-made updates whose ratio is taken against the first pass's
    log-probs (and whose IS weight keeps the proxy's); one step counted, clipping seen in pass 2."""
    trainer = _trainer(tiny, epochs=2)
    start = copy.deepcopy(trainer.model)
    plan = _plan()
    metrics = trainer.train_passes(plan)
    assert metrics["loss/ppo_epochs"] == 2 and trainer.step == 0  # the step is counted by train_step
    assert metrics["loss/clip_frac"] > 0  # the second pass left the clip range for some tokens
    want = _by_hand(start, plan, epochs=2, recompute_prox=False)
    assert _max_gap(trainer.model, want) < 1e-6
    # the test tells the variants apart: a ratio re-centred each pass, or a single update, is far off
    assert _max_gap(trainer.model, _by_hand(start, _plan(), epochs=2, recompute_prox=True)) > 1e-4
    assert _max_gap(trainer.model, _by_hand(start, _plan(), epochs=1, recompute_prox=False)) > 1e-3


def test_one_epoch_is_the_plain_policy_gradient_step(tiny: Path) -> None:
    """The default (1) keeps the single update of before: ratio 1, nothing clipped."""
    trainer = _trainer(tiny, epochs=1)
    start = copy.deepcopy(trainer.model)
    metrics = trainer.train_passes(_plan())
    assert metrics["loss/ppo_epochs"] == 1 and metrics["loss/clip_frac"] == 0
    assert _max_gap(trainer.model, _by_hand(start, _plan(), epochs=1, recompute_prox=False)) < 1e-6


def test_reinforce_makes_one_pass_whatever_ppo_epochs_says(tiny: Path) -> None:
    """reinforce does not clip: a second pass over the same rollouts would follow the unclipped ratio
    without bound (the demo collapsed to 0 that way), so it updates once per step, as REINFORCE does."""
    trainer = _trainer(tiny, epochs=2, algorithm="reinforce")
    start = copy.deepcopy(trainer.model)
    metrics = trainer.train_passes(_plan())
    assert metrics["loss/ppo_epochs"] == 1
    assert _max_gap(trainer.model, _by_hand(start, _plan(), epochs=1, recompute_prox=False)) < 1e-6
    assert trainer.ppo_epochs == 1 and _trainer(tiny, epochs=2, algorithm="ppo").ppo_epochs == 2
