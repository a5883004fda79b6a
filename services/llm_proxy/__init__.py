"""The LLM proxy service: OpenAI-compatible, token-faithful, recorded (`fulmen llm-proxy`)."""
