"""An AutoGen AgentChat ``AssistantAgent`` through autogen-ext's OpenAI client pointed at the proxy."""
