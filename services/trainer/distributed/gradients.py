"""A rank's gradient as one flat fp32 vector, and the codec it travels through between ranks.

The Redis rank path sends one flat gradient per pass (every parameter, in ``model.parameters()``
order), which is also the layout of a single DDP bucket: the two paths then feed the codecs the same
vector and reach the same weights (tests/trainer/test_ddp_parity.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fulmen.errors import InvalidInput
from fulmen_trainer.distributed import codecs
from fulmen_trainer.distributed.codecs import with_density
from fulmen_trainer.distributed.sync_policy import SyncDecision, SyncPolicy

GRADIENT_NAME = "grads"  # the codec's error-feedback key: one flat gradient per rank
LOSSLESS = "none"  # the leader's aggregate: one per step, exact, so every rank applies the same bits
SPARSE_CODECS = ("topk", "dgc")  # the codecs that take a density


class RankCodec:
    """A rank's gradient codec: its state (error feedback, DGC momentum) persists across steps and in
    checkpoints. Decoding needs no state, so the leader decodes every rank's chunks alike. With a
    `SyncPolicy`, each gradient goes compressed or not, at the density, that the policy decides."""

    def __init__(self, name: str, policy: SyncPolicy | None = None, **knobs: Any) -> None:
        if name == "dgc":
            knobs.setdefault("momentum", 0.0)  # AdamW keeps the momentum; DGC's would count it twice
        if name not in SPARSE_CODECS:
            knobs.pop("density", None)  # one settings field serves every codec; only these use it
        try:
            self.state = codecs.make_codec(name, **knobs)
        except (InvalidInput, ValueError, KeyError) as e:
            raise ValueError(str(e)) from None
        self.name = name
        self.policy = policy
        self.raw = codecs.make_codec(LOSSLESS)  # uncompressed sends (full syncs, anomalies)
        self.last = SyncDecision(True)  # the decision of the last encode

    def encode(self, flat: torch.Tensor, step: int, rank: int) -> list[bytes]:
        if self.policy is None or self.name == LOSSLESS:
            return self.state.encode(flat, name=GRADIENT_NAME, step=step, rank=rank)
        self.last = decision = self.policy.decide(step, float(flat.norm()), getattr(self.state, "density", None))
        if not decision.compress:
            residual = self.state.flush(GRADIENT_NAME) if decision.flush else None
            sent = flat if residual is None else flat + residual.to(flat.dtype)
            return self.raw.encode(sent, name=GRADIENT_NAME, step=step, rank=rank)
        with with_density(self.state, decision.density):
            return self.state.encode(flat, name=GRADIENT_NAME, step=step, rank=rank)

    def observe(self, norm: float, cosine: float) -> dict[str, float]:
        """After a send: the policy learns the norm (and the cosine of a compressed send); returns the
        ``comm/`` metrics of the decision."""
        if self.policy is not None:
            self.policy.observe(norm, cosine if self.last.compress else None)
        return {"comm/uncompressed": 0.0 if self.last.compress else 1.0,
                "comm/density_target": self.last.density or 0.0}

    @staticmethod
    def decode(chunks: Sequence[bytes]) -> torch.Tensor:
        return codecs.decode(chunks).reshape(-1)

    def state_dict(self) -> dict[str, Any]:
        policy = {"sync_policy": self.policy.state_dict()} if self.policy is not None else {}
        return {**self.state.state_dict(), **policy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = dict(state)
        policy = state.pop("sync_policy", None)
        if policy is not None and self.policy is not None:
            self.policy.load_state_dict(policy)
        self.state.load_state_dict(state)


def trained(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters that train (all of them, or a LoRA adapter's), in ``model.parameters()`` order."""
    return [p for p in model.parameters() if p.requires_grad]


def flat_gradient(model: torch.nn.Module) -> torch.Tensor:
    """Every trained parameter's gradient (zeros where there is none), in parameter order, as one
    fp32 vector."""
    return torch.cat([
        (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float() for p in trained(model)
    ])


def set_gradient(model: torch.nn.Module, flat: torch.Tensor) -> None:
    """The inverse of `flat_gradient`: each parameter's ``.grad`` becomes its slice of ``flat``."""
    offset = 0
    for p in trained(model):
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.device, p.dtype, copy=True)
        offset += n


def cosine(sent: torch.Tensor, true: torch.Tensor) -> float:
    """How far what the codec sent is from the true gradient (1.0: same direction; 1.0 for a zero one)."""
    return float(torch.nn.functional.cosine_similarity(sent, true, dim=0)) if true.any() else 1.0
