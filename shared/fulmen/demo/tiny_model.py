"""A tiny Llama with a character-level tokenizer, saved in Hugging Face format, for tests, demos, benches.

`build_tiny_model(folder)`; ``python -m fulmen.demo.tiny_model FOLDER [--preset vllm]``. torch and
transformers are imported inside the functions. The tokenizer and chat format: docs/design/demo.md.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CHAT_TEMPLATE",
    "DEFAULT_ALPHABET",
    "PRESETS",
    "ROLES",
    "SPECIAL_TOKENS",
    "TinyModelSpec",
    "build_tiny_model",
    "load_tiny_model",
]

DEFAULT_ALPHABET = string.digits + string.ascii_letters + " " + string.punctuation + "\n"
ROLES = ("system", "user", "assistant", "tool")
PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK, *(f"<|{role}|>" for role in ROLES))


@dataclass(frozen=True)
class TinyModelSpec:
    """The architecture's numbers. ``hidden_size / num_heads`` is the head size, and below 32 vLLM's
    CPU attention refuses the model at its first completion (`PRESETS`). Positions cost no parameters
    (rotary embeddings).

    ``initializer_range`` is larger than Llama's 0.02 so the untrained model's next-token
    distributions are peaked: greedy choices then have clear margins, which keeps tests that compare
    batched and unbatched greedy output free of ties broken by float noise."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int | None = None  # None: 4 × hidden_size
    max_position_embeddings: int = 2048
    initializer_range: float = 0.2

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")


# vLLM's CPU attention refuses heads under 32, but with 2 heads of 32 instead of 4 of 16 the demo's
# SFT warm start stalls (train accuracy 0.09 after its 1000 steps, against 0.41 after 310, on 2 CPU
# cores), so that shape is a preset, not the default.
Preset = Literal["default", "vllm"]
PRESETS: dict[str, TinyModelSpec] = {"default": TinyModelSpec(), "vllm": TinyModelSpec(num_heads=2)}

# Content may be a string or a list of OpenAI-style parts ({"type": "text", "text": ...}); a missing
# content (an assistant turn that only calls tools) renders as nothing. With ``tools``, a system turn
# listing them (one JSON object a line, Hermes/Qwen style) comes first, and an assistant turn's
# ``tool_calls`` render as the model is asked to write them: ``<tool_call>{"name": ..., "arguments":
# {...}}</tool_call>``, which `fulmen_llm_proxy.backends.tool_calls` parses. Without tools and tool calls the
# rendering is what it always was.
TOOLS_PREAMBLE = (
    "{% if tools %}<|system|>You may call these tools:\n<tools>\n"
    "{% for tool in tools %}{{ (tool['function'] if tool['function'] is defined else tool) | tojson }}\n{% endfor %}"
    '</tools>\nTo call one, write <tool_call>{"name": <name>, "arguments": <object>}</tool_call>'
    "{{ eos_token }}{% endif %}"
)
TOOL_CALLS = (
    "{% if message['tool_calls'] is defined and message['tool_calls'] %}"
    "{% for call in message['tool_calls'] %}"
    "{% set function = call['function'] if call['function'] is defined else call %}"
    '<tool_call>{"name": {{ function[\'name\'] | tojson }}, "arguments": '
    "{% if function['arguments'] is string %}{{ function['arguments'] }}"
    "{% else %}{{ function['arguments'] | tojson }}{% endif %}}</tool_call>"
    "{% endfor %}{% endif %}"
)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    + TOOLS_PREAMBLE
    + "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% elif message['content'] %}{% for part in message['content'] %}{{ part['text'] }}{% endfor %}"
    "{% endif %}"
    + TOOL_CALLS
    + "{{ eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _tokenizer(alphabet: str) -> Any:
    """A PreTrainedTokenizerFast with one token per character and the special tokens first."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))  # keep order, drop repeats
    vocab = {token: i for i, token in enumerate([*SPECIAL_TOKENS, *chars])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    # Every character is its own piece ([\s\S] also matches newlines); Fuse joins pieces back
    # without the spaces WordLevel's default decoder would insert.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=list(SPECIAL_TOKENS[4:]),
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_model(
    folder: str | Path,
    spec: TinyModelSpec | None = None,
    *,
    preset: Preset = "default",
    alphabet: str = DEFAULT_ALPHABET,
    seed: int = 0,
) -> Path:
    """Build a randomly initialised tiny Llama (deterministic for a seed) and save it in ``folder``:
    the ``spec``'s architecture, by default the ``preset``'s (`PRESETS`); serve ``preset="vllm"``
    with vLLM on a CPU."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    if preset not in PRESETS:
        raise ValueError(f"preset {preset!r} unknown: use one of {', '.join(PRESETS)}")
    spec = spec or PRESETS[preset]
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(alphabet)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size or 4 * spec.hidden_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        # Separate input and output embeddings: a state dict without shared tensors travels as
        # safetensors with no special casing.
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # fork_rng: the caller's global RNG state is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def load_tiny_model(folder: str | Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The model (float32, eval mode) and tokenizer saved in ``folder``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return model, tokenizer


def main(argv: list[str] | None = None) -> None:
    """``python -m fulmen.demo.tiny_model FOLDER [--preset vllm] [--seed N]``: build a tiny model in FOLDER."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m fulmen.demo.tiny_model", description=main.__doc__)
    parser.add_argument("folder", type=Path, help="where to write the model (created if missing)")
    parser.add_argument("--preset", choices=list(PRESETS), default="default",
                        help="default: the demo's shape; vllm: heads vLLM serves on a CPU")
    parser.add_argument("--seed", type=int, default=0, help="weights' seed (default 0)")
    args = parser.parse_args(argv)
    print(build_tiny_model(args.folder, preset=args.preset, seed=args.seed))


if __name__ == "__main__":
    main()
