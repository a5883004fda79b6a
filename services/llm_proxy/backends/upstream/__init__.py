"""Backends that call an upstream server over HTTP: the client, retries, rate limits, the response
cache, replicas, and the OpenAI, vLLM and Anthropic dialects.
"""
