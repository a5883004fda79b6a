"""The tool-use demo (`fulmen demo --task tools`, Procfile.tools): the calculator, the demo model's
tokens and template against the proxy's parser, and a shortened run through every service that
trains on whole tool-using conversations."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from demo_runs import run_dev, user_env, write_env

from fulmen.demo import calculator


def test_the_calculator_computes_and_never_raises() -> None:
    assert calculator.calculate("123*456") == "56088"
    assert calculator.calculate(" 7 - 9 ") == "-2"
    for bad in ("123*", "1/2", "__import__('os')", "", None, 5, "1*2*3"):
        assert calculator.calculate(bad) == "error", bad
    call = {"function": {"name": "calculator", "arguments": json.dumps({"expression": "12+30"})}}
    assert calculator.run_tool_call(call) == "42"
    assert calculator.run_tool_call({"function": {"name": "calculator", "arguments": "{not json"}}) == "error"
    assert calculator.run_tool_call({"function": {"name": "search", "arguments": "{}"}}) == "error"


def test_the_demo_refuses_an_unknown_task(tmp_path: Path) -> None:
    """An unknown demo task fails at load, naming the allowed ones, before any preparation."""
    from fulmen.errors import InvalidInput
    from fulmen.settings import DemoSettings, load_settings

    with pytest.raises(InvalidInput, match=r"task .*'arithmetic' or 'tools', got 'chess'"):
        load_settings(DemoSettings, task="chess", data_dir=tmp_path)
    assert not any(tmp_path.iterdir())  # refused before any preparation


def test_a_demonstration_is_what_the_proxy_parses_and_records(tmp_path: Path) -> None:
    """The demo model writes a call in 10 tokens whose text the proxy's parser turns into the
    calculator call, and the conversation re-rendered with the parsed call (as the agent sends it
    back) extends the tokens generated so far: one trajectory, the mask over the model's tokens."""
    from fulmen.demo.tiny_model import load_tiny_model
    from fulmen_algorithm.demos.tools import build_tool_model, sequence_and_mask
    from fulmen_llm_proxy.backends import tool_calls

    build_tool_model(tmp_path, seed=0)
    _, tokenizer = load_tiny_model(tmp_path)
    task = calculator.make_tasks("train", 1, seed=4)[0]
    messages = calculator.demonstrations([task])[0]["messages"]
    ids, mask = sequence_and_mask(tokenizer, messages)
    first = mask.index(1)
    end = first + mask[first:].index(0)
    call_ids = ids[first:end]
    assert len(call_ids) == 10  # prefix token, "a*b" (7 characters), suffix token, end of turn
    text = tokenizer.decode(call_ids, skip_special_tokens=True)
    parsed = tool_calls.parse(text, tool_calls.plan({"tools": [calculator.CALCULATOR]}))
    assert parsed.error is None and parsed.content is None
    (call,) = parsed.tool_calls
    assert json.loads(call["function"]["arguments"]) == {"expression": f"{task['a']}*{task['b']}"}
    assert calculator.run_tool_call(call) == task["answer"]
    # the mask covers exactly the call and the answer, each with its end of turn
    trained = tokenizer.decode([i for i, m in zip(ids, mask, strict=True) if m])
    assert trained == f"{text}<eos>{task['answer']}<eos>"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_shortened_tool_demo_trains_on_tool_trajectories(tmp_path: Path) -> None:
    """`fulmen dev` with the calculator agent and Procfile.tools' settings, after a short warm start:
    the model's calls are parsed and run, the trainer steps on trajectory samples (one per
    conversation: call, tool result, answer), publishes versions, and the run ends by itself."""
    from fulmen.store.redis.embedded import free_port
    from fulmen_algorithm.demos.tools import prepare_tool_demo

    steps = 3
    # A short warm start (the call's format, not yet the copying): prepared here, reused by the demo.
    prepare_tool_demo(tmp_path / ".fulmen" / "demo-tools", n_train=400, n_val=16, until=2.0, max_sft_steps=120,
                      check_every=120)
    overrides = {
        "FULMEN_REDIS_PORT": free_port(), "FULMEN_PROXY_PORT": free_port(), "FULMEN_DASHBOARD_PORT": 0,
        "FULMEN_TOTAL_STEPS": steps, "FULMEN_VAL_EVERY": steps, "FULMEN_GROUPS_PER_STEP": 4, "FULMEN_SEED": 0,
        "FULMEN_MAX_INFLIGHT": 64,
    }
    write_env(tmp_path, ".env.tools", overrides)
    returncode, log = run_dev(tmp_path, user_env(), ["--agent", "examples.calculator_agent:agent", "--no-dashboard"],
                              540)
    assert returncode == 0, log[-6000:]
    assert "run finished: curve" in log, log[-6000:]
    records = [json.loads(line) for line in (tmp_path / ".fulmen" / "run" / "default" / "trainer-metrics.jsonl").read_text().splitlines()]
    assert len(records) >= steps, records
    for record in records:
        ids = record["sample_ids"]
        trajectories = [i for i in ids if "/traj" in i]
        # most conversations went call -> tool -> answer, and the trainer took them whole: the model's
        # tokens of both turns (a call alone is 10 tokens, with the answer 12 to 18)
        assert len(trajectories) >= len(ids) / 2, ids
        assert record["perf/tokens"] / record["perf/samples"] > 11, record
        assert record["loss/ppo_epochs"] == 2 and record["loss/total"] == record["loss/total"]  # trained, finite
    summary = json.loads((tmp_path / ".fulmen" / "run" / "default" / "summary.json").read_text())
    assert summary["steps"] >= steps
    assert Path(tmp_path / summary["final_model"] / "model.safetensors").exists()
