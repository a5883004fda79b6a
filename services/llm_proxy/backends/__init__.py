"""Backends that answer a `Call`: `torch/` in this process, `upstream/` over HTTP (OpenAI, vLLM,
Anthropic); `registry` picks one by name.
"""
