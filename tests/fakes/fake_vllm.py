"""A fake vLLM server on loopback, built on the proxy's torch engine: the admin routes `fulmen vllm-sync`
uses (dev mode) and ``/v1/completions`` with token ids and log-probabilities, with injected faults.

    fake = FakeVllm(model_dir)
    url = await fake.start()          # http://127.0.0.1:<port>
    fake.fault = "hang"               # the next reload_weights never answers
    ...
    await fake.stop()

Faults (``fault``, consumed by the next ``reload_weights``): ``"hang"`` (never answers), ``"500"``
(loads half of the tensors, then answers 500: the weights are now a mix), ``"noop"`` (answers 200,
loads nothing). ``restart()`` stands for a server restart: the base weights again, no version.
While paused, completions wait for the resume, as vLLM's do.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from aiohttp import web
from safetensors.torch import load_file

from fulmen.embedded import free_port
from fulmen_llm_proxy.engine_request import SamplingParams
from fulmen_llm_proxy.torch_engine import TorchEngine


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

    async def start(self) -> str:
        app = web.Application()
        app.add_routes([
            web.post("/pause", self.pause), web.post("/resume", self.resume),
            web.post("/collective_rpc", self.collective_rpc), web.post("/update_weight_version", self.set_version),
            web.get("/weight_info", self.weight_info), web.post("/reset_prefix_cache", self.reset_prefix_cache),
            web.post("/v1/completions", self.completions), web.get("/v1/models", self.models),
        ])
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

    async def restart(self) -> None:
        """As a restarted server: its model folder's weights, no version set, not paused."""
        await self.engine.load_weights(load_file(str(self.model_dir / "model.safetensors")), "base")
        self.version = None
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
        if body.get("method") != "reload_weights":
            return web.json_response({"error": "unknown method"}, status=400)
        self.calls.append("reload_weights")
        fault, self.fault = self.fault, None
        if fault == "hang":
            await self.stopping.wait()
        if fault == "noop":
            return web.json_response({})
        weights = load_file(str(Path(body["kwargs"]["weights_path"]) / "model.safetensors"))
        if fault == "500":
            half = dict(list(weights.items())[: len(weights) // 2])
            await self.engine.load_weights(half, self.engine.model_version)
            return web.json_response({"error": "worker died while loading"}, status=500)
        await self.engine.load_weights(weights, self.engine.model_version)
        return web.json_response({})

    async def set_version(self, request: web.Request) -> web.Response:
        self.version = (await request.json())["new_version"]
        self.calls.append(f"version:{self.version}")
        return web.json_response({})

    async def weight_info(self, request: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.version})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        self.calls.append("reset_prefix_cache")
        return web.json_response({})

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": str(self.model_dir), "object": "model"}]})

    async def completions(self, request: web.Request) -> web.Response:
        body: dict[str, Any] = await request.json()
        await self.resumed.wait()
        prompt = body["prompt"]
        params = SamplingParams(max_tokens=int(body.get("max_tokens", 16)), temperature=float(body.get("temperature", 1)))
        g = await self.engine.generate(list(prompt), params)
        choice = {"index": 0, "text": "", "token_ids": g.token_ids, "finish_reason": g.finish_reason,
                  "logprobs": {"token_logprobs": g.logprobs}}
        return web.json_response({"choices": [choice], "prompt_token_ids": g.prompt_token_ids})
