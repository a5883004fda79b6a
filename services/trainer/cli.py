"""`fulmen trainer`. Kept light at import: `fulmen --help` loads this module (torch is imported later)."""

from __future__ import annotations

from fulmen.cli.service import run_service, service_command
from fulmen.settings import TrainerSettings
from fulmen_trainer.main import SERVICE


@service_command(SERVICE)
def command(settings: TrainerSettings) -> None:
    """Train the policy on the samples stream and publish each new model version to the proxies.

    Steps whenever it holds enough complete task groups (all n rollouts of a task terminal). Every
    option is also an environment variable (FULMEN_<NAME>). Killed at any point, it resumes from its
    last checkpoint without losing or repeating a sample.

    Several ranks: `honcho start -c trainer=R` with --world-size R (ranks over Redis), or
    `torchrun --no-python --nproc-per-node N fulmen trainer --parallel ddp` (DDP on gloo or NCCL),
    or `--parallel fsdp` (the model sharded over the ranks); under torchrun rank r serves its metrics
    on the metrics port + its local rank."""
    run_service(SERVICE, settings, rank_processes=True)
