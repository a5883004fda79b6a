"""Every codec round-trips with its stated precision; top-k, QSGD, error feedback and state dicts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fulmen.errors import InvalidInput
from fulmen_trainer.distributed.codecs import available_codecs, decode, make_codec


def dyadic(n: int, seed: int = 0) -> torch.Tensor:
    """Values k/64 with |k| < 4096: sums of a few of them are exact in fp32, so identities can be
    checked with == (use value_dtype="float32": they are not all exact in fp16)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4095, 4096, (n,), generator=g).float() / 64


def test_registry_lists_every_codec() -> None:
    """The six codecs are registered by name; an unknown name is refused."""
    assert available_codecs() == ["bf16", "dgc", "none", "qsgd4", "qsgd8", "topk"]
    with pytest.raises(InvalidInput, match="unknown codec"):
        make_codec("zip")


@pytest.mark.parametrize("knobs", [{"density": 0}, {"density": 1.5}, {"value_dtype": "int8"}, {"seed": -1}])
def test_bad_knobs_are_refused(knobs: dict) -> None:
    """Knobs are validated in __init__."""
    with pytest.raises(InvalidInput):
        make_codec("topk", **knobs)


def test_none_is_lossless() -> None:
    """fp32 round trip is bit-exact, shape kept, input untouched."""
    g = torch.randn(3, 1000)
    before = g.clone()
    out = decode(make_codec("none").encode(g))
    assert out.shape == g.shape and out.dtype == torch.float32
    assert torch.equal(out, g) and torch.equal(g, before)


def test_bf16_exact_on_bf16_values() -> None:
    """bf16-representable values survive exactly; others within bf16's relative precision."""
    g = torch.randn(10_000).to(torch.bfloat16).float()
    assert torch.equal(decode(make_codec("bf16").encode(g)), g)
    r = torch.randn(10_000)
    assert torch.allclose(decode(make_codec("bf16").encode(r)), r, rtol=2**-8, atol=0)


def test_topk_keeps_exactly_k_with_the_right_values() -> None:
    """k = round(density * n) entries, the largest in magnitude, with their values (fp16-exact input)."""
    n, density = 200_000, 0.01
    g = dyadic(n)
    g[torch.randperm(n)[:2000]] += 1000.0 * torch.sign(torch.randn(2000))  # a clear top 2,000
    g = g.half().float()
    out = decode(make_codec("topk", density=density).encode(g))
    k = round(density * n)
    kept = out.nonzero().squeeze(1)
    assert len(kept) == k
    expected = torch.topk(g.abs(), k).indices.sort().values
    assert torch.equal(kept, expected)
    assert torch.equal(out[kept], g[kept])


@pytest.mark.parametrize("codec", ["topk", "dgc"])
def test_error_feedback_carries_the_residual(codec: str) -> None:
    """sum over steps of decoded + final residual == sum of gradients, exactly (momentum 0)."""
    n = 150_000
    knobs = {"density": 0.01, "value_dtype": "float32"}
    if codec == "dgc":
        knobs |= {"momentum": 0.0, "warmup_steps": 3}
    c = make_codec(codec, **knobs)
    sent = torch.zeros(n)
    total = torch.zeros(n)
    for step in range(6):
        g = dyadic(n, seed=step)
        total += g
        sent += decode(c.encode(g, name="w", step=step))
    residual = torch.from_numpy(c.residuals["w"])
    assert torch.equal(sent + residual, total)
    assert residual.abs().sum() > 0  # something was really held back


def test_error_feedback_includes_fp16_rounding() -> None:
    """With fp16 values, the rounding error of what was sent stays in the residual (close identity)."""
    n = 100_000
    c = make_codec("topk", density=0.05)
    g = torch.randn(n) * 1e-6  # tiny gradients: the power-of-two scale keeps them normal in fp16
    sent = decode(c.encode(g, name="w"))
    kept = sent.nonzero().squeeze(1)
    assert torch.allclose(sent[kept], g[kept], rtol=2**-10, atol=0)
    assert torch.allclose(sent + torch.from_numpy(c.residuals["w"]), g, rtol=0, atol=1e-12)


@pytest.mark.parametrize("codec", ["qsgd8", "qsgd4"])
def test_qsgd_is_unbiased(codec: str) -> None:
    """The mean of 2,000 decodes is within 4.5 standard errors of the input for each of 256 elements
    (family-wise: 3 SE on each of 256 would fail by chance half the time), and the squared z-scores
    average ~1 as they must without bias. The SE is the exact one of stochastic rounding,
    step * sqrt(p(1 - p) / draws) with step = norm / s and p the fractional level; elements too
    close to a level for the normal approximation (p(1 - p) * draws < 5) must be within 10 steps/draws."""
    draws = 2000
    bucket, s = 64, (127 if codec == "qsgd8" else 7)
    x = torch.randn(256, generator=torch.Generator().manual_seed(0))
    c = make_codec(codec, bucket_size=bucket, seed=7)
    mean = torch.stack([decode(c.encode(x, step=i)) for i in range(draws)]).double().mean(0)
    step = (x.view(-1, bucket).abs().amax(1, keepdim=True) / s).expand(-1, bucket).reshape(-1).double()
    level = x.double().abs() / step
    p = level - level.floor()
    var = p * (1 - p)
    normal = var * draws >= 5
    assert int(normal.sum()) > 200
    z = (mean - x.double())[normal] / (step[normal] * (var[normal] / draws).sqrt())
    assert float(z.abs().max()) < 4.5, float(z.abs().max())
    assert 0.7 < float(z.pow(2).mean()) < 1.3, float(z.pow(2).mean())
    off = (mean - x.double())[~normal].abs() / step[~normal]
    assert len(off) == 0 or float(off.max()) <= 10 / draws


def test_qsgd_levels_and_ratio() -> None:
    """Each decoded value is q * norm / s for an integer q; 4-bit packs two codes a byte."""
    x = torch.randn(1001)
    for codec, s, code_bytes in (("qsgd8", 127, 1001), ("qsgd4", 7, 501)):
        c = make_codec(codec, bucket_size=100)
        chunks = c.encode(x)
        out = decode(chunks)
        norms = x[:1000].view(10, 100).abs().amax(1)
        q = out[:1000].view(10, 100) / norms[:, None] * s
        assert torch.allclose(q, q.round(), atol=1e-3)
        assert (q.abs() <= s + 1e-3).all()
        assert c.stats.wire_bytes - code_bytes - 11 * 4 < 200  # header only on top of codes + norms


def test_dgc_density_and_warmup() -> None:
    """DGC selects within [0.8, 1.25] × the target; the target decays 25% → 1% over warm-up."""
    n = 400_000
    c = make_codec("dgc", density=0.01, initial_density=0.25, warmup_steps=4, momentum=0.9, seed=3)
    assert c.density_at(0) == pytest.approx(0.25)
    for step in range(7):
        target = c.density_at(step)
        c.encode(torch.randn(n), name="w", step=step)
        density = c.compression_stats(reset=True)["comm/density"]
        assert 0.8 * target <= density <= 1.25 * target, (step, target, density)
    assert [round(c.density_at(s), 4) for s in range(6)] == [0.25, 0.1118, 0.05, 0.0224, 0.01, 0.01]


def test_dgc_momentum_correction_and_masking() -> None:
    """Unsent entries accumulate u = m·u + g into v; a sent entry's momentum is zeroed (masking)."""
    n = 10_000
    c = make_codec(
        "dgc", density=1e-4, initial_density=1e-4, warmup_steps=0, momentum=0.5, value_dtype="float32"
    )
    g = torch.full((n,), 1.0)
    g[0] = 1000.0  # the only one sent each step
    for step in range(3):
        c.encode(g, name="w", step=step)
    v, u = c.residuals["w"], c.momenta["w"]
    # u: 1, 1.5, 1.75; v: 1, 2.5, 4.25 for the unsent entries.
    assert u[1] == 1.75 and v[1] == 4.25
    assert u[0] == 0.0 and v[0] == 0.0


def test_dgc_handles_mostly_zero_gradients() -> None:
    """Fewer non-zeros than the target: all of them are sent, nothing else."""
    g = torch.zeros(100_000)
    g[::1000] = 1.0  # 100 non-zeros, target 1,000
    c = make_codec("dgc", density=0.01, warmup_steps=0, momentum=0.0)
    out = decode(c.encode(g))
    assert torch.equal(out, g)


@pytest.mark.parametrize("codec", ["topk", "dgc", "qsgd4"])
def test_state_dict_round_trip(codec: str) -> None:
    """A restored codec continues exactly as the original (residuals, momenta, generator, warm-up)."""
    a = make_codec(codec, seed=5)
    for step in range(2):
        a.encode(torch.randn(70_000), name="w", step=step)
    state = a.state_dict()
    b = make_codec(codec, seed=5)
    b.load_state_dict(state)
    g = torch.randn(70_000)
    assert a.encode(g, name="w", step=2) == b.encode(g, name="w", step=2)
    with pytest.raises(InvalidInput, match="knobs"):
        make_codec(codec, seed=6).load_state_dict(state)
    with pytest.raises(InvalidInput, match="codec"):
        make_codec("none").load_state_dict(state)


def test_state_dict_is_a_copy() -> None:
    """Encoding after state_dict() does not change the saved residuals."""
    c = make_codec("topk")
    c.encode(torch.randn(1000), name="w")
    state = c.state_dict()
    saved = state["residuals"]["w"].clone()
    c.encode(torch.randn(1000), name="w")
    assert torch.equal(state["residuals"]["w"], saved)


def test_compression_stats() -> None:
    """Stats count raw and wire bytes (headers included) and reset on demand."""
    c = make_codec("dgc", warmup_steps=0)
    chunks = c.encode(torch.randn(1 << 20))
    stats = c.compression_stats(reset=True)
    assert stats["comm/wire_bytes"] == sum(len(x) for x in chunks)
    assert stats["comm/raw_bytes"] == 4 << 20
    assert stats["comm/compression_ratio"] > 80
    assert c.compression_stats()["comm/encode_calls"] == 0


def test_non_float_input_refused() -> None:
    """Integer tensors are refused; half-precision input is widened to fp32."""
    with pytest.raises(InvalidInput):
        make_codec("none").encode(torch.arange(10))
    h = torch.randn(100).half()
    assert torch.equal(decode(make_codec("none").encode(h)), h.float())


def test_same_seed_same_rank_same_bits() -> None:
    """Stochastic codecs are reproducible per (seed, rank) and differ across ranks."""
    x = torch.randn(10_000)
    a = make_codec("qsgd4", seed=1).encode(x, rank=0)
    b = make_codec("qsgd4", seed=1).encode(x, rank=0)
    c = make_codec("qsgd4", seed=1).encode(x, rank=1)
    assert a == b
    assert np.any(decode(a).numpy() != decode(c).numpy())


def test_state_dict_plain_part_is_msgpack_safe() -> None:
    """Apart from the residual/momentum tensors, a state dict packs with msgpack (no pickle needed)."""
    from fulmen.codec import pack, unpack

    c = make_codec("dgc", seed=3)
    c.encode(torch.randn(10_000), name="w")
    state = c.state_dict()
    plain = {k: v for k, v in state.items() if k not in ("residuals", "momenta")}
    restored = make_codec("dgc", seed=3)
    restored.load_state_dict(
        {**unpack(pack(plain)), "residuals": state["residuals"], "momenta": state["momenta"]}
    )
    g = torch.randn(10_000)
    assert c.encode(g, name="w", step=1) == restored.encode(g, name="w", step=1)


def test_dgc_refuses_nan_gradients() -> None:
    """A NaN gradient is refused rather than left to rot in the residual."""
    g = torch.full((100_000,), float("nan"))
    with pytest.raises(InvalidInput, match="non-finite"):
        make_codec("dgc").encode(g)


def test_reset_forgets_the_residual() -> None:
    """reset(name) drops that name's error-feedback state only."""
    c = make_codec("topk")
    c.encode(torch.randn(1000), name="a")
    c.encode(torch.randn(1000), name="b")
    c.reset("a")
    assert set(c.residuals) == {"b"}
    c.reset()
    assert not c.residuals
