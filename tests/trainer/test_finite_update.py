"""A non-finite gradient is never applied: the weights stay as they were (issue 20, item 8)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from fulmen_trainer.trainer import Trainer


def test_a_nan_gradient_leaves_the_weights_unchanged_and_the_gradients_cleared() -> None:
    """Trainer.update drops the step's gradient when its norm is NaN; the next update works again."""
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    trainer = SimpleNamespace(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.1),
                              s=SimpleNamespace(max_grad_norm=1.0), step=3, learning_rate=lambda step: 0.1)
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    assert math.isnan(Trainer.update(trainer))  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())

    model(torch.ones(1, 3)).sum().backward()
    assert math.isfinite(Trainer.update(trainer))  # type: ignore[arg-type]
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
