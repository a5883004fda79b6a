"""When a rank's gradient goes compressed, and how much: the synchronisation policy both rank paths
(the Redis ranks and the DDP hook) apply to each gradient they send.

It only decides; the callers apply. Anomaly fallback, full sync, density: docs/design/trainer.md.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from statistics import median
from typing import Any

log = logging.getLogger(__name__)

HISTORY = 20  # norms the median of an exploding gradient is taken over
MIN_HISTORY = 5  # norms seen before a gradient can count as exploding
FACTOR_RANGE = (0.25, 4.0)
GROW, SHRINK, MARGIN = 1.5, 1.25, 0.05


@dataclass(frozen=True)
class SyncDecision:
    compress: bool
    density: float | None = None  # for the sparse codecs; None keeps the codec's own
    flush: bool = False  # uncompressed with the error-feedback residual, which is then cleared
    reason: str = ""  # why not compressed


def parse_schedule(text: str | None) -> list[tuple[int | None, float]]:
    """``"50:0.1,900:0.01,0.05"`` → [(50, 0.1), (900, 0.01), (None, 0.05)]; a clear error otherwise."""
    if not text:
        return []
    phases: list[tuple[int | None, float]] = []
    for part in (p.strip() for p in text.split(",")):
        until, _, density = part.rpartition(":")
        try:
            value = float(density)
            bound = int(until) if until else None
        except ValueError:
            raise ValueError(f"density_schedule: {part!r} is not 'until_step:density' or 'density'") from None
        if not 0 < value <= 1:
            raise ValueError(f"density_schedule: density {value} must be in (0, 1]")
        if phases and (phases[-1][0] is None or (bound is not None and bound <= (phases[-1][0] or 0))):
            raise ValueError(f"density_schedule: phases must end at increasing steps, the last one open ({text!r})")
        phases.append((bound, value))
    return phases


@dataclass
class SyncPolicy:
    full_sync_every: int | None = None
    schedule: list[tuple[int | None, float]] = field(default_factory=list)
    adaptive: bool = False
    target_cosine: float = 0.8
    anomaly_factor: float = 10.0
    norms: list[float] = field(default_factory=list)
    factor: float = 1.0

    @classmethod
    def from_settings(cls, settings: Any) -> SyncPolicy:
        return cls(settings.full_sync_every, parse_schedule(settings.density_schedule), settings.adaptive_density,
                   settings.target_cosine, settings.anomaly_factor)

    def scheduled_density(self, step: int) -> float | None:
        for until, density in self.schedule:
            if until is None or step <= until:
                return density
        return self.schedule[-1][1] if self.schedule else None

    def decide(self, step: int, norm: float, base_density: float | None) -> SyncDecision:
        if not math.isfinite(norm):
            log.warning("step %d: gradient norm %s is not finite: sent uncompressed, error feedback kept as it was "
                        "(every rank skips this update)", step, norm)
            return SyncDecision(False, reason="non-finite gradient")
        if len(self.norms) >= MIN_HISTORY and norm > self.anomaly_factor * median(self.norms):
            log.warning("step %d: gradient norm %.4g is %.1f× the median of the last %d steps: sent uncompressed",
                        step, norm, norm / median(self.norms), len(self.norms))
            return SyncDecision(False, reason="exploding gradient")
        if self.full_sync_every and step % self.full_sync_every == 0:
            return SyncDecision(False, flush=True, reason=f"full sync every {self.full_sync_every} steps")
        density = self.scheduled_density(step)
        density = base_density if density is None else density
        if density is not None and self.adaptive:
            density = min(1.0, density * self.factor)
        return SyncDecision(True, density=density)

    def observe(self, norm: float, cosine: float | None) -> None:
        """After a step: its gradient norm (finite ones only) and, for a compressed send, its cosine."""
        if math.isfinite(norm):
            self.norms = [*self.norms, norm][-HISTORY:]
        if self.adaptive and cosine is not None:
            if cosine < self.target_cosine:
                self.factor = min(FACTOR_RANGE[1], self.factor * GROW)
            elif cosine > self.target_cosine + MARGIN:
                self.factor = max(FACTOR_RANGE[0], self.factor / SHRINK)

    def state_dict(self) -> dict[str, Any]:
        return {"norms": list(self.norms), "factor": self.factor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.norms = [float(n) for n in state.get("norms", [])][-HISTORY:]
        self.factor = float(state.get("factor", 1.0))
