"""Fixtures for the offload tests: tiny checkpoints saved as safetensors (from_pretrained reads
the decoder layers from them straight into the offload store), and a scratch offload folder."""

from __future__ import annotations

import pytest
from tiny_models import save_tiny


@pytest.fixture(scope="session")
def llama_ckpt(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def opt_ckpt(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory, "opt")
