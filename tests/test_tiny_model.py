"""The tiny-model kit: a Hugging Face Llama folder with a character tokenizer and a chat template."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fulmen.demo.tiny_model import DEFAULT_ALPHABET, TinyModelSpec, build_tiny_model, load_tiny_model

TEXT = "12+7=19\nHello, World! {x: [1, 2]} ~`'\"\\"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"))


def test_folder_loads_offline_with_auto_classes(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The folder holds HF files that the Auto classes load with no network."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert model.config.model_type == "llama"
    assert (model.config.hidden_size, model.config.num_hidden_layers) == (64, 2)
    assert model.config.vocab_size == len(tokenizer)
    assert model.generation_config.eos_token_id == tokenizer.eos_token_id
    logits = model(torch.tensor([tokenizer.encode("12+7=")])).logits
    assert logits.shape == (1, 5, len(tokenizer))


def test_default_has_room_for_an_agents_prompt(folder: Path) -> None:
    """2048 positions: an agent framework's prompt with tools (about 440 tokens) and a few turns fit."""
    assert AutoModelForCausalLM.from_pretrained(folder).config.max_position_embeddings == 2048


def test_vllm_preset_from_the_command_line(tmp_path: Path) -> None:
    """`python -m fulmen.demo.tiny_model FOLDER --preset vllm` (the README's vLLM section) writes the preset's
    model: heads of at least 32 dimensions (vLLM's CPU attention refuses 16), the same size otherwise."""
    command = [sys.executable, "-m", "fulmen.demo.tiny_model", str(tmp_path / "m"), "--preset", "vllm", "--seed", "3"]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == str(tmp_path / "m")
    a, _ = load_tiny_model(tmp_path / "m")
    assert a.config.hidden_size // a.config.num_attention_heads >= 32 and a.config.hidden_size == 64
    b, _ = load_tiny_model(build_tiny_model(tmp_path / "b", preset="vllm", seed=3))
    assert b.config.num_attention_heads == a.config.num_attention_heads
    assert all(torch.equal(a.state_dict()[n], t) for n, t in b.state_dict().items())
    with pytest.raises(ValueError, match="preset"):
        build_tiny_model(tmp_path / "c", preset="huge")  # type: ignore[arg-type]


def test_one_token_per_character_and_exact_round_trip(folder: Path) -> None:
    """Encoding gives one token per character and decoding gives the text back, spaces included."""
    _, tokenizer = load_tiny_model(folder)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert len(ids) == len(TEXT)
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode(tokenizer.encode(DEFAULT_ALPHABET)) == DEFAULT_ALPHABET
    assert [tokenizer.decode([i]) for i in ids[:5]] == list(TEXT[:5])
    assert tokenizer.encode("é", add_special_tokens=False) == [tokenizer.unk_token_id]


def test_chat_template_renders_roles_and_generation_prompt(folder: Path) -> None:
    """apply_chat_template renders every role and ends with the assistant marker on request."""
    _, tokenizer = load_tiny_model(folder)
    messages = [
        {"role": "system", "content": "add"},
        {"role": "user", "content": "12+7="},
        {"role": "assistant", "content": [{"type": "text", "text": "19"}]},
        {"role": "tool", "content": "ok"},
    ]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<bos><|system|>add<eos><|user|>12+7=<eos><|assistant|>19<eos><|tool|>ok<eos><|assistant|>"
    encoded = tokenizer.apply_chat_template(messages[1:2], add_generation_prompt=True, tokenize=True)
    ids = encoded if isinstance(encoded, list) else encoded["input_ids"]  # transformers 5 returns a dict
    assert tokenizer.decode(ids) == "<bos><|user|>12+7=<eos><|assistant|>"
    assert ids[0] == tokenizer.bos_token_id and len(ids) == 1 + 1 + 5 + 1 + 1
    no_prompt = tokenizer.apply_chat_template(messages[1:2], tokenize=False)
    assert no_prompt == "<bos><|user|>12+7=<eos>"


def test_seed_makes_weights_deterministic(tmp_path: Path) -> None:
    """The same seed builds identical weights; another seed builds different ones."""
    a, _ = load_tiny_model(build_tiny_model(tmp_path / "a", seed=3))
    b, _ = load_tiny_model(build_tiny_model(tmp_path / "b", seed=3))
    c, _ = load_tiny_model(build_tiny_model(tmp_path / "c", seed=4))
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[n], sb[n]) for n in sa)
    assert not torch.equal(sa["lm_head.weight"], sc["lm_head.weight"])


def test_build_is_fast_and_honours_sizes(tmp_path: Path) -> None:
    """A custom-sized model builds in well under a few seconds and keeps the caller's RNG state."""
    state = torch.random.get_rng_state()
    started = time.perf_counter()
    folder = build_tiny_model(
        tmp_path,
        TinyModelSpec(hidden_size=32, num_layers=1, num_heads=2, max_position_embeddings=64),
        alphabet="0123456789+=",
    )
    assert time.perf_counter() - started < 3.0
    assert torch.equal(torch.random.get_rng_state(), state)
    model, tokenizer = load_tiny_model(folder)
    assert len(tokenizer) == 8 + 12
    assert model.config.max_position_embeddings == 64 and model.config.intermediate_size == 128


def test_fulmen_core_imports_without_torch() -> None:
    """Importing fulmen, its records, the tiny-model kit and model_versions does not import torch."""
    code = (
        "import sys, fulmen, fulmen.records, fulmen.demo.tiny_model, fulmen.versions.model_version; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
