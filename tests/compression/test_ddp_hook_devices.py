"""The DDP hook gives its collectives tensors on the gradients' device only, as NCCL requires: checked on
the CPU with gradients that claim another device (a tensor subclass on ``meta`` holding CPU values)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_map

from fulmen_trainer.distributed.codecs import DDPCodecState, codec_hook, make_codec
from fulmen_trainer.distributed.sync_policy import SyncPolicy

ELSEWHERE = torch.device("meta")  # the stand-in for "cuda:0": not the CPU, and there on every build


class Elsewhere(torch.Tensor):
    """Values on the CPU, device ``meta``: an op mixing it with a CPU tensor of more than one element
    fails, as CUDA and CPU tensors do; ``.cpu()`` gives a plain tensor."""

    inner: torch.Tensor
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Elsewhere:
        out = torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=ELSEWHERE,
                                                  strides=inner.stride(), storage_offset=inner.storage_offset())
        out.inner = inner
        return out

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return _run(func, args, kwargs or {})


def _run(func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
    tagged = [a for a in _flat((args, kwargs)) if isinstance(a, Elsewhere)]
    target = kwargs.get("device")
    plain = [a for a in _flat((args, kwargs)) if type(a) is torch.Tensor and a.numel() > 1]
    moving = func.__name__.startswith(("_to_copy", "copy_", "lift_fresh"))
    if tagged and plain and not moving:
        raise RuntimeError(f"{func}: tensors on {ELSEWHERE} and cpu (as cuda:0 and cpu would be)")
    if target is not None and torch.device(target) == ELSEWHERE:
        kwargs = {**kwargs, "device": torch.device("cpu")}
    unwrapped = tree_map(lambda a: a.inner if isinstance(a, Elsewhere) else a, (args, kwargs))
    out = func(*unwrapped[0], **unwrapped[1])
    if target is not None and torch.device(target).type == "cpu":
        return out
    if not tagged and target is None:
        return out
    for a in tagged:  # an in-place op returns its own argument
        if out is a.inner:
            return a
    return tree_map(lambda t: Elsewhere(t) if type(t) is torch.Tensor else t, out)


def _flat(tree: Any) -> Iterator[Any]:
    if isinstance(tree, (list, tuple)):
        for x in tree:
            yield from _flat(x)
    elif isinstance(tree, dict):
        for x in tree.values():
            yield from _flat(x)
    else:
        yield tree


def _is_elsewhere(value: Any) -> bool:
    return (isinstance(value, torch.device) and value == ELSEWHERE) or value == str(ELSEWHERE)


class MadeElsewhere(TorchFunctionMode):
    """What is asked for on the ``meta`` device (``torch.tensor(..., device=)``, ``.to(device)``) is made
    on the CPU and returned as `Elsewhere`."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.tolist and isinstance(args[0], Elsewhere):  # a copy to the host, as .cuda's
            return args[0].inner.tolist()
        moved = any(_is_elsewhere(a) for a in _flat((args, kwargs)))
        if not moved:
            return func(*args, **kwargs)
        cpu = tree_map(lambda a: torch.device("cpu") if _is_elsewhere(a) else a, (args, kwargs))
        out = func(*cpu[0], **cpu[1])
        return tree_map(lambda t: Elsewhere(t) if type(t) is torch.Tensor else t, out)


class Bucket:
    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True


class Group:
    """What the collectives were called with: ``device`` (the gradients'), the names called."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.called: list[str] = []


@pytest.fixture
def group(monkeypatch: pytest.MonkeyPatch) -> Iterator[Group]:
    """A one-rank gloo group whose collectives refuse tensors off the gradients' device, as NCCL
    refuses CPU tensors."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    seen = Group()

    def checked(name: str) -> Any:
        real = getattr(dist, name)

        def collective(*args: Any, **kwargs: Any) -> Any:
            tensors = [t for t in _flat((args, kwargs)) if isinstance(t, torch.Tensor)]
            wrong = [str(t.device) for t in tensors if t.device != seen.device]
            if wrong:
                raise ValueError(f"{name} given tensors on {wrong}; the gradients are on {seen.device}")
            seen.called.append(name)
            unwrapped = tree_map(lambda a: a.inner if isinstance(a, Elsewhere) else a, (args, kwargs))
            with _disable_current_modes():
                return real(*unwrapped[0], **unwrapped[1])

        return collective

    for name in ("all_reduce", "all_gather", "broadcast", "all_gather_into_tensor"):
        monkeypatch.setattr(dist, name, checked(name))
    yield seen
    dist.destroy_process_group()


CODECS = {"none": {}, "bf16": {}, "topk": {"density": 0.1}, "dgc": {"density": 0.1, "warmup_steps": 0},
          "qsgd8": {"bucket_size": 64}}


def _average(group: Group, codec: str, gradient: torch.Tensor, policy: SyncPolicy | None,
             elsewhere: bool) -> torch.Tensor:
    group.device = ELSEWHERE if elsewhere else torch.device("cpu")
    state = DDPCodecState(make_codec(codec, seed=3, **CODECS[codec]), start_iter=0, policy=policy)
    state.step = 4
    buffer = Elsewhere(gradient.clone()) if elsewhere else gradient.clone()
    with MadeElsewhere() if elsewhere else contextlib.nullcontext():
        future = codec_hook(state, Bucket(buffer))  # type: ignore[arg-type]
    out = future.wait()
    return out.cpu() if isinstance(out, Elsewhere) else out


@pytest.mark.parametrize("policy", [None, "compressed", "full sync"])
@pytest.mark.parametrize("codec", list(CODECS))
def test_every_collective_of_the_hook_is_on_the_gradients_device(group: Group, codec: str,
                                                                  policy: str | None) -> None:
    """Each codec, with and without a sync policy (a compressed step, a full sync): the hook's
    collectives see only tensors on the gradients' device, and average as on the CPU."""
    gradient = torch.randn(300, generator=torch.Generator().manual_seed(0))

    def make() -> SyncPolicy | None:
        return None if policy is None else SyncPolicy(full_sync_every=4 if policy == "full sync" else None)

    on_cpu = _average(group, codec, gradient, make(), elsewhere=False)
    called = len(group.called)
    elsewhere = _average(group, codec, gradient, make(), elsewhere=True)
    assert len(group.called) > called  # the collectives did run, through the check
    torch.testing.assert_close(elsewhere, on_cpu)
