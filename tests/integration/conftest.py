"""Fixtures for the HF-integration tests: tiny models saved to disk with a tiny tokenizer, so
from_pretrained and pipeline run exactly as for a real checkpoint, offline."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory, "gpt2")
