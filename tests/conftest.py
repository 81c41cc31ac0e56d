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

# A run with torch capped to a lower ISA (ATEN_CPU_CAPABILITY=avx2, docs/cpu_kernels.md) gets
# an inductor cache of its own: torch 2.13 reused kernels compiled uncapped on the same machine,
# and on a Zen 4 every compiled function then returned NaN (checked 2026-11-27); the other way
# round, an uncapped run loading a graph compiled capped corrupted the heap.
from hf_dsinfer.benchmark import separate_inductor_cache

separate_inductor_cache()

torch.set_num_threads(min(2, os.cpu_count() or 1))


# Tiny checkpoints on disk (safetensors + a tiny tokenizer), saved once per session, so that
# from_pretrained, pipeline and the offload store read them exactly as a real checkpoint.
import pytest
from switches import switch
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


# Native kernel tests run at every ISA tier this CPU has (HF_DSINFER_ISA caps the tier): a test
# module opts in with `pytestmark = pytest.mark.usefixtures("native_tier")`. Tests marked `amx`
# (they need AMX tiles, and their skipif says so) run at the CPU's own tier only.
def _native_tiers(amx_only: bool) -> list[str]:
    from hf_dsinfer.kernels import _native

    best = _native.cpu_tier()
    if amx_only:
        return [best]
    return list(_native.runnable_tiers())


def pytest_generate_tests(metafunc):
    if "native_tier" in metafunc.fixturenames:
        amx_only = metafunc.definition.get_closest_marker("amx") is not None
        metafunc.parametrize("native_tier", _native_tiers(amx_only), indirect=True)


@pytest.fixture
def native_tier(request, monkeypatch) -> str:

    switch(monkeypatch, isa=request.param)
    return request.param
