"""Each path a fused block can take is recorded where it is chosen, and `explain` reports
exactly that record: every test forces one path, checks the record, and checks that the
"paths taken" cell of explain's table says the same."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    ContinuousBatchingConfig,
    DynamicCache,
    GenerationConfig,
    LlamaConfig,
    StaticCache,
)

import hf_dsinfer
from hf_dsinfer.injection.paths import PATHS
from hf_dsinfer.injection.walker import get_report
from hf_dsinfer.kernels import _native
from tests.kernels.test_native_decode import _BASE  # head_dim 32: the native layer builds
from tests.tiny_models import make_model, prompts

native = pytest.mark.skipif(not _native.available(),
                            reason=f"native kernels unavailable: {_native.why_unavailable()}")


def _recorded(model) -> dict[str, int]:
    counts: dict[str, int] = {}
    for fused in get_report(model).blocks.values():
        for path, n in fused.paths.counts.items():
            counts[path] = counts.get(path, 0) + n
    return counts


def _explained(model) -> dict[str, int]:
    """The 'paths taken' cells of explain's block rows, summed."""
    counts: dict[str, int] = {}
    for line in hf_dsinfer.explain(model).splitlines():
        if "| FusedBlock (" in line:
            cell = line.rstrip(" |").rsplit("|", 1)[1]
            for path, n in re.findall(r"\b(" + "|".join(PATHS) + r") (\d+)", cell):
                counts[path] = counts.get(path, 0) + int(n)
    return counts


def _agree(model, **expected: int) -> None:
    assert _recorded(model) == expected
    assert _explained(model) == expected


def _bf16_llama():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**_BASE), dtype=torch.bfloat16)
    return hf_dsinfer.init_inference(model.eval())


def test_torch_and_hf_paths():
    model = hf_dsinfer.init_inference(make_model("llama"))
    ids, mask = prompts(2)
    layers = len(get_report(model).blocks)
    with torch.inference_mode():
        model(ids, attention_mask=mask)
    _agree(model, torch=layers)
    with torch.no_grad():
        model(ids, attention_mask=mask, output_attentions=True)
    _agree(model, torch=layers, hf=layers)
    assert f"attention weights asked for: {layers}" in hf_dsinfer.explain(model)


@native
def test_native_layer_and_step_paths():
    model = _bf16_llama()
    layers = len(get_report(model).blocks)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache)  # prefill: torch
        model(ids[:, :1], past_key_values=cache)  # one DynamicCache sequence: one native call
        _agree(model, torch=layers, step_chain=layers)
        # hidden states asked for: the step loop refuses, each block takes its native layer
        model(ids[:, :1], past_key_values=cache, output_hidden_states=True)
        _agree(model, torch=layers, step_chain=layers, native=layers)
        static = StaticCache(config=model.config, max_cache_len=16)
        model(ids, past_key_values=static)  # prefill
        model(ids[:, :1], past_key_values=static)  # a static cache: the loop of layer calls
    _agree(model, torch=2 * layers, step_chain=layers, native=layers, step_loop=layers)


@native
def test_batched_native_path_where_the_cpu_has_amx():
    model = _bf16_llama()
    layer = next(iter(get_report(model).blocks.values())).decode_layer()
    if layer.rows_why is not None:
        pytest.skip(f"batched native layer not here: {layer.rows_why}")
    layers = len(get_report(model).blocks)
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 11, 12]])
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        model(ids, past_key_values=cache)
        model(ids[:, :1], past_key_values=cache, output_hidden_states=True)
    _agree(model, torch=layers, native_rows=layers)


def test_paged_path_under_continuous_batching():
    model = hf_dsinfer.init_inference(make_model("llama"))
    config = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=0)
    model.generate_batch([[5, 6, 7], [8, 9]], generation_config=config, warmup=False,
                         continuous_batching_config=ContinuousBatchingConfig(
                             max_batch_tokens=16, num_blocks=16, page_size=8))
    recorded = _recorded(model)
    assert set(recorded) == {"paged"} and recorded["paged"] > 0
    assert _explained(model) == recorded
