"""The agent SDK without a runner: signatures, reward checks, resources, proxy choice, span binding."""

from __future__ import annotations

import math

import pytest

import fulmen
from fulmen.errors import FulmenError, InvalidInput
from fulmen.records import ProxyEndpoint
from fulmen.sdk.agent import load_agent, wanted_parameters
from fulmen.sdk.resources import MissingLLM, PromptTemplate, llm_for_attempt, prompt_template_of
from fulmen.store.registry import pick_proxy
from fulmen.telemetry import semconv
from fulmen.telemetry.tracing import bind, rollout_trace_id, setup_tracing


def test_parameters_are_matched_by_name() -> None:
    """After the task, an agent may ask for llm, prompt_template, rollout and resources, in any order."""

    def agent(task, rollout, llm, extra=1):  # type: ignore[no-untyped-def]
        return 0.0

    assert wanted_parameters(agent, "agent") == ("rollout", "llm")


def test_unknown_parameter_is_refused_with_the_known_names() -> None:
    """A parameter the runner cannot supply is an error at load time that lists what it can."""
    with pytest.raises(InvalidInput, match=r"parameter 'client' unknown.*llm, prompt_template, rollout, resources"):
        fulmen.rollout(lambda task, client: 0.0)


def test_agent_without_a_task_parameter_is_refused() -> None:
    """An agent must take the task first."""
    with pytest.raises(InvalidInput, match="task as its first parameter"):
        fulmen.rollout(lambda: 0.0)


def test_prompt_rollout_needs_a_prompt_template() -> None:
    """@prompt_rollout insists on a prompt_template parameter."""
    with pytest.raises(InvalidInput, match="prompt_template"):
        fulmen.prompt_rollout(lambda task, llm: 0.0)
    agent = fulmen.prompt_rollout(lambda task, prompt_template: 0.0)
    assert agent.wants("prompt_template")


def test_decorated_function_stays_callable() -> None:
    """A decorated agent can still be called directly, e.g. from the user's own tests."""

    @fulmen.rollout
    def agent(task, llm):  # type: ignore[no-untyped-def]
        return task * 2

    assert agent(21, None) == 42


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nocolon", "module:function"),
        ("no_such_module_xyz:agent", "cannot import module 'no_such_module_xyz'"),
        ("runner_test_agents:missing", "has no 'missing'"),
        ("runner_test_agents:NOT_AN_AGENT", "is not an agent but a int value"),
        ("runner_test_agents:wrong_signature", "parameter 'client' unknown"),
    ],
)
def test_load_agent_errors_say_what_is_wrong(spec: str, message: str) -> None:
    """--agent problems are reported with what is wrong, before anything runs."""
    with pytest.raises(InvalidInput, match=message):
        load_agent(spec)


def test_load_agent_accepts_classes_and_functions() -> None:
    """A class is instantiated; a decorated function is used as is."""
    assert type(load_agent("runner_test_agents:ClassAgent")).__name__ == "ClassAgent"
    assert load_agent("runner_test_agents:noop").wants("llm")


@pytest.mark.parametrize("bad", [math.nan, math.inf, "1.0", None, [1.0]])
def test_reward_must_be_a_finite_number(bad: object) -> None:
    """NaN, infinity and non-numbers are refused with a clear error."""
    with pytest.raises(InvalidInput, match="reward"):
        fulmen.emit_reward(bad)  # type: ignore[arg-type]


def test_named_rewards_need_a_known_primary() -> None:
    """The primary reward must be one of the named ones; an empty mapping is refused."""
    with pytest.raises(InvalidInput, match="primary reward 'z'"):
        fulmen.emit_reward({"a": 1.0}, primary="z")
    with pytest.raises(InvalidInput, match="empty"):
        fulmen.emit_reward({})
    assert fulmen.emit_reward({"a": 0.5, "b": 1.0}) == 0.5  # default primary: the first


def test_emits_inside_a_binding_land_in_the_buffer_with_its_ids() -> None:
    """Spans emitted in an attempt's context carry its ids, one trace per rollout, parents kept."""
    _, buffer = setup_tracing("test", set_global=False)
    with bind("r1", "r1.1"), fulmen.operation("outer"):
        fulmen.emit_message("hi")
    fulmen.emit_message("outside")  # bound to nothing: dropped
    spans = buffer.take("r1.1")
    assert [s.name for s in spans] == ["fulmen.message", "outer"]
    message, outer = spans
    assert message.parent_id == outer.span_id
    assert {s.trace_id for s in spans} == {f"{rollout_trace_id('r1'):032x}"}
    assert message.attributes[semconv.ROLLOUT_ID] == "r1"
    assert message.attributes[semconv.MESSAGE] == "hi"
    assert buffer.take() == []


def test_emit_object_needs_json() -> None:
    """emit_object refuses what JSON cannot carry (a cycle); other objects are stringified."""
    loop: list[object] = []
    loop.append(loop)
    with pytest.raises(InvalidInput, match="JSON"):
        fulmen.emit_object(loop)
    _, buffer = setup_tracing("test", set_global=False)
    with bind("r1", "r1.1"):
        fulmen.emit_object({"when": {1}})
    (span,) = buffer.take("r1.1")
    assert span.attributes[semconv.OBJECT_JSON] == '{"when": "{1}"}'


def test_prompt_templates() -> None:
    """Both template engines format; a resource may be a string or a dict."""
    assert PromptTemplate("Solve {q}").format(q="1+1") == "Solve 1+1"
    assert PromptTemplate("Solve $q", engine="string.Template").format(q="2") == "Solve 2"
    assert prompt_template_of({"template": "x {a}"}).format(a=1) == "x 1"
    with pytest.raises(ValueError, match="prompt template resource"):
        prompt_template_of(3)


def test_llm_base_url_carries_the_attempt() -> None:
    """The agent's base URL is the proxy's with the attempt prefix; ids also travel in headers."""
    llm = llm_for_attempt({"model": "tiny", "sampling_parameters": {"temperature": 0.7}}, "http://h:8000/v1", "r1", "r1.2")
    assert llm.base_url == "http://h:8000/rollout/r1/attempt/r1.2/v1"
    assert llm.headers == {semconv.HEADER_ROLLOUT_ID: "r1", semconv.HEADER_ATTEMPT_ID: "r1.2"}
    assert (llm.model, llm.sampling_parameters) == ("tiny", {"temperature": 0.7})
    named = llm_for_attempt({}, "https://h:8000", "r1", "r1.2", model="served")
    assert (named.base_url, named.model) == ("https://h:8000/rollout/r1/attempt/r1.2/v1", "served")
    assert llm_for_attempt({"model": "tiny"}, "https://h:8000", "r1", "r1.2", model="served").model == "tiny"


def test_missing_llm_says_what_to_start() -> None:
    """An agent handed no LLM gets an error naming what to start, not an AttributeError on None."""
    llm = MissingLLM("no proxy is registered")
    assert not llm
    llm.close()  # the runner closes every attempt's LLM: nothing to do here
    with pytest.raises(FulmenError, match=r"no LLM for this attempt \(llm.base_url\): no proxy is registered"):
        _ = llm.base_url


def test_proxy_choice_is_stable_and_spreads() -> None:
    """A rollout always gets the same proxy; rollouts spread over all; a leaving proxy moves only its own."""
    proxies = [ProxyEndpoint(f"p{i}", f"http://p{i}") for i in range(4)]
    picks = {f"r{i}": pick_proxy(proxies, f"r{i}").proxy_id for i in range(400)}
    assert picks == {f"r{i}": pick_proxy(list(reversed(proxies)), f"r{i}").proxy_id for i in range(400)}
    assert all(60 < list(picks.values()).count(f"p{i}") < 140 for i in range(4))
    fewer = proxies[1:]
    moved = [r for r, p in picks.items() if p != "p0" and pick_proxy(fewer, r).proxy_id != p]
    assert moved == []


def test_each_event_loop_gets_its_own_http_pool() -> None:
    """A pool is bound to the loop that made it: a later loop (which may reuse the first one's id())
    gets a new pool, never one bound to a closed loop."""
    import asyncio
    import gc
    import weakref

    from fulmen.sdk import resources

    async def pool() -> int:
        return id(resources._async_http())

    pools, loops = [], []
    for _ in range(5):
        loop = asyncio.new_event_loop()
        pools.append((loop.run_until_complete(pool()), loop.run_until_complete(pool())))
        loops.append(weakref.ref(loop))
        loop.close()
        del loop
        gc.collect()
    assert all(first == second for first, second in pools)  # one pool per loop, shared by its calls
    # Its pool does not keep a closed loop alive, so the loop and its entry go (other tests' live
    # loops may still hold pools: only this test's loops are checked).
    assert all(ref() is None for ref in loops)


def test_a_script_that_never_closes_the_http_pool_ends_without_unclosed_session_warnings() -> None:
    """A user's ``asyncio.run`` that calls through the SDK's pool and never calls `close_async_pool`:
    the pool is closed as the loop shuts down, so aiohttp has nothing to warn about at exit."""
    import socket
    import subprocess
    import sys

    refusing = socket.socket()  # bound, never listening: a connection to it is refused
    refusing.bind(("127.0.0.1", 0))
    port = refusing.getsockname()[1]
    script = f"""
import asyncio, gc
from fulmen.sdk.resources import _async_http

async def main():
    try:
        await _async_http().get("http://127.0.0.1:{port}/", timeout=5)
    except Exception as e:
        print("request failed as expected:", type(e).__name__)

asyncio.run(main())
gc.collect()
"""
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    finally:
        refusing.close()
    assert done.returncode == 0, done.stderr
    assert "request failed as expected" in done.stdout
    assert "Unclosed" not in done.stderr, done.stderr


def test_the_sdk_names_on_fulmen_are_its_functions_and_kept_once_looked_up() -> None:
    """`fulmen.emit_reward` and friends are the SDK's own objects (`LitAgent` is `Agent`), imported on
    first use and then kept on the module: an agent that emits per call pays no import each time."""
    import fulmen.sdk.agent
    import fulmen.sdk.emit

    assert fulmen.emit_reward is fulmen.sdk.emit.emit_reward and fulmen.LitAgent is fulmen.sdk.agent.Agent
    assert fulmen.emit_message is fulmen.sdk.emit.emit_message
    assert vars(fulmen)["emit_message"] is fulmen.sdk.emit.emit_message
    with pytest.raises(AttributeError, match="no attribute 'emit_rewards'"):
        fulmen.emit_rewards  # noqa: B018
