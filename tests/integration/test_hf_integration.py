"""`import hf_dsinfer` makes dsinfer= work in from_pretrained, Auto classes and pipeline, keeps
save/reload working, and never lets pipeline hide an injection error."""

from __future__ import annotations

import pytest
import torch
from tiny_models import prompts, save_tiny, tiny_tokenizer
from transformers import AutoModelForCausalLM, TextIteratorStreamer, pipeline

import hf_dsinfer
from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.integration import shim

TEXTS = ["w5 w6 w7 w8 w9 w10 w11", "w20 w21", "w30 w31 w32 w33"]


def _logits(model, ids, mask):
    with torch.no_grad():
        return model(ids, attention_mask=mask).logits


@pytest.mark.parametrize("dsinfer", [True, {"kernels": "auto"}, hf_dsinfer.DSInferConfig()])
def test_from_pretrained_dsinfer(llama_dir, dsinfer):
    plain = AutoModelForCausalLM.from_pretrained(llama_dir)
    fused = AutoModelForCausalLM.from_pretrained(llama_dir, dsinfer=dsinfer)
    ids, mask = prompts()
    diff = (_logits(plain, ids, mask) - _logits(fused, ids, mask))[mask.bool()].abs().max()
    assert diff <= 1e-4
    assert all(n > 0 for n in hf_dsinfer.fused_call_counts(fused).values())
    assert "FusedBlock" in hf_dsinfer.explain(fused)
    assert "not injected" in hf_dsinfer.explain(plain)


def test_from_pretrained_dtype(llama_dir):
    fused = AutoModelForCausalLM.from_pretrained(llama_dir, dsinfer={"dtype": "bfloat16"})
    assert next(fused.parameters()).dtype == torch.bfloat16
    fused.float()  # injection does not change the weight format: dtype casts stay allowed
    assert next(fused.parameters()).dtype == torch.float32


def test_save_and_reload(llama_dir, tmp_path):
    fused = AutoModelForCausalLM.from_pretrained(llama_dir, dsinfer={"kernels": "ref"})
    fused.save_pretrained(tmp_path)
    ids, mask = prompts()
    expected = _logits(fused, ids, mask)
    # the saved config carries dsinfer: a plain reload with hf_dsinfer imported re-applies it
    again = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert hf_dsinfer.fused_call_counts(again)
    assert torch.allclose(_logits(again, ids, mask)[mask.bool()], expected[mask.bool()], atol=1e-5)
    # an explicit dsinfer= wins over the saved one
    other = AutoModelForCausalLM.from_pretrained(tmp_path, dsinfer={"kernels": "cpu"})
    assert get_report(other).config.kernels == "cpu"


def _pipe_outputs(pipe, **kwargs):
    out = pipe(TEXTS, max_new_tokens=12, do_sample=False, batch_size=3, **kwargs)
    return [o[0]["generated_text"] for o in out]


def test_pipeline_model_kwargs_padded_batch(llama_dir):
    plain = pipeline("text-generation", model=llama_dir)
    fused = pipeline("text-generation", model=llama_dir, model_kwargs={"dsinfer": True})
    assert hf_dsinfer.fused_call_counts(fused.model)
    assert _pipe_outputs(fused) == _pipe_outputs(plain)
    assert sum(hf_dsinfer.fused_call_counts(fused.model).values()) > 0


def test_pipeline_injected_model_and_streamer(gpt2_dir):
    tok = tiny_tokenizer()
    model = hf_dsinfer.init_inference(AutoModelForCausalLM.from_pretrained(gpt2_dir))
    fused = pipeline("text-generation", model=model, tokenizer=tok)
    plain = pipeline("text-generation", model=gpt2_dir)
    texts = []
    for pipe in (plain, fused):
        streamer = TextIteratorStreamer(tok, skip_prompt=True)
        out = pipe(TEXTS[0], max_new_tokens=10, do_sample=False, streamer=streamer)
        texts.append((out[0]["generated_text"], "".join(streamer)))
    assert texts[0] == texts[1]
    assert texts[1][1].strip(), "the streamer received no text"


def test_unsupported_model_error_surfaces_through_pipeline(tmp_path_factory):
    xglm_dir = save_tiny(tmp_path_factory, "xglm")
    with pytest.raises(hf_dsinfer.UnsupportedModelError, match="XGLMForCausalLM"):
        pipeline("text-generation", model=xglm_dir, dtype=torch.bfloat16,
                 model_kwargs={"dsinfer": True})
    # strict=False: loads and runs unmodified, and explain says so
    pipe = pipeline("text-generation", model=xglm_dir, model_kwargs={"dsinfer": {"strict": False}})
    assert "unmodified" in hf_dsinfer.explain(pipe.model)


def test_shim_is_idempotent_and_reversible(llama_dir):
    before = AutoModelForCausalLM.from_pretrained.__func__
    shim.install()
    assert AutoModelForCausalLM.from_pretrained.__func__ is before
    try:
        shim.uninstall()
        assert not shim.installed()
        with pytest.raises(TypeError):
            AutoModelForCausalLM.from_pretrained(llama_dir, dsinfer=True)
    finally:
        shim.install()
    assert shim.installed()
