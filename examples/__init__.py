"""Agents to copy: ``examples.single_turn_agent`` and ``examples.multi_turn_tool_agent``.

Run them from the repository's root, so ``--agent examples.<module>:agent`` imports."""
