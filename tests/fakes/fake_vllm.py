"""A fake vLLM server on loopback, built on the proxy's torch engine: the admin routes `fulmen vllm-sync`
uses (dev mode) and ``/v1/completions`` with token ids and log-probabilities, with injected faults.

    fake = FakeVllm(model_dir)
    url = await fake.start()          # http://127.0.0.1:<port>
    fake.fault = "hang"               # the next reload_weights never answers
    ...
    await fake.stop()

Faults (``fault``, consumed by the next ``reload_weights``): ``"hang"`` (never answers), ``"500"``
(loads half of the tensors, then answers 500: the weights are now a mix), ``"applied-500"`` (loads
them all, then answers 500), ``"noop"`` (answers 200, loads nothing). ``restart()`` stands for a server restart: the base weights again, no version, no
adapter. While paused, completions wait for the resume, as vLLM's do.

With ``worker_extension`` (``--worker-extension-cls`` Fulmen's `WorkerExtension`) its one worker answers
the weight group's ``/collective_rpc`` methods (join, receive: the tensors received go into the
engine's weights); without it those calls fail as vLLM's do (no such attribute).

With ``lora_enabled`` (vLLM's ``--enable-lora`` with runtime updating) it loads PEFT adapter folders
under a name (``/v1/load_lora_adapter``; a server without it answers 404, as vLLM does), lists them
in ``/v1/models``, and serves a completion whose ``model`` names one with the base model's weights
plus that adapter (an engine of its own per adapter). ``requested_models`` records each
completion's ``model``.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from aiohttp import web
from safetensors.torch import load_file

from fulmen.store.redis.embedded import free_port
from fulmen.versions.transport.group import WorkerExtension
from fulmen_llm_proxy.backends.torch.engine import TorchEngine
from fulmen_llm_proxy.backends.torch.request import SamplingParams


class FakeVllm:
    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.engine = TorchEngine(model_dir, max_batch=4)
        self.version: str | None = None
        self.fault: str | None = None
        self.resumed = asyncio.Event()
        self.resumed.set()
        self.calls: list[str] = []  # admin routes, in order
        self.runner: web.AppRunner | None = None
        self.stopping = asyncio.Event()  # ends a hanging route
        self.url = ""
        self.lora_enabled = False
        self.adapters: dict[str, TorchEngine] = {}
        self.requested_models: list[str] = []
        self.worker_extension = False
        self.worker = _Worker()

    async def start(self) -> str:
        app = web.Application()
        app.add_routes([
            web.post("/pause", self.pause), web.post("/resume", self.resume),
            web.post("/collective_rpc", self.collective_rpc), web.post("/update_weight_version", self.set_version),
            web.get("/weight_info", self.weight_info), web.post("/reset_prefix_cache", self.reset_prefix_cache),
            web.post("/v1/completions", self.completions), web.get("/v1/models", self.models),
        ])
        if self.lora_enabled:
            app.add_routes([web.post("/v1/load_lora_adapter", self.load_lora),
                            web.post("/v1/unload_lora_adapter", self.unload_lora)])
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        port = free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        await self.engine.start()
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    async def stop(self) -> None:
        self.stopping.set()
        if self.runner is not None:
            await self.runner.cleanup()
        await self.engine.close()
        for engine in self.adapters.values():
            await engine.close()

    async def restart(self) -> None:
        """As a restarted server: its model folder's weights, no version set, no adapter, not paused."""
        await self.engine.load_weights(load_file(str(self.model_dir / "model.safetensors")), "base")
        self.version = None
        for engine in self.adapters.values():
            await engine.close()
        self.adapters.clear()
        self.resumed.set()

    # --- routes -------------------------------------------------------------------------------------

    async def pause(self, request: web.Request) -> web.Response:
        self.calls.append(f"pause:{request.query.get('mode', '')}")
        self.resumed.clear()
        return web.json_response({})

    async def resume(self, request: web.Request) -> web.Response:
        self.calls.append("resume")
        self.resumed.set()
        return web.json_response({})

    async def collective_rpc(self, request: web.Request) -> web.Response:
        body = await request.json()
        if str(body.get("method")).startswith("fulmen_"):
            return await self._worker_rpc(body["method"], body.get("kwargs") or {})
        if body.get("method") != "reload_weights":
            return web.json_response({"error": "unknown method"}, status=400)
        self.calls.append("reload_weights")
        fault, self.fault = self.fault, None
        if fault == "hang":
            await self.stopping.wait()
        if fault == "noop":
            return web.json_response({})
        weights = load_file(str(Path(body["kwargs"]["weights_path"]) / "model.safetensors"))
        if fault == "applied-500":  # every tensor loaded, then the answer lost
            await self.engine.load_weights(weights, self.engine.model_version)
            return web.json_response({"error": "the reply was lost"}, status=500)
        if fault == "500":
            half = dict(list(weights.items())[: len(weights) // 2])
            await self.engine.load_weights(half, self.engine.model_version)
            return web.json_response({"error": "worker died while loading"}, status=500)
        await self.engine.load_weights(weights, self.engine.model_version)
        return web.json_response({})

    async def _worker_rpc(self, method: str, kwargs: dict[str, Any]) -> web.Response:
        if not self.worker_extension:
            return web.json_response({"error": f"'CPUWorker' object has no attribute '{method}'"}, status=500)
        self.calls.append(method)
        try:
            result = await asyncio.to_thread(getattr(self.worker, method), **kwargs)
        except Exception as e:  # as vLLM answers a worker's exception
            return web.json_response({"error": f"{type(e).__name__}: {e}"}, status=500)
        if self.worker.received is not None:
            received, self.worker.received = self.worker.received, None
            await self.engine.load_weights(received, self.engine.model_version)
        return web.json_response({"results": [result]})

    async def set_version(self, request: web.Request) -> web.Response:
        self.version = (await request.json())["new_version"]
        self.calls.append(f"version:{self.version}")
        return web.json_response({})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.version or "default"})  # vLLM's before any is set

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.calls.append("reset_prefix_cache")
        return web.json_response({})

    async def models(self, request: web.Request) -> web.Response:
        names = [str(self.model_dir), *self.adapters]
        return web.json_response({"object": "list", "data": [{"id": n, "object": "model"} for n in names]})

    async def load_lora(self, request: web.Request) -> web.Response:
        body = await request.json()
        name, folder = body["lora_name"], Path(body["lora_path"])
        self.calls.append(f"load_lora:{name}")
        config = json.loads((folder / "adapter_config.json").read_text())
        engine = TorchEngine(self.model_dir, max_batch=4)
        await engine.start()
        lora = {"r": config["r"], "alpha": config["lora_alpha"], "scaling": config["lora_alpha"] / config["r"]}
        await engine.load_weights(load_file(str(folder / "adapter_model.safetensors")), name, lora=lora)
        self.adapters[name] = engine
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload_lora(self, request: web.Request) -> web.Response:
        name = (await request.json())["lora_name"]
        self.calls.append(f"unload_lora:{name}")
        engine = self.adapters.pop(name, None)
        if engine is None:
            return web.json_response({"error": {"message": f"The lora adapter '{name}' cannot be found."}}, status=404)
        await engine.close()
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def completions(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = await request.json()
        await self.resumed.wait()
        model = str(body.get("model"))
        self.requested_models.append(model)
        engine = self.adapters.get(model, self.engine)
        if engine is self.engine and model != str(self.model_dir) and model != "tiny":
            return web.json_response({"error": {"message": f"The model `{model}` does not exist."}}, status=404)
        prompt = body["prompt"]
        params = SamplingParams(max_tokens=int(body.get("max_tokens", 16)), temperature=float(body.get("temperature", 1)))
        g = await engine.generate(list(prompt), params)
        choice = {"index": 0, "text": "", "token_ids": g.token_ids, "finish_reason": g.finish_reason,
                  "logprobs": {"token_logprobs": g.logprobs}}
        return web.json_response({"choices": [choice], "prompt_token_ids": g.prompt_token_ids})


class _Worker(WorkerExtension):
    """The fake's one worker: what it receives is handed to the engine after the call."""

    def __init__(self) -> None:
        self.received: dict[str, Any] | None = None

    def fulmen_load(self, weights: Any) -> None:
        self.received = dict(weights)

    def fulmen_worker_rank(self) -> int:
        return 0
