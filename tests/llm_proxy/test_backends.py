"""The backend registry: names resolve to classes on use, and the builder names what is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fulmen.settings import ProxySettings as Settings
from fulmen_llm_proxy.backends.base import BASE_MODEL_VERSION
from fulmen_llm_proxy.backends.registry import BACKENDS, backend_class, make_backend


def test_every_registered_name_resolves_to_a_backend_class() -> None:
    """Each "module:Class" entry imports and names a class with the backend's system name."""
    for name in BACKENDS:
        cls = backend_class(name)
        assert cls.system == name


def test_unknown_backend_names_the_choices() -> None:
    """An unknown name is a ValueError that lists every registered backend."""
    with pytest.raises(ValueError, match="use torch, vllm, openai or anthropic"):
        backend_class("tgi")


def test_builder_names_the_missing_setting() -> None:
    """torch needs a model folder, vllm and openai need upstream URLs; the error says which flag."""
    with pytest.raises(ValueError, match="--model-dir"):
        make_backend(Settings(proxy_backend="torch", model_dir=None))
    with pytest.raises(ValueError, match="--upstream-urls"):
        make_backend(Settings(proxy_backend="vllm", upstream_urls=None))


def test_upstream_backend_is_built_from_the_urls() -> None:
    """Comma-separated URLs become one pool each; the backend serves the base version."""
    backend = make_backend(
        Settings(proxy_backend="openai", upstream_urls="http://a:1/v1, http://b:2", model_name="m")
    )
    assert backend.system == "openai"
    assert backend.model_names == ["m"]
    assert backend.model_version == BASE_MODEL_VERSION
    assert [pool.base_url for pool in backend.upstreams.pools] == ["http://a:1", "http://b:2"]


def test_choosing_a_backend_imports_no_torch() -> None:
    """The registry and the torch backend's module load without torch (it comes with the engine)."""
    code = (
        "import sys; from fulmen_llm_proxy.backends.registry import backend_class; backend_class('torch'); "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
