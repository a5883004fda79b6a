"""The torch backend: a Hugging Face model in this process, continuous batching, LoRA, `n` choices,
and tool-call parsing.
"""
