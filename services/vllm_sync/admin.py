"""The admin routes of one vLLM server (dev mode, ``VLLM_SERVER_DEV_MODE=1``), each with a timeout.

Every failure is an `AdminError` naming the route. The routes and their order for a weight swap:
docs/design/vllm-sync.md.
"""

from __future__ import annotations

from typing import Any

import httpx

PAUSE_MODES = ("abort", "wait", "keep")
CANARY_TOKENS = 4
STARTUP_VERSION = "default"  # what vLLM's /weight_info reports before any version is set
# Appended to a LoRA version's name in /weight_info while the server serves it as an adapter on the
# weights it started with: a person watching the server sees the version change, and `served_version`
# still reads the server's own weights as the ones it started with.
ADAPTER_LABEL = " (LoRA adapter)"


class AdminError(Exception):
    """A route of the server did not do its part (the message says which and how)."""


class LoraNotEnabled(AdminError):
    """The server cannot load adapters at run time (no ``--enable-lora`` or no runtime updating)."""


class GroupNotEnabled(AdminError):
    """The server's workers lack Fulmen's worker extension (no ``--worker-extension-cls``)."""


WORKER_EXTENSION = "fulmen.versions.transport.group.WorkerExtension"


class VllmAdmin:
    def __init__(self, url: str, timeout_s: float, api_key: str | None = None) -> None:
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(base_url=self.url, timeout=timeout_s, headers=headers)

    async def close(self) -> None:
        await self.client.aclose()

    async def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = await self.client.request(method, path, **kwargs)
        except httpx.TimeoutException:
            waited = kwargs.get("timeout", self.client.timeout.read)  # this call's own, else the client's
            raise AdminError(f"{method} {path} did not answer within {waited} s") from None
        except httpx.HTTPError as e:
            raise AdminError(f"{method} {path}: {type(e).__name__}: {e}") from None
        if response.status_code >= 400:
            raise AdminError(f"{method} {path} answered {response.status_code}: {response.text[:300]}")
        try:
            return response.json() if response.content else None
        except ValueError:
            return response.text

    async def pause(self, mode: str) -> None:
        await self._call("POST", "/pause", params={"mode": mode})

    async def resume(self) -> None:
        await self._call("POST", "/resume")

    async def reload_weights(self, folder: str) -> None:
        await self._call("POST", "/collective_rpc", json={"method": "reload_weights",
                                                          "kwargs": {"weights_path": folder}})

    async def join_group(self, host: str, port: int, world_size: int, name: str, backend: str = "",
                         timeout_s: float = 60.0) -> list[dict[str, Any]]:
        """Every worker joins the weight group ``name`` met at ``host:port``, as ranks 1..
        (`fulmen.versions.transport.group.WorkerExtension.fulmen_join`); their ranks."""
        kwargs = {"host": host, "port": port, "world_size": world_size, "name": name, "backend": backend,
                  "timeout_s": timeout_s}
        return await self._worker_rpc("fulmen_join", kwargs, timeout_s)

    async def workers(self) -> int:
        """How many workers the server runs (a weight group holds each, beside its sender)."""
        return len(await self._worker_rpc("fulmen_workers", {}, 30.0))

    async def receive_group(self, timeout_s: float) -> list[dict[str, Any]]:
        """Every worker receives the version rank 0 broadcasts into its weights; what each received
        (``version``, ``tensors``, ``bytes``, ``checked``)."""
        return await self._worker_rpc("fulmen_receive", {}, timeout_s)

    async def _worker_rpc(self, method: str, kwargs: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
        try:
            answer = await self._call("POST", "/collective_rpc", json={"method": method, "kwargs": kwargs,
                                                                       "timeout": timeout_s},
                                      timeout=timeout_s + 10)
        except AdminError as e:
            if method in str(e) and "attribute" in str(e):  # vLLM: "... object has no attribute 'fulmen_join'"
                raise GroupNotEnabled(f"the vLLM server at {self.url} has no Fulmen worker extension: start it with "
                                      f"--worker-extension-cls {WORKER_EXTENSION} and shared/ on its PYTHONPATH "
                                      f"({e})") from None
            raise
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list):
            raise AdminError(f"POST /collective_rpc ({method}) answered without results: {str(answer)[:200]}")
        return results

    async def set_version(self, version: str) -> None:
        await self._call("POST", "/update_weight_version", json={"new_version": version})

    async def served_version(self) -> str | None:
        """The version of the server's own weights last set; None while it runs the weights it started
        with (vLLM then reports "default", or a served adapter's name and `ADAPTER_LABEL`)."""
        info = await self._call("GET", "/weight_info")
        version = info.get("weight_version") if isinstance(info, dict) else None
        if not isinstance(version, str) or version == STARTUP_VERSION or version.endswith(ADAPTER_LABEL):
            return None
        return version

    async def label_adapter(self, version: str) -> None:
        """Name the LoRA version served as an adapter in ``/weight_info`` (`ADAPTER_LABEL`)."""
        await self.set_version(version + ADAPTER_LABEL)

    async def reset_prefix_cache(self) -> None:
        await self._call("POST", "/reset_prefix_cache")

    async def load_lora(self, name: str, folder: str) -> None:
        try:
            await self._call("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": folder})
        except AdminError as e:
            if " answered 404" in str(e) or "LoRA is not enabled" in str(e):
                raise LoraNotEnabled(str(e)) from None
            raise

    async def unload_lora(self, name: str) -> None:
        await self._call("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    async def models(self) -> list[str]:
        """The names the server serves: its model, then each loaded adapter."""
        listing = await self._call("GET", "/v1/models")
        try:
            return [str(m["id"]) for m in listing["data"]]
        except (KeyError, TypeError):
            raise AdminError(f"GET /v1/models answered without a model list: {str(listing)[:200]}") from None

    async def model_name(self) -> str:
        """The name the server serves its model under (``GET /v1/models``, the first)."""
        listing = await self._call("GET", "/v1/models")
        try:
            return str(listing["data"][0]["id"])
        except (KeyError, IndexError, TypeError):
            raise AdminError(f"GET /v1/models answered without a model: {str(listing)[:200]}") from None

    async def canary(self, model: str | None, prompt_ids: list[int]) -> list[float]:
        """The log-probabilities of a short greedy completion of fixed token ids: any change of the
        weights changes them, so equal values before and after a load mean the load did nothing.
        ``model`` None: the name the server lists."""
        if model is None:
            model = await self.model_name()
        body = {"model": model, "prompt": prompt_ids, "max_tokens": CANARY_TOKENS, "temperature": 0,
                "logprobs": 0, "return_token_ids": True}
        answer = await self._call("POST", "/v1/completions", json=body)
        try:
            values = answer["choices"][0]["logprobs"]["token_logprobs"]
            return [float(v) for v in values]
        except (KeyError, IndexError, TypeError, ValueError):
            raise AdminError(f"POST /v1/completions (canary) answered without log-probabilities: {str(answer)[:200]}") from None
