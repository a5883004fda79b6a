"""Agents to copy: ``examples.single_turn_agent``, ``examples.multi_turn_tool_agent``, and one per
agent framework in ``examples/<framework>/`` (``langgraph``, ``openai_agents``, ``autogen``, ``anthropic``).

Run them from the repository's root, so ``--agent examples.<module>:agent`` imports."""
