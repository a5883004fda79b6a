"""The torch backend's generation engine: continuous batching of concurrent requests on one model.

Entry points `TorchEngine.stream`, `TorchEngine.generate` and `TorchEngine.load_weights` (hot swap
between batches). Batching, token-faithfulness, threads and supported models: docs/design/proxy.md.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fulmen.errors import InvalidInput, RetryableError
from fulmen.versions.model_version import non_finite_tensors
from fulmen_llm_proxy.backends.base import BASE_MODEL_VERSION
from fulmen_llm_proxy.backends.torch.batch import Batch, sample_rows
from fulmen_llm_proxy.backends.torch.lora import LoraSwap, prepare_lora, set_lora
from fulmen_llm_proxy.backends.torch.request import Generation, Request, SamplingParams, TokenStep

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

__all__ = ["Generation", "GenerationStream", "SamplingParams", "TokenStep", "TorchEngine"]

DEFAULT_MAX_BATCH = 16
# The context of a model whose config states none: only memory bounds prompt plus response.
UNBOUNDED_CONTEXT = 1 << 31


class GenerationStream:
    """The tokens of one request, as they are decoded (see the module docstring)."""

    def __init__(self, engine: TorchEngine, request: Request) -> None:
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
        max_batch: int = DEFAULT_MAX_BATCH,
        model_version: str = BASE_MODEL_VERSION,
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
        # event loop: an OpenMP team that shares its cores with a busy event loop spins at every
        # barrier, which costs far more than the extra core gains.
        self.num_threads = num_threads or max(1, torch.get_num_threads() - 1)
        self.model_version = model_version
        self.model_dir = Path(model_dir)
        self._base_weights: dict[str, torch.Tensor] = {}  # LoRA versions merge onto these (see `fulmen.versions.lora`)
        # LoRA applied beside the base weights: a forward hook per adapted linear layer (see `_set_lora`)
        self._lora_hooks: dict[str, Any] = {}
        self._weights_are_base = True  # no full or delta version loaded since start: LoRA can be applied
        self.device = torch.device(device)
        # float32 on CPU: bf16 matmuls are slow there, and exact logprobs matter more than memory.
        torch_dtype: Any = getattr(torch, dtype) if dtype else (torch.float32 if device == "cpu" else "auto")
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).to(self.device).eval()
        config = self.model.config
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.max_model_len = int(getattr(config, "max_position_embeddings", None) or UNBOUNDED_CONTEXT)
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
        self._inbox: deque[Request] = deque()  # submitted, not yet admitted
        self._swaps: deque[tuple[dict[str, torch.Tensor], str, asyncio.Future[None]]] = deque()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._batch = Batch()  # touched by the engine thread only
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
        self._batch = Batch()

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
        request = Request(prompt, params, min(params.max_tokens, self.max_model_len - len(prompt)))
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

    async def load_weights(
        self, state_dict: Mapping[str, torch.Tensor], model_version: str, *, lora: Mapping[str, Any] | None = None,
        partial: bool = False,
    ) -> None:
        """Swap in new weights once the running requests finish; returns when the swap is done.

        Requests submitted after this returns use the new weights. The tensors are copied into the
        model at swap time, so the caller must not modify them in place until then. With ``lora``
        (the version's LoRA description), ``state_dict`` is an adapter: served beside the base weights
        (each adapted layer adds ``scaling · B(A x)``, `_set_lora`) while the model holds the base, else
        merged onto the base weights of the model folder, the modules it does not adapt getting their
        base weights back. ``partial``:
        the tensors a delta changed (`fulmen.versions.delta`); the others keep their values.
        """
        weights: Any
        if lora is not None and self._weights_are_base and not partial:
            # the served weights are the base: the adapter runs beside them, and a new version swaps
            # only its small tensors (no merge, no copy of the adapted layers)
            weights = await asyncio.to_thread(self._prepare_lora, state_dict, lora)
        elif lora is not None:
            from fulmen.versions.lora import merge_lora

            merged = await asyncio.to_thread(merge_lora, state_dict, lora, self._base_weight)
            # a module an earlier version adapted and this one does not goes back to its base weight
            state_dict = {**{n: w for n, w in self._base_weights.items() if n not in merged}, **merged}
            weights = await asyncio.to_thread(self._check_state_dict, state_dict, True)
        else:
            # reads every weight (its finiteness): off the event loop, which keeps serving meanwhile
            weights = await asyncio.to_thread(self._check_state_dict, state_dict, partial)
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

    def _base_weight(self, name: str) -> torch.Tensor:
        """A weight of the model folder (the base every LoRA version is merged onto), read once."""
        if name not in self._base_weights:
            from safetensors import safe_open

            for path in sorted(self.model_dir.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as f:
                    if name in f.keys():  # noqa: SIM118 - safe_open has keys(), not __contains__
                        own = self.model.state_dict()[name]
                        self._base_weights[name] = f.get_tensor(name).to(own.dtype)
                        break
            else:
                raise InvalidInput(f"the adapter changes {name!r}, which the base model in {self.model_dir} lacks")
        return self._base_weights[name]

    def _check_state_dict(self, state_dict: Mapping[str, torch.Tensor], partial: bool = False) -> dict[str, torch.Tensor]:
        """Refuse weights that do not fit the model, before the engine drains for them. ``partial``:
        the weights of some modules only (a merged adapter)."""
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
        if missing and not partial:
            raise InvalidInput(f"weights lack keys {missing[:5]}")
        broken = non_finite_tensors(state_dict)
        if broken:  # a NaN weight answers garbage to every call: keep serving the weights we have
            raise InvalidInput(f"weights hold NaN or infinite values in {broken[:5]}")
        return dict(state_dict)

    def _prepare_lora(self, adapter: Mapping[str, torch.Tensor], lora: Mapping[str, Any]) -> LoraSwap:
        return prepare_lora(self.model, self.model_dir, adapter, lora)

    def _set_lora(self, layers: Mapping[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        set_lora(self.model, self._lora_hooks, layers, scaling)

    def _swap(self, weights: dict[str, torch.Tensor] | LoraSwap, model_version: str) -> None:
        import torch

        started = time.perf_counter()
        if isinstance(weights, LoraSwap):
            self._set_lora(weights.layers, weights.scaling)
        else:
            self._set_lora({}, 0.0)
            with torch.no_grad():
                self.model.load_state_dict(weights, strict=False)
            self._weights_are_base = False
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
            admitted: list[Request] = []
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

    def _iterate(self, batch: Batch, admitted: list[Request]) -> None:
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

    def _emit(self, rows: list[Request], logits: torch.Tensor, batch: Batch) -> None:
        """Choose the next token of each row, deliver it, and record it as the row's next input."""
        import torch

        logits = logits.float()
        logprobs = torch.log_softmax(logits, dim=-1)
        chosen = logprobs.argmax(dim=-1)
        sampled = [i for i, r in enumerate(rows) if r.params.temperature > 0]
        if sampled:
            chosen[sampled] = sample_rows(logits[sampled], [rows[i] for i in sampled])
        chosen_logprobs = logprobs.gather(1, chosen[:, None]).squeeze(1)
        batch.set_next(rows, chosen)
        deliveries: dict[asyncio.AbstractEventLoop, list[tuple[Request, TokenStep]]] = {}
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


def _deliver(items: list[tuple[Request, TokenStep]]) -> None:
    for request, step in items:
        request.queue.put_nowait(step)


def _set_result(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _set_exception(future: asyncio.Future[None], error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
