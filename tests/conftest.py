"""Shared test setup: offline, and torch kept to the machine's cores."""

import os

# Nothing may download at test time: every model is built from a config or shipped in a package.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Triton kernels are tested on CPU tensors by the interpreter. Triton reads this when it is first
# imported, and transformers may import it while the test modules are collected, so it is set
# here, before anything else. (On a GPU machine, run with TRITON_INTERPRET=0.)
os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

torch.set_num_threads(min(2, os.cpu_count() or 1))


# Tiny checkpoints on disk (safetensors + a tiny tokenizer), saved once per session, so that
# from_pretrained, pipeline and the offload store read them exactly as a real checkpoint.
import pytest
from tiny_models import save_tiny


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory, "llama")


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory, "gpt2")


@pytest.fixture(scope="session")
def opt_dir(tmp_path_factory) -> str:
    return save_tiny(tmp_path_factory, "opt")
