"""The OpenAI Agents SDK on the proxy: its Responses model and its chat-completions model."""
