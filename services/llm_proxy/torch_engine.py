"""The torch backend's generation engine: continuous batching of concurrent requests on one model.

One engine thread owns the model. Each iteration it decodes one token for every running request in a
single forward pass (left-padded KV cache, explicit attention mask and position ids), prefills newly
arrived requests in one more pass and merges them into the running batch, so a request joins at the
next token rather than waiting for the batch to finish (continuous batching). The event loop only
submits requests and receives tokens (via ``call_soon_threadsafe``), so it stays free for HTTP.

Streaming API — `TorchEngine.stream` returns a `GenerationStream`, an async iterator of `TokenStep`
that is also an async context manager::

    async with engine.stream(prompt_ids, SamplingParams(max_tokens=32)) as s:
        async for step in s:        # each token as soon as it is decoded
            s.model_version         # set before the first step is yielded: the weights serving it
            ...
    # leaving the block early (client gone) cancels the request; it leaves the batch at the next token

``stream`` validates synchronously (an oversize prompt raises `InvalidInput` before anything runs)
and submits the request at once. `TorchEngine.generate` is ``stream`` collected into a `Generation`.

Token-faithfulness: ``logprob`` is the raw model log-probability of the chosen token (log_softmax of
the unprocessed logits, before temperature and top-p), so the trainer can use it as the behaviour
policy's logprob. A stop token (eos or one of ``stop_token_ids``) is the last of ``token_ids``, with
``finish_reason="stop"``; the proxy leaves it out of the text. A request never makes prompt plus
response longer than the model's ``max_position_embeddings`` (it finishes with "length").

Hot swap: `TorchEngine.load_weights` queues new weights; the engine stops admitting requests, lets the
running ones finish on the weights they started with, swaps, then admits the waiting ones. Each
request reports the single version that produced all its tokens; none fails during a swap.
Supported models: Hugging Face decoder-only LMs with full attention (Llama, Qwen2, Mistral without a
sliding window), since the batch's KV cache is re-padded when requests join.

Threads: the engine sets torch's (process-wide) thread count to ``num_threads``, by default all cores
but one, so the event loop keeps a core. The constructor loads the model synchronously; build the
engine with ``asyncio.to_thread`` where a large model would stall a running loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulmen.errors import InvalidInput, RetryableError

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = ["Generation", "GenerationStream", "SamplingParams", "TokenStep", "TorchEngine"]


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None  # makes one request's sampling reproducible, whatever it is batched with
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidInput(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidInput(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise InvalidInput(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise InvalidInput(f"seed must be an integer or None, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass(frozen=True)
class TokenStep:
    token_id: int
    logprob: float  # raw model logprob of token_id (before temperature / top-p)
    finish_reason: str | None  # "stop" | "length" on the last step, else None


@dataclass(frozen=True)
class Generation:
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"
    model_version: str


class _Request:
    """One request, shared by the event loop (its queue) and the engine thread (the rest)."""

    __slots__ = (
        "cancelled",
        "generated",
        "limit",
        "loop",
        "model_version",
        "params",
        "prompt",
        "queue",
        "rng",
    )

    def __init__(self, prompt: list[int], params: SamplingParams, limit: int) -> None:
        self.prompt = prompt
        self.params = params
        self.limit = limit  # tokens this request may generate: max_tokens capped by the context length
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[TokenStep | BaseException] = asyncio.Queue()
        self.model_version: str | None = None
        self.cancelled = False
        self.generated = 0
        # Each request owns its generator, drawn once per sampled token, so its draws depend on
        # its seed alone, never on its batch-mates.
        self.rng = random.Random(params.seed if params.seed is not None else random.getrandbits(63))


class GenerationStream:
    """The tokens of one request, as they are decoded (see the module docstring)."""

    def __init__(self, engine: TorchEngine, request: _Request) -> None:
        self._engine = engine
        self._request = request
        self._finished = False

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._request.prompt

    @property
    def model_version(self) -> str | None:
        """The weights version serving this request; None only before its first step arrives."""
        return self._request.model_version

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> TokenStep:
        if self._finished:
            raise StopAsyncIteration
        item = await self._request.queue.get()
        if isinstance(item, BaseException):
            self._finished = True
            raise item
        if item.finish_reason is not None:
            self._finished = True
        return item

    async def aclose(self) -> None:
        """Cancel the request if it is still running (idempotent)."""
        if not self._finished:
            self._finished = True
            self._request.cancelled = True

    async def __aenter__(self) -> GenerationStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class TorchEngine:
    """Batched generation on one Hugging Face causal LM, with hot-swappable weights."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_batch: int = 16,
        model_version: str = "base",
        device: str = "cpu",
        dtype: str | None = None,
        num_threads: int | None = None,
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if max_batch < 1:
            raise InvalidInput(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        # The engine thread's torch (OpenMP) threads. Default: all cores but one, which stays for the
        # event loop; an OpenMP team sharing its cores with a busy event loop spins at every barrier
        # (measured on 2 cores: 16 concurrent requests ran ~10x slower with 2 threads than with 1).
        self.num_threads = num_threads or max(1, torch.get_num_threads() - 1)
        self.model_version = model_version
        self.device = torch.device(device)
        # float32 on CPU: bf16 matmuls are slow there, and exact logprobs matter more than memory.
        torch_dtype: Any = getattr(torch, dtype) if dtype else (torch.float32 if device == "cpu" else "auto")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(self.device).eval()
        config = self.model.config
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.max_model_len = int(getattr(config, "max_position_embeddings", None) or 1 << 31)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.tokenizer.eos_token_id
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        if not eos_ids:
            raise InvalidInput(f"model in {model_dir} defines no eos token")
        self.eos_token_id: int = eos_ids[0]
        self._eos_ids = frozenset(eos_ids)
        self._pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else eos_ids[0]

        self._cond = threading.Condition()
        self._inbox: deque[_Request] = deque()  # submitted, not yet admitted
        self._swaps: deque[tuple[dict[str, torch.Tensor], str, asyncio.Future[None]]] = deque()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._batch = _Batch()  # touched by the engine thread only
        # Counters for metrics; "peak_batch" is the most requests ever decoded together.
        self.stats = {"requests": 0, "tokens": 0, "steps": 0, "swaps": 0, "peak_batch": 0}

    # --- lifecycle ----------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the engine thread (idempotent; `stream` also starts it on first use)."""
        self._start()

    def _start(self) -> None:
        if self._stopping:
            raise RetryableError("the engine is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="torch-engine", daemon=True)
            self._thread.start()

    async def close(self) -> None:
        """Stop the engine thread; requests still waiting or running fail with RetryableError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        closed = RetryableError("the engine closed before the request finished")
        for request in [*self._inbox, *self._batch.rows]:
            request.loop.call_soon_threadsafe(request.queue.put_nowait, closed)
        for _, _, future in self._swaps:
            future.get_loop().call_soon_threadsafe(_set_exception, future, closed)
        self._inbox.clear()
        self._swaps.clear()
        self._batch = _Batch()

    # --- requests -----------------------------------------------------------------------------------

    def stream(self, prompt_ids: list[int], params: SamplingParams) -> GenerationStream:
        """Submit a request and return its token stream. Raises InvalidInput on a bad prompt."""
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise InvalidInput("the prompt has no tokens")
        if len(prompt) >= self.max_model_len:
            raise InvalidInput(
                f"the prompt has {len(prompt)} tokens; this model's context is {self.max_model_len} "
                "tokens, prompt and response together"
            )
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise InvalidInput(f"prompt token ids must be in [0, {self.vocab_size})")
        request = _Request(prompt, params, min(params.max_tokens, self.max_model_len - len(prompt)))
        self._start()
        with self._cond:
            self._inbox.append(request)
            self._cond.notify()
        self.stats["requests"] += 1
        return GenerationStream(self, request)

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        """Generate a whole response (see `stream` for what each token carries)."""
        token_ids: list[int] = []
        logprobs: list[float] = []
        finish_reason = "length"
        async with self.stream(prompt_ids, params) as s:
            async for step in s:
                token_ids.append(step.token_id)
                logprobs.append(step.logprob)
                finish_reason = step.finish_reason or finish_reason
            version = s.model_version
        assert version is not None  # set before the first step, and every request yields one
        return Generation(s.prompt_token_ids, token_ids, logprobs, finish_reason, version)

    # --- hot swap -----------------------------------------------------------------------------------

    async def load_weights(self, state_dict: Mapping[str, torch.Tensor], model_version: str) -> None:
        """Swap in new weights once the running requests finish; returns when the swap is done.

        Requests submitted after this returns use the new weights. The tensors are copied into the
        model at swap time, so the caller must not modify them in place until then.
        """
        weights = self._check_state_dict(state_dict)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with self._cond:
            running = self._thread is not None and not self._stopping
            if running:
                self._swaps.append((weights, model_version, future))
                self._cond.notify()
        if not running:
            await asyncio.to_thread(self._swap, weights, model_version)
            return
        await future

    def _check_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Refuse weights that do not fit the model, before the engine drains for them."""
        own = self.model.state_dict()
        unexpected = sorted(set(state_dict) - set(own))
        if unexpected:
            raise InvalidInput(f"weights have keys the model does not: {unexpected[:5]}")
        wrong = [n for n, t in state_dict.items() if tuple(t.shape) != tuple(own[n].shape)]
        if wrong:
            raise InvalidInput(f"weights have the wrong shape for {wrong[:5]}")
        # A missing key is fine only when it names a tensor tied to a provided one (lm_head = embeddings).
        given = {own[n].data_ptr() for n in state_dict}
        missing = sorted(n for n in set(own) - set(state_dict) if own[n].data_ptr() not in given)
        if missing:
            raise InvalidInput(f"weights lack keys {missing[:5]}")
        return dict(state_dict)

    def _swap(self, weights: dict[str, torch.Tensor], model_version: str) -> None:
        import torch

        started = time.perf_counter()
        with torch.no_grad():
            self.model.load_state_dict(weights, strict=False)
        self.model_version = model_version
        self.stats["swaps"] += 1
        log.info("loaded weights %s in %.3f s", model_version, time.perf_counter() - started)

    # --- the engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        import torch

        # torch keeps one setting per process; in the proxy the engine is torch's only user.
        torch.set_num_threads(self.num_threads)
        batch = self._batch
        while True:
            swap = None
            admitted: list[_Request] = []
            with self._cond:
                while not (self._stopping or self._inbox or self._swaps or batch.rows):
                    self._cond.wait()
                if self._stopping:
                    return
                if self._swaps:
                    # Drain: admit nobody until the running requests finish on their weights.
                    if not batch.rows:
                        swap = self._swaps.popleft()
                else:
                    while self._inbox and len(batch.rows) + len(admitted) < self.max_batch:
                        request = self._inbox.popleft()
                        if not request.cancelled:
                            admitted.append(request)
            if swap is not None:
                self._apply_swap(*swap)
                continue
            try:
                with torch.inference_mode():
                    self._iterate(batch, admitted)
            except Exception as e:  # a bug or out of memory: fail this batch, keep serving
                log.exception("generation step failed")
                for request in [*batch.rows, *admitted]:
                    request.loop.call_soon_threadsafe(request.queue.put_nowait, e)
                batch.reset()

    def _apply_swap(
        self, weights: dict[str, torch.Tensor], version: str, future: asyncio.Future[None]
    ) -> None:
        try:
            self._swap(weights, version)
        except Exception as e:
            future.get_loop().call_soon_threadsafe(_set_exception, future, e)
        else:
            future.get_loop().call_soon_threadsafe(_set_result, future)

    def _iterate(self, batch: _Batch, admitted: list[_Request]) -> None:
        """One token for every running request, then the first token of every admitted one."""
        if batch.rows:
            logits = batch.decode(self.model)
            self._emit(batch.rows, logits, batch)
        if admitted:
            for request in admitted:
                request.model_version = self.model_version
            logits = batch.prefill(self.model, admitted, self._pad_id, self.device)
            self._emit(admitted, logits, batch)
            self.stats["peak_batch"] = max(self.stats["peak_batch"], len(batch.rows))
        self.stats["steps"] += 1
        batch.drop_finished()

    def _emit(self, rows: list[_Request], logits: torch.Tensor, batch: _Batch) -> None:
        """Choose the next token of each row, deliver it, and record it as the row's next input."""
        import torch

        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if r.params.temperature > 0]
        if sampled:
            chosen[sampled] = _sample(logits[sampled], [rows[i] for i in sampled])
        chosen_logprobs = logprobs.gather(1, chosen[:, None]).squeeze(1)
        batch.set_next(rows, chosen)
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[_Request, TokenStep]]] = {}
        for request, token, logprob in zip(rows, chosen.tolist(), chosen_logprobs.tolist(), strict=True):
            request.generated += 1
            finish = None
            if token in self._eos_ids or token in request.params.stop_token_ids:
                finish = "stop"
            elif request.generated >= request.limit:
                finish = "length"
            if finish is not None or request.cancelled:
                batch.finished.add(id(request))
            deliveries.setdefault(request.loop, []).append((request, TokenStep(token, logprob, finish)))
        self.stats["tokens"] += len(rows)
        for loop, items in deliveries.items():
            loop.call_soon_threadsafe(_deliver, items)


class _Batch:
    """The running requests and their left-padded KV cache: row i's tokens fill the last columns.

    Every row holds all its tokens but the last one chosen (``next_ids``), which the next decode
    step feeds at position ``positions``. Rows grow in lockstep, so each row's real tokens are a
    suffix of the columns, and dropping leading all-padding columns keeps the cache no longer than
    the longest row.
    """

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.rows: list[_Request] = []
        self.finished: set[int] = set()  # id() of rows to drop after this iteration
        self.cache: Any = None  # transformers DynamicCache
        self.mask: Any = None  # [rows, columns] int64, 1 = real token
        self.next_ids: Any = None  # [rows] int64
        self.positions: Any = None  # [rows] int64

    def decode(self, model: Any) -> torch.Tensor:
        import torch

        ones = torch.ones(len(self.rows), 1, dtype=self.mask.dtype, device=self.mask.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        out = model(
            input_ids=self.next_ids[:, None],
            attention_mask=self.mask,
            position_ids=self.positions[:, None],
            past_key_values=self.cache,
            use_cache=True,
        )
        self.positions = self.positions + 1
        return out.logits[:, -1]

    def prefill(self, model: Any, requests: list[_Request], pad_id: int, device: Any) -> torch.Tensor:
        """Run the prompts of ``requests`` (left-padded together) and merge them into the batch."""
        import torch
        import torch.nn.functional as F
        from transformers import DynamicCache

        width = max(len(r.prompt) for r in requests)
        ids = torch.full((len(requests), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - len(r.prompt) :] = torch.tensor(r.prompt)
            mask[i, width - len(r.prompt) :] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        cache = DynamicCache(config=model.config)
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        lengths = mask.sum(dim=1)
        if not self.rows:
            self.cache, self.mask, self.positions = cache, mask, lengths
            self.next_ids = torch.zeros_like(lengths)
        else:
            columns = max(self.mask.shape[1], width)
            for old, new in zip(self.cache.layers, cache.layers, strict=True):
                old.keys = torch.cat([_pad_kv(old.keys, columns), _pad_kv(new.keys, columns)])
                old.values = torch.cat([_pad_kv(old.values, columns), _pad_kv(new.values, columns)])
            self.mask = torch.cat(
                [F.pad(self.mask, (columns - self.mask.shape[1], 0)), F.pad(mask, (columns - width, 0))]
            )
            self.positions = torch.cat([self.positions, lengths])
            self.next_ids = torch.cat([self.next_ids, torch.zeros_like(lengths)])
        self.rows.extend(requests)
        return out.logits[:, -1]

    def set_next(self, rows: list[_Request], tokens: torch.Tensor) -> None:
        # `rows` is the whole batch (decode) or its tail (prefill): either way the last len(rows).
        self.next_ids[len(self.rows) - len(rows) :] = tokens

    def drop_finished(self) -> None:
        if not self.finished:
            return
        keep = [i for i, r in enumerate(self.rows) if id(r) not in self.finished]
        self.finished.clear()
        if not keep:
            self.reset()
            return
        rows = [self.rows[i] for i in keep]
        index = self.mask.new_tensor(keep)
        mask = self.mask[index]
        start = int(mask.any(dim=0).to(mask.dtype).argmax())  # first column some kept row uses
        for layer in self.cache.layers:
            layer.keys = layer.keys[index, :, start:]
            layer.values = layer.values[index, :, start:]
        self.rows, self.mask = rows, mask[:, start:]
        self.next_ids, self.positions = self.next_ids[index], self.positions[index]


def _pad_kv(x: torch.Tensor, columns: int) -> torch.Tensor:
    """Left-pad a [batch, heads, seq, dim] cache tensor to ``columns`` along seq (masked out)."""
    import torch.nn.functional as F

    return F.pad(x, (0, 0, columns - x.shape[2], 0))


def _sample(logits: torch.Tensor, rows: list[_Request]) -> torch.Tensor:
    """Temperature and top-p sampling for each row, drawing from the row's own seeded generator."""
    import torch

    temperature = logits.new_tensor([r.params.temperature for r in rows])
    top_p = logits.new_tensor([r.params.top_p for r in rows])
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    # Nucleus: keep the smallest prefix whose mass reaches top_p (the most likely token always stays).
    cumulative = sorted_probs.cumsum(dim=-1)
    sorted_probs = sorted_probs.masked_fill(cumulative - sorted_probs >= top_p[:, None], 0.0)
    cumulative = sorted_probs.cumsum(dim=-1)
    # Inverse-CDF draw: one uniform per row from the row's generator, whatever the batch looks like.
    uniform = torch.tensor([r.rng.random() for r in rows], dtype=cumulative.dtype, device=cumulative.device)
    picks = torch.searchsorted(cumulative, (uniform * cumulative[:, -1])[:, None])
    picks = picks.clamp(max=logits.shape[-1] - 1)
    return order.gather(1, picks).squeeze(1)


def _deliver(items: list[tuple[_Request, TokenStep]]) -> None:
    for request, step in items:
        request.queue.put_nowait(step)


def _set_result(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _set_exception(future: asyncio.Future[None], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
