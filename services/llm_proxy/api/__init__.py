"""The APIs the proxy speaks, each over the one internal chat / completions call: OpenAI chat and
completions (`parsing`, `formatting`), Responses, Anthropic Messages; `dialects` ties them together.
"""
