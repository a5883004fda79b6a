"""The tool-use demo's preparation (`fulmen demo --task tools`): three-digit multiplication tasks, a
tiny Llama from scratch, and an SFT warm start on whole tool-using conversations.

The warm start stops deliberately partial, at ``until``. Why: docs/design/demo.md.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil
from pathlib import Path
from typing import Any

from fulmen.demo import arithmetic, calculator
from fulmen.demo.warm_start import WarmStartPlan, install_model, preparing, warm_start
from fulmen_algorithm.demos.arithmetic import DemoPaths

log = logging.getLogger(__name__)

N_TRAIN, N_VAL = 4000, 200
# Checks of the accuracy on the first CHECK_TASKS training tasks wait for a loss below 0.5: accuracy
# stays 0 until the model starts copying digits (the loss is ~0.65 before, with the format already
# right); checks before that only cost time. The last step is checked whatever the loss.
WARM_START = WarmStartPlan(until=0.3, max_steps=600, batch_size=32, lr=3e-3, check_every=5, log_every=20,
                           check_below_loss=0.5, check_last_step=True)
CHECK_TASKS = 100
INITIALIZER_RANGE = 0.02
MAX_POSITIONS = 256  # a whole conversation is ~55 tokens
CALL_TOKENS, ANSWER_TOKENS = 12, 8  # the call: prefix, 7 characters, suffix, end of turn
TOOL_SAMPLING = {"temperature": 1.0}  # the agent sets max_tokens per turn


# The demo's own tokenizer and template, so that a 145k-parameter model learns the task in minutes:
# the tool's constant JSON around the expression is one token each side (added, not special: it
# decodes to its text, which the proxy's parser reads), and the tools' system turn names them only.
# The call the model writes is still exactly the Hermes/Qwen text the proxy parses.
CALL_PREFIX = '<tool_call>{"name": "calculator", "arguments": {"expression": "'
CALL_SUFFIX = '"}}</tool_call>'
TOOLS_TURN = ("{% if tools %}<|system|>{% for tool in tools %}{{ (tool['function'] if tool['function'] is defined "
              "else tool)['name'] }} {% endfor %}{{ eos_token }}{% endif %}")


def build_tool_model(folder: Path, seed: int) -> None:
    """The tiny Llama with the demo's tokens and chat template, saved in ``folder``."""
    from fulmen.demo.tiny_model import (
        CHAT_TEMPLATE,
        TOOLS_PREAMBLE,
        TinyModelSpec,
        build_tiny_model,
        load_tiny_model,
    )

    spec = TinyModelSpec(initializer_range=INITIALIZER_RANGE, max_position_embeddings=MAX_POSITIONS)
    build_tiny_model(folder, spec, seed=seed)
    model, tokenizer = load_tiny_model(folder)
    tokenizer.add_tokens([CALL_PREFIX, CALL_SUFFIX])
    tokenizer.chat_template = CHAT_TEMPLATE.replace(TOOLS_PREAMBLE, TOOLS_TURN)
    model.resize_token_embeddings(len(tokenizer), mean_resizing=False)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def _render(tokenizer: Any, messages: list[dict[str, Any]], generation: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tools=[calculator.CALCULATOR], add_generation_prompt=generation,
                                         tokenize=False)
    return tokenizer(text, add_special_tokens=False).input_ids


def sequence_and_mask(tokenizer: Any, messages: list[dict[str, Any]]) -> tuple[list[int], list[int]]:
    """The conversation's token ids and a mask over the assistant's tokens (each turn's eos included),
    as a trajectory sample of the same conversation has them."""
    ids: list[int] = []
    mask: list[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _render(tokenizer, messages[:i], True)
        full = _render(tokenizer, messages[: i + 1], False)
        if full[: len(prompt)] != prompt or prompt[: len(ids)] != ids:
            raise ValueError("the chat template does not render the conversation as a growing prefix")
        mask += [0] * (len(prompt) - len(ids)) + [1] * (len(full) - len(prompt))
        ids = full
    return ids, mask


def _generate(model: Any, tokenizer: Any, prompts: list[list[int]], max_tokens: int) -> list[str]:
    import torch

    width = max(len(x) for x in prompts)
    pad = tokenizer.pad_token_id
    batch = torch.tensor([[pad] * (width - len(x)) + x for x in prompts])
    attention = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in prompts])
    with torch.no_grad():
        out = model.generate(input_ids=batch, attention_mask=attention, max_new_tokens=max_tokens, do_sample=False,
                             pad_token_id=pad, eos_token_id=tokenizer.eos_token_id)
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def _parse_call(text: str) -> dict[str, Any] | None:
    """The single calculator call of a turn's text, as the proxy would parse it, or None."""
    start, end = text.find("<tool_call>"), text.find("</tool_call>")
    if start < 0 or end < start:
        return None
    try:
        obj = json.loads(text[start + len("<tool_call>"):end])
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") != calculator.TOOL_NAME:
        return None
    arguments = obj.get("arguments")
    if not isinstance(arguments, dict) or not isinstance(arguments.get("expression"), str):
        return None
    return {"id": "call_0", "type": "function",
            "function": {"name": calculator.TOOL_NAME, "arguments": json.dumps(arguments)}}


def greedy_accuracy(model: Any, tokenizer: Any, tasks: list[arithmetic.Task]) -> float:
    """The agent loop of examples/calculator_agent.py, greedy, batched, in this process."""
    model.eval()
    first = [[{"role": "user", "content": t["question"]}] for t in tasks]
    replies = _generate(model, tokenizer, [_render(tokenizer, m, True) for m in first], CALL_TOKENS)
    rewards = [0.0] * len(tasks)
    second: list[tuple[int, list[dict[str, Any]]]] = []
    for i, (messages, reply) in enumerate(zip(first, replies, strict=True)):
        call = _parse_call(reply)
        if call is None:
            rewards[i] = calculator.reward(tasks[i], reply)
            continue
        second.append((i, [*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_0", "content": calculator.run_tool_call(call)}]))
    if second:
        answers = _generate(model, tokenizer, [_render(tokenizer, m, True) for _, m in second], ANSWER_TOKENS)
        for (i, _), answer in zip(second, answers, strict=True):
            rewards[i] = calculator.reward(tasks[i], answer)
    model.train()
    return sum(rewards) / len(tasks)


def prepare_tool_demo(folder: Path, *, seed: int = 0, n_train: int = N_TRAIN, n_val: int = N_VAL,
                      until: float = WARM_START.until, max_sft_steps: int = WARM_START.max_steps,
                      check_every: int = WARM_START.check_every) -> DemoPaths:
    """Idempotent: a folder prepared before is reused as it is. ``check_every``: SFT steps between two
    checks of the greedy accuracy (the slow part). One process at a time prepares a folder."""
    paths = DemoPaths(folder / "model", folder / "train.jsonl", folder / "val.jsonl")
    with preparing(folder):
        if (paths.model / "config.json").exists() and paths.train.exists() and paths.val.exists():
            log.info("tool demo prepared before in %s", folder)
        else:
            plan = dataclasses.replace(WARM_START, until=until, max_steps=max_sft_steps, check_every=check_every)
            _build_tool_demo(folder, paths, seed, n_train, n_val, plan)
    return paths


def _build_tool_demo(folder: Path, paths: DemoPaths, seed: int, n_train: int, n_val: int, plan: WarmStartPlan) -> None:
    import torch

    from fulmen.demo.tiny_model import load_tiny_model

    torch.manual_seed(seed)
    train = calculator.make_tasks("train", n_train, seed=seed)
    arithmetic.write_jsonl(paths.train, train)
    arithmetic.write_jsonl(paths.val, calculator.make_tasks("val", n_val, seed=seed))
    staging = folder / ".model-staging"
    shutil.rmtree(staging, ignore_errors=True)
    build_tool_model(staging, seed)
    model, tokenizer = load_tiny_model(staging)
    examples = [sequence_and_mask(tokenizer, d["messages"]) for d in calculator.demonstrations(train)]
    check = train[:CHECK_TASKS]
    step, accuracy = warm_start(model, examples, tokenizer.pad_token_id, lambda: greedy_accuracy(model, tokenizer, check),
                                plan, seed=seed, name="tool warm start")
    install_model(model, staging, paths.model, step, accuracy)
    log.info("tool warm start done after %d SFT steps (train accuracy %.2f): %s", step, accuracy, paths.model)
