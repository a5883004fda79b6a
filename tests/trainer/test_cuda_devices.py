"""On a CUDA GPU: the trainer's paths that span two devices (a KL reference offloaded to the CPU, a
version published from GPU weights). Skipped, with the reason, on a machine without one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.records import Sample
from fulmen.settings import TrainerSettings, load_settings
from fulmen_trainer.plan import StepPlan
from fulmen_trainer.policy import load_policy
from fulmen_trainer.publishing import _on_host
from fulmen_trainer.trainer import Trainer

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (this machine has none)")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


def _plan() -> StepPlan:
    samples = [Sample(f"r{i}.1/t0", "triplet", f"r{i}", f"r{i}.1", "g0", 0, [1, 5 + i, 9], [20 + i, 21, 2],
                      [-1.0] * 3, [1] * 3, float(i % 2), float(i % 2), "base", group_size=4) for i in range(4)]
    return StepPlan(samples, [s.reward for s in samples], torch.tensor([1.0, -1.0, 1.0, -1.0]), ["g0"] * 4, [])


def test_a_kl_reference_on_the_cpu_scores_the_gpu_batch(tiny: Path) -> None:
    """--device cuda --reference-device cpu: the reference scores the micro-batch on its own device and
    the KL term comes back to the GPU (0 before any update, within bf16 rounding)."""
    settings = load_settings(TrainerSettings, model_dir=tiny, device="cuda", dtype="bfloat16", algorithm="grpo",
                             kl_coef=0.1, reference_device="cpu")
    trainer = Trainer(None, settings)  # type: ignore[arg-type]
    trainer.policy = load_policy(settings, None)
    assert next(trainer.policy.reference.parameters()).device.type == "cpu"
    trainer.optimizer = torch.optim.AdamW(trainer.policy.trainable_parameters(), lr=1e-3)
    metrics = trainer.backward(_plan())
    assert 0.0 <= metrics["loss/kl"] < 1e-2


def test_a_published_state_is_moved_to_the_host_once(tiny: Path) -> None:
    """The publisher's host copy: every tensor on the CPU, values as on the GPU."""
    state = {"w": torch.randn(4, 4, device="cuda"), "b": torch.zeros(4)}
    host = _on_host(state)
    assert {t.device.type for t in host.values()} == {"cpu"}
    torch.testing.assert_close(host["w"], state["w"].cpu())
    assert host["b"].data_ptr() == state["b"].data_ptr()  # already on the host: not copied
