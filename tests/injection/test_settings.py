"""One settings object for the kernel switches (hf_dsinfer.settings): the environment gives its
defaults, read once; a model can carry its own (DSInferConfig.settings), in force around its
forward only, and explain reports what that model's calls see."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_dsinfer
from hf_dsinfer import settings
from hf_dsinfer.errors import DSInferConfigError
from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.kernels import _native
from tests.kernels.test_native_decode import _BASE  # head_dim 32: the native layer builds


def test_environment_gives_the_defaults_once(monkeypatch):
    monkeypatch.setattr(settings, "_defaults", None)
    monkeypatch.setenv("HF_DSINFER_NATIVE", "0")
    monkeypatch.setenv("HF_DSINFER_ISA", "AVX2")
    first = settings.current()
    assert (first.native, first.isa) == (False, "avx2")
    monkeypatch.setenv("HF_DSINFER_NATIVE", "1")  # later changes are not read...
    assert settings.current() is first
    old = settings.set_defaults()  # ...unless asked to read the environment again
    assert old is first and settings.current().native
    with pytest.raises(DSInferConfigError, match="'avx1024' is not an ISA tier"):
        settings.Settings.from_env({"HF_DSINFER_ISA": "avx1024"})
    with pytest.raises(DSInferConfigError, match=r"unknown \['nativ'\]"):
        settings.current().replace(nativ=False)


def test_use_is_scoped_to_its_block_and_thread():
    before = settings.current()
    seen = []
    with settings.use(native=False, amx=False) as inside:
        assert settings.current() is inside and not inside.native
        worker = threading.Thread(target=lambda: seen.append(settings.current()))
        worker.start()
        worker.join()
    assert seen == [before]  # another thread keeps its own (here: the defaults)
    assert settings.current() is before


def _model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(LlamaConfig(**_BASE), dtype=torch.bfloat16).eval()


@pytest.mark.skipif(not _native.available(), reason=f"{_native.why_unavailable()}")
def test_settings_per_model():
    base = _model()
    plain = hf_dsinfer.init_inference(copy.deepcopy(base))
    torch_only = hf_dsinfer.init_inference(copy.deepcopy(base), settings={"native": False})
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        tokens = [m.generate(ids, max_new_tokens=4, do_sample=False)
                  for m in (plain, torch_only)]
    assert torch.equal(*tokens)

    def paths(model):
        return {p for f in get_report(model).blocks.values() for p in f.paths.counts}

    assert "step_chain" in paths(plain) and paths(torch_only) == {"torch"}
    assert settings.current().native  # nothing leaked out of the model's forward
    text = hf_dsinfer.explain(torch_only)
    assert "settings for this model: native=False" in text
    assert "native kernels off: disabled by settings native=False" in text
    assert "native kernels off" not in hf_dsinfer.explain(plain)
    twin = copy.deepcopy(torch_only)  # a copy carries its own hooks, and revert takes them off
    hf_dsinfer.revert(twin)
    assert not twin._forward_pre_hooks and torch_only._forward_pre_hooks
    with pytest.raises(DSInferConfigError, match="DSInferConfig.settings: expected None or a"):
        hf_dsinfer.DSInferConfig(settings=["native"])
    with pytest.raises(DSInferConfigError, match="not an ISA tier"):
        hf_dsinfer.DSInferConfig(settings={"isa": "sse9"})
