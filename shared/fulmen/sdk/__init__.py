"""The agent SDK: what an agent imports (`fulmen.rollout`, `fulmen.emit_reward`, ...)."""

from fulmen.sdk.agent import Agent, FunctionAgent, load_agent, prompt_rollout, rollout
from fulmen.sdk.emit import emit_exception, emit_message, emit_object, emit_reward, operation
from fulmen.sdk.hooks import Hook
from fulmen.sdk.resources import LLM, PromptTemplate

__all__ = [
    "LLM",
    "Agent",
    "FunctionAgent",
    "Hook",
    "PromptTemplate",
    "emit_exception",
    "emit_message",
    "emit_object",
    "emit_reward",
    "load_agent",
    "operation",
    "prompt_rollout",
    "rollout",
]
