"""The torch engine: batched generation, raw logprobs, streaming, sampling, limits and hot swaps."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from fulmen.demo.tiny_model import TinyModelSpec, build_tiny_model, load_tiny_model
from fulmen.errors import InvalidInput, RetryableError
from fulmen_llm_proxy.backends.torch.engine import Generation, GenerationStream, SamplingParams, TorchEngine

TEXTS = ["1", "12+7=", "hello there, big world! 0123456789", "ab"]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny0"), seed=0)


@pytest.fixture(scope="module")
def other_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny1"), seed=1)


@pytest.fixture(scope="module")
def reference(folder: Path) -> Any:
    return load_tiny_model(folder)


@pytest.fixture
async def engine(folder: Path) -> AsyncIterator[TorchEngine]:
    engine = TorchEngine(folder)
    await engine.start()
    yield engine
    await engine.close()


def _ids(engine: TorchEngine, text: str) -> list[int]:
    return engine.tokenizer.encode(text, add_special_tokens=False)


@torch.inference_mode()
def _direct_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    """Logprobs of ``tokens`` after ``prompt`` from one unpadded forward pass over both."""
    logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None]).squeeze(1).tolist()


@torch.inference_mode()
def _direct_greedy(model: Any, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    """Greedy decoding with a full forward pass per token: no cache, no padding, no batch."""
    tokens: list[int] = []
    while len(tokens) < max_tokens and (not tokens or tokens[-1] != eos):
        tokens.append(int(model(torch.tensor([prompt + tokens])).logits[0, -1].argmax()))
    return tokens


def _assert_logprobs_match(model: Any, g: Generation) -> None:
    direct = _direct_logprobs(model, g.prompt_token_ids, g.token_ids)
    assert max(abs(a - b) for a, b in zip(direct, g.logprobs, strict=True)) < 1e-4


def _submit_together(engine: TorchEngine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Streams submitted while the engine thread is held, so one prefill takes them all (left-padded)."""
    with engine._cond:
        return [engine.stream(p, s) for p, s in zip(prompts, params, strict=True)]


async def _collect(stream: GenerationStream) -> Generation:
    steps = [step async for step in stream]
    assert stream.model_version is not None and steps[-1].finish_reason is not None
    return Generation(
        stream.prompt_token_ids,
        [s.token_id for s in steps],
        [s.logprob for s in steps],
        steps[-1].finish_reason,
        stream.model_version,
    )


async def test_tokens_decode_to_text_within_max_tokens(engine: TorchEngine) -> None:
    """A generation's token ids are vocabulary ids that decode to text; it stops by max_tokens."""
    g = await engine.generate(_ids(engine, "12+7="), SamplingParams(max_tokens=7, temperature=0.8, seed=1))
    assert g.prompt_token_ids == _ids(engine, "12+7=") and g.model_version == "base"
    assert 1 <= len(g.token_ids) <= 7 and len(g.logprobs) == len(g.token_ids)
    assert g.finish_reason == ("stop" if g.token_ids[-1] == engine.eos_token_id else "length")
    text = engine.tokenizer.decode(g.token_ids)
    assert text == "".join(engine.tokenizer.decode([t]) for t in g.token_ids)
    assert all(lp <= 0 for lp in g.logprobs)


async def test_logprobs_match_direct_forward_when_left_padded(engine: TorchEngine, reference: Any) -> None:
    """Raw logprobs equal an unpadded forward pass within 1e-4, for short prompts padded in a batch."""
    model, _ = reference
    prompts = [_ids(engine, t) for t in TEXTS]
    params = [
        SamplingParams(max_tokens=10, temperature=t, top_p=p, seed=i)
        for i, (t, p) in enumerate([(0, 1), (1.3, 0.8), (0.7, 1), (0, 1)])
    ]
    streams = _submit_together(engine, prompts, params)
    for g in await asyncio.gather(*map(_collect, streams)):
        _assert_logprobs_match(model, g)


async def test_requests_joining_a_running_batch_stay_exact(engine: TorchEngine, reference: Any) -> None:
    """Requests that join mid-generation (shorter and longer prompts) match direct greedy and logprobs."""
    model, _ = reference
    first = engine.stream(_ids(engine, "12+7="), SamplingParams(max_tokens=48, temperature=0))
    steps = [await first.__anext__() for _ in range(4)]
    assert all(s.finish_reason is None for s in steps)
    joiners = [engine.generate(_ids(engine, t), GREEDY) for t in ("1", "hello there, big world! 0123456789")]
    *rest, late = await asyncio.gather(_collect(first), *joiners)
    tail = rest[0]
    whole = Generation(
        tail.prompt_token_ids,
        [s.token_id for s in steps] + tail.token_ids,
        [s.logprob for s in steps] + tail.logprobs,
        tail.finish_reason,
        tail.model_version,
    )
    for g in (whole, late):
        assert g.token_ids == _direct_greedy(model, g.prompt_token_ids, len(g.token_ids), engine.eos_token_id)
        _assert_logprobs_match(model, g)
    assert engine.stats["peak_batch"] == 3  # the joiners were merged into the running batch


async def test_greedy_is_deterministic_and_unchanged_by_batching(engine: TorchEngine, reference: Any) -> None:
    """Greedy output is the same alone, repeated, in a batch of 16, and as direct decoding."""
    model, _ = reference
    prompts = [_ids(engine, t) for t in TEXTS]
    alone = [await engine.generate(p, GREEDY) for p in prompts]
    again = [await engine.generate(p, GREEDY) for p in prompts]
    batched = await asyncio.gather(*(engine.generate(prompts[i % 4], GREEDY) for i in range(16)))
    assert [g.token_ids for g in alone] == [g.token_ids for g in again]
    assert [g.token_ids for g in batched] == [alone[i % 4].token_ids for i in range(16)]
    for g in alone:
        assert g.token_ids == _direct_greedy(model, g.prompt_token_ids, 12, engine.eos_token_id)


async def test_seed_makes_sampling_reproducible_in_any_batch(engine: TorchEngine) -> None:
    """A seeded request samples the same tokens alone or amid others; other seeds sample otherwise."""
    prompt = _ids(engine, "12+7=")
    seeded = SamplingParams(max_tokens=16, temperature=1.0, seed=42, stop_token_ids=())
    alone = await engine.generate(prompt, seeded)
    noise = [engine.generate(_ids(engine, t), SamplingParams(max_tokens=16, temperature=1.0)) for t in TEXTS]
    amid, *_ = await asyncio.gather(engine.generate(prompt, seeded), *noise)
    assert amid.token_ids == alone.token_ids
    others = [await engine.generate(prompt, SamplingParams(max_tokens=16, seed=s)) for s in (1, 2, 3)]
    assert any(g.token_ids != alone.token_ids for g in others)


async def test_tiny_top_p_keeps_only_the_most_likely_token(engine: TorchEngine) -> None:
    """With top_p near 0 sampling keeps only the top token, so it equals greedy decoding."""
    prompt = _ids(engine, "hello there, big world! 0123456789")
    greedy = await engine.generate(prompt, GREEDY)
    nucleus = await engine.generate(prompt, SamplingParams(max_tokens=12, temperature=2.0, top_p=1e-6))
    assert nucleus.token_ids == greedy.token_ids


async def test_stop_token_ids_and_eos_finish_with_stop(
    engine: TorchEngine, folder: Path, tmp_path: Path
) -> None:
    """Generation ends at the first stop token or eos, which is the last token, with reason "stop"."""
    prompt = _ids(engine, "hello there, big world! 0123456789")
    greedy = (await engine.generate(prompt, GREEDY)).token_ids
    stop = greedy[5]
    cut = greedy[: greedy.index(stop) + 1]
    g = await engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop,)))
    assert (g.token_ids, g.finish_reason) == (cut, "stop")

    eos_folder = shutil.copytree(folder, tmp_path / "eos")
    config = json.loads((eos_folder / "generation_config.json").read_text())
    (eos_folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": stop}))
    other = TorchEngine(eos_folder)
    try:
        assert other.eos_token_id == stop
        g = await other.generate(prompt, GREEDY)
        assert (g.token_ids, g.finish_reason) == (cut, "stop")
    finally:
        await other.close()


async def test_context_length_caps_generation_and_refuses_oversize_prompts(tmp_path: Path) -> None:
    """prompt + response never exceed max_position_embeddings; a prompt that fills it is refused."""
    small = build_tiny_model(tmp_path, TinyModelSpec(max_position_embeddings=24))
    model, _ = load_tiny_model(small)
    engine = TorchEngine(small)
    try:
        prompt = _ids(engine, "hello there, big world!!")[:20]
        g = await engine.generate(prompt, SamplingParams(max_tokens=10, temperature=0))
        expected = _direct_greedy(model, prompt, 4, engine.eos_token_id)
        assert g.token_ids == expected
        assert g.finish_reason == ("stop" if expected[-1] == engine.eos_token_id else "length")
        with pytest.raises(InvalidInput, match="24 tokens"):
            engine.stream(_ids(engine, "x" * 24), GREEDY)
        with pytest.raises(InvalidInput):
            engine.stream([], GREEDY)
        with pytest.raises(InvalidInput):
            engine.stream([engine.vocab_size], GREEDY)
    finally:
        await engine.close()


async def test_stream_delivers_the_first_token_early_with_its_version(engine: TorchEngine) -> None:
    """The first token arrives well before the stream ends, and the stream names its model version."""
    started = time.perf_counter()
    arrivals: list[float] = []
    params = SamplingParams(max_tokens=48, temperature=0)
    async with engine.stream(_ids(engine, "12+7="), params) as s:  # runs 48 tokens without eos
        async for _ in s:
            arrivals.append(time.perf_counter() - started)
            assert s.model_version == "base"
    assert len(arrivals) == 48
    assert arrivals[0] < 0.5 * arrivals[-1]


async def test_leaving_a_stream_early_cancels_the_request(engine: TorchEngine) -> None:
    """A consumer that stops reading frees its batch row; the engine keeps serving."""
    async with engine.stream(_ids(engine, "12+7="), SamplingParams(max_tokens=400, temperature=0)) as s:
        async for _ in s:
            break
    for _ in range(200):
        if not engine._batch.rows:
            break
        await asyncio.sleep(0.005)
    assert not engine._batch.rows
    assert engine.stats["tokens"] < 100
    assert (await engine.generate(_ids(engine, "1"), GREEDY)).token_ids


async def test_hot_swap_under_traffic(engine: TorchEngine, reference: Any, other_folder: Path) -> None:
    """Requests before and during a swap all succeed on one version each; later requests use the new weights."""
    new_model, _ = load_tiny_model(other_folder)
    models = {"base": reference[0], "v1": new_model}
    prompts = [_ids(engine, t) for t in TEXTS]
    expected = {
        (v, i): _direct_greedy(m, p, GREEDY.max_tokens, engine.eos_token_id)
        for v, m in models.items()
        for i, p in enumerate(prompts)
    }
    assert any(expected["base", i] != expected["v1", i] for i in range(4))

    before = [asyncio.create_task(engine.generate(prompts[i % 4], GREEDY)) for i in range(32)]
    while engine.stats["tokens"] < 8:
        await asyncio.sleep(0.001)
    swap = asyncio.create_task(engine.load_weights(new_model.state_dict(), "v1"))
    # calls go on arriving until the swap is done: its weights check runs in a thread first, and on a
    # fast machine the 32 above can all end before the swap is even queued
    during: list[asyncio.Task[Any]] = []
    while not swap.done():
        during.append(asyncio.create_task(engine.generate(prompts[len(during) % 4], GREEDY)))
        await asyncio.sleep(0.001)
    await swap
    assert engine.model_version == "v1"
    after = [asyncio.create_task(engine.generate(prompts[i % 4], GREEDY)) for i in range(8)]

    results = await asyncio.gather(*before, *during, *after)
    prompt_of = [*(i % 4 for i in range(32)), *(i % 4 for i in range(len(during))), *(i % 4 for i in range(8))]
    for i, g in zip(prompt_of, results, strict=True):
        assert g.token_ids == expected[g.model_version, i]
        _assert_logprobs_match(models[g.model_version], g)
    # the calls sent before the swap returned were served by both versions (each call by one)
    assert {g.model_version for g in results[:-8]} == {"base", "v1"}
    assert all(g.model_version == "v1" for g in results[-8:])


async def test_weights_that_do_not_fit_are_refused(engine: TorchEngine) -> None:
    """load_weights refuses wrong shapes, unknown and missing keys, NaN or infinite values; the old
    weights keep serving."""
    good = engine.model.state_dict()
    bad_shape = {**good, "lm_head.weight": torch.zeros(3, 3)}
    missing = {n: t for n, t in good.items() if n != "lm_head.weight"}
    for weights, message in [
        (bad_shape, "shape"),
        (missing, "lack"),
        ({**good, "x": torch.zeros(1)}, "keys"),
        ({**good, "lm_head.weight": torch.full_like(good["lm_head.weight"], float("nan"))}, "NaN"),
        ({n: t.clone().fill_(float("inf")) if t.is_floating_point() else t for n, t in good.items()}, "infinite"),
    ]:
        with pytest.raises(InvalidInput, match=message):
            await engine.load_weights(weights, "bad")
    assert engine.model_version == "base"
    assert (await engine.generate(_ids(engine, "1"), GREEDY)).model_version == "base"


async def test_close_fails_running_requests_and_refuses_new_ones(folder: Path) -> None:
    """A request running at close fails with RetryableError, and a closed engine takes no request."""
    engine = TorchEngine(folder)
    s = engine.stream(_ids(engine, "12+7="), SamplingParams(max_tokens=400, temperature=0))
    await s.__anext__()
    await engine.close()
    with pytest.raises(RetryableError):
        async for _ in s:
            pass
    with pytest.raises(RetryableError):
        engine.stream(_ids(engine, "1"), GREEDY)


def test_sampling_params_are_validated() -> None:
    """Out-of-range sampling parameters raise InvalidInput."""
    for bad in [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_p": 1.5}, {"seed": 1.5}]:
        with pytest.raises(InvalidInput):
            SamplingParams(**bad)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)  # type: ignore[arg-type]
