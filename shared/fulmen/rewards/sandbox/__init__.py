"""Untrusted code under limits: `run_code` (one run, its `CodeResult`) and `code_passes` (a verifier
scoring code by its tests). How it is isolated: `isolation`; the limits: `Limits`."""

from fulmen.rewards.sandbox.isolation import Isolation, isolation
from fulmen.rewards.sandbox.limits import Limits
from fulmen.rewards.sandbox.process import CodeResult, run_code, run_code_async
from fulmen.rewards.sandbox.verify import code_passes, code_passes_async

__all__ = ["CodeResult", "Isolation", "Limits", "code_passes", "code_passes_async", "isolation", "run_code",
           "run_code_async"]
